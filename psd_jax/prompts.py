"""Prompts in and text out: the checks of a decode request before any model work (seed, prompt
bucket, token ids), left padding to a bucketed length, and ``PromptIO``, text <-> ids for a loaded
model (shared by both backends)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models import ModelConfig

from .core.config import DecodeConfig, check_fields_for_model, check_for_model, settings_from
from .core.errors import InputError
from .core.lengths import check_context
from .core.runtime import row_keys
from .tokenizer import TokenizerError, encode_prompt

SEED_LIMIT = 2**32  # jax.random.key takes an unsigned 32-bit seed without 64-bit mode


def check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
        raise InputError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def check_prompt_bucket(bucket: int | None) -> None:
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise InputError(f"prompt_bucket must be a positive integer or None, got {bucket!r}")


def left_pad(
    ids: list[list[int]], cfg: ModelConfig, gen_length: int, bucket: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-padded with the pad id to a bucketed length, and their attention mask [B, P]."""
    length = check_context(max(len(p) for p in ids), bucket, gen_length, cfg.max_length)
    prompt_ids = np.full((len(ids), length), cfg.pad_id, np.int32)
    prompt_mask = np.zeros((len(ids), length), np.int32)
    for row, p in enumerate(ids):
        prompt_ids[row, length - len(p) :] = p
        prompt_mask[row, length - len(p) :] = 1
    return prompt_ids, prompt_mask


def token_ids(prompt: Any, what: str) -> list[int]:
    """A token-id prompt as a list of ints: integers only (``numpy`` integers too), never a float,
    string or bool silently turned into an id (``int(1.9)`` would be 1)."""
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence | np.ndarray):
        raise InputError(f"{what} must be text or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
    if bad:
        raise InputError(f"{what} has token ids that are not integers: {bad[:5]!r}")
    return [int(t) for t in prompt]


def text_pieces(
    decode: Callable[[list[int]], str], ids: Sequence[int], start: int = 0, end: int | None = None
) -> list[str]:
    """The text of each of ids ``start`` .. ``end`` as it reads inside the sequence: the difference of
    the decoded prefixes (a tokenizer's leading spaces and merged bytes come out right), or the id
    decoded alone where a prefix's text is not the next one's prefix."""
    end = len(ids) if end is None else end
    pieces, before = [], decode(list(ids[:start]))
    for i in range(start, end):
        text = decode(list(ids[: i + 1]))
        pieces.append(text[len(before) :] if text.startswith(before) else decode([ids[i]]))
        before = text
    return pieces


class PromptIO:
    """Text <-> ids for a model with ``config``, ``tokenizer`` and ``path`` (shared by both backends)."""

    config: ModelConfig
    tokenizer: Any
    path: Path

    def settings(self, settings: DecodeConfig | None = None, overrides: dict[str, Any] | None = None) -> DecodeConfig:
        """The settings ``generate`` decodes with: ``settings`` (default ``DecodeConfig()``) with
        keyword ``overrides`` applied, checked against the model (RPS reads the top ``k_max`` of the
        vocabulary); raises ``DecodeConfigError`` (front ends refuse bad requests before queueing)."""
        if settings is not None and not isinstance(settings, DecodeConfig):
            raise InputError(f"settings must be a DecodeConfig, got {type(settings).__name__}")
        overrides = dict(overrides or {})
        check_fields_for_model(overrides, self.config)
        dcfg = settings_from(settings or self.default_settings(), self.fitted(overrides))
        check_for_model(dcfg, self.config)
        return dcfg

    def default_settings(self) -> DecodeConfig:
        """The settings ``generate`` starts from when given none."""
        return DecodeConfig()

    def fitted(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """Keyword overrides as the model decodes them (DiffusionGemma: lengths in whole canvases)."""
        return overrides

    def request(
        self, prompts, settings, overrides: dict[str, Any], seed: int, chat: bool | None, prompt_bucket: int | None
    ) -> tuple[DecodeConfig, list[list[int]]]:
        """Every check of a ``generate`` call before any model work: (settings, prompt ids)."""
        dcfg = self.settings(settings, overrides)
        check_seed(seed)
        check_prompt_bucket(prompt_bucket)
        return dcfg, self.prompt_ids(prompts, chat)

    def row_requests(
        self, prompts: Sequence[Sequence[int]], settings: Sequence[DecodeConfig], seeds: Sequence[int]
    ) -> tuple[list[DecodeConfig], list[list[int]], np.ndarray]:
        """Every check of a ``start_rows`` call (rows of their own settings and seeds) before any
        model work: (settings, prompt ids, PRNG keys), row r keyed as ``generate([prompts[r]],
        seed=seeds[r])``'s only row."""
        checked = [self.settings(s) for s in settings]
        for seed in seeds:
            check_seed(seed)
        ids = self.prompt_ids(prompts)
        return checked, ids, row_keys(seeds, [0] * len(ids))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def uses_chat(self, prompt: str | Sequence[int], chat: bool | None) -> bool:
        """Whether ``prompt`` is wrapped in the chat template: ``chat=None`` (the default of every
        front end) means yes exactly when the prompt is text and the tokenizer has a template;
        token ids are never templated."""
        if not isinstance(prompt, str):
            return False
        return self.has_chat_template if chat is None else bool(chat)

    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path}: this checkpoint has no tokenizer; pass token ids instead of text")
        return encode_prompt(self.tokenizer, prompt, self.uses_chat(prompt, chat), str(self.path))

    def token_pieces(self, ids: Sequence[int], start: int = 0, end: int | None = None) -> list[str]:
        """The text of ids ``start`` .. ``end`` as each reads inside ``ids`` (``text_pieces``)."""
        return text_pieces(self.piece_decoder(), ids, start, end)

    def piece_decoder(self):
        """Ids to text with nothing skipped or cut, for drawing single tokens (``cli.show``): the
        tokenizer's ``decode``, or the ids themselves for a checkpoint without a tokenizer."""
        if self.tokenizer is None:
            return lambda ids: "".join(f"{t} " for t in ids)
        return lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_text(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        stop = set(self.config.stop_ids)
        cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
        return self.tokenizer.decode(list(ids[:cut]), skip_special_tokens=False)

    def prompt_ids(self, prompts: Sequence[str | Sequence[int]], chat: bool | None = None) -> list[list[int]]:
        """The token ids ``generate`` decodes, checked (non-empty, in the vocabulary)."""
        if isinstance(prompts, (str, bytes)):
            raise InputError("prompts must be a list of prompts (text or token-id lists), not one string")
        out = []
        for i, prompt in enumerate(prompts):
            ids = self.encode(prompt, chat) if isinstance(prompt, str) else token_ids(prompt, f"prompt {i}")
            if not ids:
                raise InputError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InputError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
                )
            out.append(ids)
        if not out:
            raise InputError("no prompts given")
        return out
