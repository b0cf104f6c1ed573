"""A family's rules as the decode reads them: its ``Sampler`` (how its upstream sampler treats
temperature, top-p and top-k, and which softmax a confidence is read from: ``sampling``'s module
docstring) and, for a block-causal family, its ``BlockStopRules`` (when its upstream decoder stops a
row: ``layouts.BlockCausalLayout``). Both are part of the family's one registration,
``models.FAMILIES``; the loop never branches on a family's name."""

from __future__ import annotations

from models import FAMILIES
from models.sampling_rules import BlockStopRules, Filter, FilterSettings, Sampler, filters_set

__all__ = ["SAMPLERS", "BlockStopRules", "Filter", "FilterSettings", "Sampler", "block_stop_rules", "filters_set"]

# Each mask-token family's sampler, by family (DiffusionGemma decodes by its own: ``entropy_bound``).
SAMPLERS: dict[str, Sampler] = {name: f.sampler for name, f in FAMILIES.items() if f.sampler is not None}


def sampler_for(family: str) -> Sampler:
    return SAMPLERS[family]


def block_stop_rules(family: str) -> BlockStopRules:
    """A block-causal family's stop rules."""
    stops = FAMILIES[family].stops
    if stops is None:
        raise ValueError(f"family {family!r} is not block-causal: it has no block stop rules")
    return stops
