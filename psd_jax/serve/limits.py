"""The operator's caps on one request's work: generation positions, prompt tokens, PSD depth, RPS
branches, body size, and which settings a client may change.

``DecodeConfig`` and ``config.check_for_model`` already refuse settings no decode can run (steps past
the generation, depth past the block, more than ``MAX_BRANCHES`` canvases, a generation past the
context); these limits are the server's tighter caps on top, so one client cannot take a batch's
worth of work. Each defaults to a value derived from the model and the server's settings, so a
server started without them refuses only what the model could not decode anyway.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..core.config import FIELD_HELP, MAX_BRANCHES, DecodeConfig

if TYPE_CHECKING:
    from models import ModelConfig

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a 512-token prompt as JSON ids is a few KB
ALL_FIELDS = frozenset(FIELD_HELP)
LIMIT_CODE = "limit_exceeded"  # the OpenAI ``code`` of every refusal by a server limit


class LimitError(ValueError):
    """Limits that cannot be served: a bad value, or default settings past the server's own limits."""


def overrides_from(text: str) -> frozenset[str]:
    """``--allow-overrides``: ``all``, ``none`` or comma-separated ``DecodeConfig`` field names."""
    word = text.strip().lower()
    if word in ("all", "none"):
        return ALL_FIELDS if word == "all" else frozenset()
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in FIELD_HELP]
    if unknown or not names:
        shown = repr(unknown[0]) if unknown else repr(text)
        raise LimitError(f"unknown DecodeConfig field {shown}; give all, none or some of: {', '.join(FIELD_HELP)}")
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for (``python -m psd_jax.serve``'s limit flags); ``for_model``
    derives the defaults."""

    max_tokens: int  # generation positions (max_tokens rounded up to whole blocks, or gen_length)
    max_prompt_tokens: int
    max_depth: int = MAX_BRANCHES - 1
    max_k_max: int = MAX_BRANCHES - 1
    max_body_bytes: int = MAX_BODY_BYTES
    overrides: frozenset[str] = ALL_FIELDS  # DecodeConfig fields a request may change

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_prompt_tokens", "max_k_max", "max_body_bytes", "max_depth"):
            value, least = getattr(self, name), 0 if name == "max_depth" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise LimitError(f"{name} must be an integer >= {least}, got {value!r}")
        unknown = sorted(set(self.overrides) - ALL_FIELDS)
        if unknown:
            raise LimitError(f"unknown DecodeConfig field {unknown[0]!r} in overrides")
        object.__setattr__(self, "overrides", frozenset(self.overrides))

    @classmethod
    def for_model(
        cls,
        mcfg: ModelConfig,
        defaults: DecodeConfig,
        prompt_bucket: int,
        *,
        max_tokens: int | None = None,
        max_prompt_tokens: int | None = None,
        max_depth: int | None = None,
        max_k_max: int | None = None,
        max_body_bytes: int | None = None,
        overrides: frozenset[str] | None = None,
    ) -> ServerLimits:
        """The limits given, the rest derived: positions up to the context less one prompt bucket
        (a one-bucket prompt always fits; at least the default gen_length), prompts up to the context less the default generation,
        depth and branches up to ``MAX_BRANCHES - 1``, 1 MiB bodies, every field overridable.
        ``LimitError`` if the server's default settings exceed them."""
        given = {
            "max_tokens": (
                max_tokens if max_tokens is not None else max(mcfg.max_length - prompt_bucket, defaults.gen_length)
            ),
            "max_prompt_tokens": (
                max_prompt_tokens if max_prompt_tokens is not None else mcfg.max_length - defaults.gen_length
            ),
            "max_depth": max_depth if max_depth is not None else MAX_BRANCHES - 1,
            "max_k_max": max_k_max if max_k_max is not None else MAX_BRANCHES - 1,
            "max_body_bytes": max_body_bytes if max_body_bytes is not None else MAX_BODY_BYTES,
            "overrides": overrides if overrides is not None else ALL_FIELDS,
        }
        limits = cls(**given)
        problem = limits.exceeded(defaults)
        if problem:
            raise LimitError(f"the server's default settings exceed its limits: {problem[1]}")
        return limits

    def exceeded(self, settings: DecodeConfig) -> tuple[str, str] | None:
        """``(field, message)`` of the first setting of ``settings`` past a limit, else ``None``."""
        if settings.gen_length > self.max_tokens:
            return "gen_length", self.past("gen_length", settings.gen_length, self.max_tokens, "--max-tokens")
        if settings.decoder == "psd" and settings.depth > self.max_depth:
            return "depth", self.past("depth", settings.depth, self.max_depth, "--max-depth")
        if settings.decoder == "rps" and settings.k_max > self.max_k_max:
            return "k_max", self.past("k_max", settings.k_max, self.max_k_max, "--max-k-max")
        return None

    @staticmethod
    def past(what: str, value: int, limit: int, flag: str) -> str:
        return f"{what} {value} exceeds this server's limit of {limit} ({flag})"
