"""A model family's registration on the decoding side: ``FAMILIES``, one entry per mask-token family.

Each entry says what the decode does differently for the family, so that the loop never branches
on its name: its ``Sampler`` (how its upstream sampler treats temperature, top-p and top-k, and
which softmax a confidence is read from: ``sampling``'s module docstring) and, for a block-causal
family, its ``BlockStopRules`` (when its upstream decoder stops a row, and what it returns after:
``layouts.BlockCausalLayout``). A new family adds its row here; besides, it has its config and
module in ``models`` (with its row in ``models.FAMILIES``) and its key table in
``convert/keys.py`` (docs/architecture.md "Where to add").

Host-side and free of JAX, so ``config`` can ask what a family ignores without loading it.
DiffusionGemma has no entry: it decodes by its own entropy-bound sampler (``entropy_bound``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol


class FilterSettings(Protocol):
    """The settings sampling reads (a ``DecodeConfig`` has them; named structurally so the
    config module, which asks this one what a family ignores, is not imported back)."""

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


@dataclasses.dataclass(frozen=True)
class Family:
    """A mask-token family as the decode sees it: its sampler, and its stop rules if block-causal
    (``ModelConfig.block_causal``; None for a flat family, whose rule is ``rules.advance``)."""

    sampler: Sampler
    stops: BlockStopRules | None = None


LLADA_SAMPLER = Sampler("LLaDA generate.py get_transfer_index", ("top_p", "top_k"), "logits", False)

FAMILIES: dict[str, Family] = {
    "llada": Family(LLADA_SAMPLER),
    "dream": Family(Sampler("Dream generation_utils.sample_tokens", ("top_p", "top_k"), "sampled", True)),
    "llada2_moe": Family(
        Sampler("LLaDA2.0 generate _sample_with_temperature_topk_topp", ("top_k", "top_p"), "sampled", False),
        BlockStopRules(always_at_block_end=True, mid_block=True, cut_after_eos=True),
    ),
    "lladamoe": Family(LLADA_SAMPLER),  # its model card decodes it with LLaDA's generate.py
    "sdar": Family(
        Sampler("SDAR generate.py sample_with_temperature_topk_topp", ("top_k", "top_p"), "sampled", True),
        BlockStopRules(always_at_block_end=False, mid_block=False, cut_after_eos=False),
    ),
}

# Each family's sampler, by family (``sampling``'s name for them).
SAMPLERS: dict[str, Sampler] = {name: family.sampler for name, family in FAMILIES.items()}


def family_of(name: str) -> Family:
    """The registration of family ``name`` (a ``ModelConfig.family``)."""
    return FAMILIES[name]


def sampler_for(family: str) -> Sampler:
    return family_of(family).sampler


def block_stop_rules(family: str) -> BlockStopRules:
    """A block-causal family's stop rules."""
    stops = family_of(family).stops
    if stops is None:
        raise ValueError(f"family {family!r} is not block-causal: it has no block stop rules")
    return stops
