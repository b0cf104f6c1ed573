"""How each family's upstream decoder samples and stops, as plain data (``Sampler``,
``BlockStopRules``): part of a family's one registration (``models.families.FAMILIES``), read by
the decode (``psd_jax.core.sampling``, ``psd_jax.core.layouts``) so that the loop never branches on
a family's name. Host-side values, no JAX."""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol


class FilterSettings(Protocol):
    """The settings sampling reads (a ``DecodeConfig`` has them; named structurally so that this
    layer does not import the decode's settings)."""

    temperature: float
    top_p: float
    top_k: int


Filter = Literal["top_p", "top_k"]


def filters_set(c: FilterSettings) -> tuple[Filter, ...]:
    """The filters ``c`` turns on (top_p below 1, top_k above 0)."""
    return tuple(name for name, on in (("top_p", c.top_p < 1.0), ("top_k", c.top_k > 0)) if on)


@dataclasses.dataclass(frozen=True)
class Sampler:
    """How a family's upstream sampler treats temperature, top-p and top-k."""

    source: str  # the upstream function this reproduces
    order: tuple[Filter, Filter]  # which filter is applied first
    confidence: Literal["logits", "sampled"]  # softmax of the raw logits, or of those the token is drawn from
    filters_at_greedy: bool  # whether top-p/top-k apply at temperature 0

    def ignored(self, c: FilterSettings) -> str | None:
        """Why ``c``'s top-p/top-k would change nothing on this family, else None: they act only on
        the draw, and at temperature 0 there is none (unless the family filters at greedy too)."""
        filtering = [f"{name}={getattr(c, name)!r}" for name in ("top_p", "top_k") if name in filters_set(c)]
        if not filtering or c.temperature > 0 or self.filters_at_greedy:
            return None
        return (
            f"{', '.join(filtering)} would be ignored: at temperature 0 this family decodes the argmax and scores "
            f"its confidence on the unfiltered softmax ({self.source}); set temperature > 0"
        )


@dataclasses.dataclass(frozen=True)
class BlockStopRules:
    """When a block-causal family's upstream decoder stops a row, and what it returns after.

    - ``always_at_block_end``: a complete block whose row's generated part holds a stop id ends the
      row whatever ``eos_early_stop`` says (LLaDA2.0's ``generate``); otherwise only with it (SDAR's
      ``stopping_criteria_idx``).
    - ``mid_block``: with ``eos_early_stop``, a commit that places EOS also ends the row once every
      generated position before it is filled (LLaDA2.0's ``eos_early_stop``).
    - ``cut_after_eos``: the output holds EOS after the first EOS (upstream returns the sequence cut
      there); otherwise the finished blocks' tokens are returned as decoded, and only the positions
      no block decoded (upstream: still ``[MASK]``) hold EOS."""

    always_at_block_end: bool
    mid_block: bool
    cut_after_eos: bool
