"""The tuner's candidate settings: plain lists of ``DecodeConfig`` field dicts, named and validated.

A space is built by one function per name (``SPACES``) from the model's generation and block
length, so a new decoder is one more ``append`` there. Every dict carries ``block_length`` and
``cache``; ``gen_length`` is the run's. Candidates are checked (``DecodeConfig`` and
``check_for_model``) before any model work: an invalid one is dropped with its reason, and two
dicts that make the same ``DecodeConfig`` are one candidate.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from ..core.config import MAX_BRANCHES, DecodeConfig, DecodeConfigError, check_for_model
from ..names import full_name

THRESHOLDS = (0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
FACTORS = (0.5, 1.0)
GATES = (0.9, 0.95, 0.98)  # PSD's accept_confidence


def canonical(settings: DecodeConfig) -> str:
    """Every field of ``settings`` as sorted JSON: the identity of a setting in the log and the space."""
    return json.dumps(dataclasses.asdict(settings), sort_keys=True)


def _fixed(gen_length: int, tokens: int) -> dict[str, Any]:
    return {"policy": "fixed", "steps": max(gen_length // tokens, 1)}


def _bases(gen_length: int) -> dict[str, dict[str, Any]]:
    bases = {f"fixed-{k}": _fixed(gen_length, k) for k in (1, 2, 4)}
    bases.update({f"threshold-{t:g}": {"policy": "threshold", "threshold": t} for t in THRESHOLDS})
    bases.update({f"factor-{f:g}": {"policy": "factor", "factor": f} for f in FACTORS})
    return bases


def depths(block_length: int) -> list[int]:
    """PSD depths searched: 1, 3, 7 and block_length - 1, each within the block and the branch cap."""
    cap = min(block_length - 1, MAX_BRANCHES - 1)
    return sorted({d for d in (1, 3, 7, block_length - 1) if 1 <= d <= cap} | ({cap} if cap >= 1 else set()))


def other_block_length(gen_length: int, block_length: int) -> int | None:
    """One more block length to try: the smallest divisor of ``gen_length`` above the model's, else
    the largest below it (None when ``gen_length`` has no other divisor above 1)."""
    divisors = [d for d in range(2, gen_length + 1) if gen_length % d == 0 and d != block_length]
    above = [d for d in divisors if d > block_length]
    below = [d for d in divisors if d < block_length]
    return above[0] if above else (below[-1] if below else None)


def default_space(gen_length: int, block_length: int) -> list[dict[str, Any]]:
    """A few dozen candidates (docs/tuning.md tabulates them): every base plain with the dual cache,
    eight of them and PSD on threshold-0.9 uncached, five and PSD on fixed-1 with the prefix cache;
    seven with the dual cache's window a quarter or half a block past the block (``vicinity``); PSD (tokens acceptance) at the searched depths on the fixed and the 0.9/0.95
    threshold bases, at depth 3 on the others; strict PSD on fixed-1 (both caches) and threshold-0.9; RPS on the
    threshold bases with its defaults and two variants; LLaDA2.1's token editing in five settings;
    deep PSD on fixed-1 uncached, and PSD
    drafting into the next block (``draft_next_block``) on fixed-1 and the 0.9/0.95 thresholds (uncached,
    and with the dual cache at a vicinity of a block), and
    on fixed-1 with its drafts gated by the verifier's confidence (``accept_confidence``, also
    within the block); a few settings at a second block length."""
    bases = _bases(gen_length)
    space: list[dict[str, Any]] = []

    def add(fields: dict[str, Any], cache: str = "dual", block: int = block_length) -> None:
        space.append({**fields, "cache": cache, "block_length": block})

    _plain_candidates(add, bases, block_length)
    _psd_candidates(add, bases, block_length)
    _next_block_candidates(add, bases, block_length)
    for name in ("threshold-0.9", "threshold-0.8", "threshold-0.7"):
        add({**bases[name], "decoder": "rps"})
    add({**bases["threshold-0.9"], "decoder": "rps", "k_max": 5})
    add({**bases["threshold-0.9"], "decoder": "rps", "pivot_tau": 0.8, "lam": 0.5})
    _edit_candidates(add)
    other = other_block_length(gen_length, block_length)
    if other is not None:
        for name in ("fixed-1", "threshold-0.9", "factor-1"):
            add(bases[name], block=other)
        for depth in (3, other - 1):
            add({**bases["threshold-0.9"], "decoder": "psd", "depth": min(depth, MAX_BRANCHES - 1)}, block=other)
    return space


Add = Callable[..., None]


def _plain_candidates(add: Add, bases: dict[str, dict], block_length: int) -> None:
    """Every base with the dual cache, some uncached, some with the prefix cache, some with the
    dual cache's window past the block."""
    for fields in bases.values():
        add(fields)
    for name in ("fixed-2", "fixed-4", "threshold-0.7", "threshold-0.9", "threshold-0.95", "threshold-0.98"):
        add(bases[name], cache="none")
    add(bases["threshold-0.99"], cache="none")
    add(bases["factor-1"], cache="none")
    # The prefix cache: exact keys before the block, the block and the rest of the canvas recomputed
    # each call (between the uncached decode and the dual cache in time and in accuracy).
    for name in ("fixed-1", "fixed-2", "threshold-0.9", "threshold-0.95", "threshold-0.98"):
        add(bases[name], cache="prefix")
    add({**bases["fixed-1"], "decoder": "psd", "depth": 3}, cache="prefix")
    # The dual cache with a window past the block (``vicinity``): the masks right after the block
    # recomputed each call, which recovers the accuracy the plain dual cache loses (docs/algorithms.md).
    for name, reach in (("fixed-1", (4,)), ("threshold-0.9", (4, 2)), ("threshold-0.95", (4, 2))):
        for part in reach:
            add({**bases[name], "vicinity": max(block_length // part, 1)})
    for name in ("threshold-0.98", "threshold-0.99"):
        add({**bases[name], "vicinity": max(block_length // 4, 1)})


def _psd_candidates(add: Add, bases: dict[str, dict], block_length: int) -> None:
    """PSD within the block: tokens acceptance at the searched depths, strict, deep uncached."""
    add({**bases["threshold-0.9"], "decoder": "psd", "depth": 3}, cache="none")
    for name in ("fixed-1", "fixed-2", "threshold-0.9", "threshold-0.95"):
        for depth in depths(block_length):
            add({**bases[name], "decoder": "psd", "depth": depth})
    for name in ("fixed-4", "threshold-0.7", "threshold-0.8", "threshold-0.98", "factor-1"):
        add({**bases[name], "decoder": "psd", "depth": 3})
    for name in ("fixed-1", "threshold-0.9"):
        for depth in (3, 7):
            add({**bases[name], "decoder": "psd", "depth": depth, "acceptance": "strict"})
    for depth in (3, 7):  # lossless against the default base (fixed-1, uncached) by construction
        add({**bases["fixed-1"], "decoder": "psd", "depth": depth, "acceptance": "strict"}, cache="none")
    for depth in (7, block_length - 1):  # deep tokens-acceptance PSD uncached: no block-start refresh call
        add({**bases["fixed-1"], "decoder": "psd", "depth": min(depth, MAX_BRANCHES - 1)}, cache="none")


def _edit_candidates(add: Add) -> None:
    """LLaDA2.1's token editing over ``threshold_schedule`` (one step per position at most): its
    quality mode (fill 0.7, edit 0.5; also uncached), its speed mode (fill 0.5, editing off), and a
    low fill corrected by editing at 0.7 or 0.5."""
    schedule = {"policy": "threshold_schedule", "decoder": "edit"}
    add({**schedule, "threshold": 0.7, "editing_threshold": 0.5})
    add({**schedule, "threshold": 0.7, "editing_threshold": 0.5}, cache="none")
    add({**schedule, "threshold": 0.5})
    for editing in (0.7, 0.5):
        add({**schedule, "threshold": 0.5, "editing_threshold": editing})


def _capped(reach: tuple[int, ...]) -> list[int]:
    return sorted({min(d, MAX_BRANCHES - 1) for d in reach if d >= 1})


def _next_block_candidates(add: Add, bases: dict[str, dict], block_length: int) -> None:
    """PSD drafting into the next block (uncached, and with the dual cache at a vicinity of a
    block), and fixed-1's drafts gated by the verifier's confidence."""
    deep = (block_length - 1, block_length + block_length // 2 - 1, 2 * block_length - 2)
    for name, reach in (("fixed-1", (7, *deep)), ("threshold-0.9", (3, 7)), ("threshold-0.95", (3, 7))):
        for depth in _capped(reach):  # drafts into the next block
            add({**bases[name], "decoder": "psd", "depth": depth, "draft_next_block": True}, cache="none")
    for name, depths_here in (("fixed-1", (block_length - 1,)), ("threshold-0.9", (3, 7)), ("threshold-0.95", (3, 7))):
        gate = {"accept_confidence": 0.95} if name == "fixed-1" else {}
        for depth in _capped(depths_here):  # into the next block with the dual cache, whose window reaches it
            fields = {**bases[name], "decoder": "psd", "depth": depth, "draft_next_block": True, **gate}
            add({**fields, "vicinity": block_length})
    gated = {**bases["fixed-1"], "decoder": "psd"}
    for gate in GATES:  # drafts also need the verifier's confidence (accept_confidence)
        for depth in _capped(deep):
            add({**gated, "depth": depth, "draft_next_block": True, "accept_confidence": gate}, cache="none")
        if gate > GATES[0]:  # within the block
            add({**gated, "depth": min(block_length - 1, MAX_BRANCHES - 1), "accept_confidence": gate}, cache="none")


def small_space(gen_length: int, block_length: int) -> list[dict[str, Any]]:
    """A handful for tests and a first look: one token per step losslessly sped up (strict PSD),
    two tokens per step, the threshold rule and PSD on it."""
    bases = _bases(gen_length)
    space = [
        {**bases["fixed-1"], "decoder": "psd", "depth": 3, "acceptance": "strict", "cache": "none"},
        {**bases["fixed-2"], "cache": "dual"},
        {**bases["threshold-0.9"], "cache": "dual"},
        {**bases["threshold-0.9"], "decoder": "psd", "depth": 3, "cache": "dual"},
    ]
    return [{**fields, "block_length": block_length} for fields in space]


SPACES = {"default": default_space, "small": small_space}

# DiffusionGemma's sampler: its settings are the entropy bound, the steps per canvas and adaptive
# stopping (``psd_jax.names``' entropy-bound names); there is no cache, decoder or block to choose.
ENTROPY_BOUNDS = (0.1, 0.3, 1.0, 3.0)
DENOISING_STEPS = (48, 32, 24, 16)
STOP_CONFIDENCES = (0.005, 0.02, 0.05)


def entropy_bound_space(gen_length: int, block_length: int) -> list[dict[str, Any]]:
    """Every entropy bound at every step count (adaptive stopping at the release's confidence), and
    looser stopping confidences at the release's bound and steps."""
    space = [
        {"entropy_bound": bound, "max_denoising_steps": steps} for bound in ENTROPY_BOUNDS for steps in DENOISING_STEPS
    ]
    space += [{"confidence_threshold": conf} for conf in STOP_CONFIDENCES[1:]]
    return [{**fields, "block_length": block_length} for fields in space]


def small_entropy_bound_space(gen_length: int, block_length: int) -> list[dict[str, Any]]:
    """Two for tests and a first look: a looser bound, and with half the steps."""
    space = [{"entropy_bound": 1.0}, {"entropy_bound": 1.0, "max_denoising_steps": 24}]
    return [{**fields, "block_length": block_length} for fields in space]


ENTROPY_BOUND_SPACES = {"default": entropy_bound_space, "small": small_entropy_bound_space}


@dataclasses.dataclass
class Space:
    candidates: dict[str, DecodeConfig]  # name -> settings, in the space's order
    dropped: list[tuple[dict[str, Any], str]]  # (fields, why)


def build_space(
    fields_list: list[dict[str, Any]],
    gen_length: int,
    mcfg,
    base: DecodeConfig,
    name_of: Callable[[DecodeConfig], str] = full_name,
    over: DecodeConfig | None = None,
) -> Space:
    """Validate every candidate for this model; drop the invalid ones (with the reason), the
    duplicates and the base itself (it is always evaluated). Each candidate is its fields over
    ``over`` (default ``DecodeConfig()``; DiffusionGemma's: the base, the release's settings), named
    by ``name_of`` (``names.entropy_bound_name`` for DiffusionGemma)."""
    candidates: dict[str, DecodeConfig] = {}
    seen = {canonical(base): "the base"}
    dropped: list[tuple[dict[str, Any], str]] = []
    for fields in fields_list:
        try:
            settings = (over or DecodeConfig()).replace(**{"gen_length": gen_length, **fields})
            check_for_model(settings, mcfg)
        except (DecodeConfigError, TypeError) as exc:
            dropped.append((fields, str(exc)))
            continue
        key = canonical(settings)
        if key in seen:
            dropped.append((fields, f"same setting as {seen[key]}"))
            continue
        name = name_of(settings)
        while name in candidates:
            name += "+"
        seen[key] = name
        candidates[name] = settings
    return Space(candidates, dropped)
