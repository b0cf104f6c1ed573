"""Transfer policies (the spatial axis): which masked positions of its block a row commits in one
step (docs/algorithms.md "Policies").

Each policy owns its rules in a module of its own: its count table (the scheduled policies' per-step
counts, fixed by the block length and the steps; ``None`` for the confidence-driven ones) and its
commit rule. The commit rules are written against the Python array API (``xp``: ``jax.numpy`` in the
engine, ``array_api_compat.torch`` in the PyTorch backend), as ``rules`` is, so both backends run
the same bodies. Every rule is shape-static: top-k selections are ranks (``rank < k``), never
data-dependent shapes.
"""

from __future__ import annotations

import numpy as np

from ..rules import Array, ProgramFields, ranks
from .base import Policy
from .dream import Dream
from .factor import Factor
from .fixed import Fixed
from .sequential import Sequential
from .threshold import Threshold
from .threshold_schedule import ThresholdSchedule

# The one registration of a policy: ``config.POLICIES`` (the names ``DecodeConfig.policy`` accepts) and
# ``config.PER_BLOCK_STEPS`` are read from here.
POLICIES: dict[str, Policy] = {
    p.name: p for p in (Fixed(), Threshold(), Factor(), Dream(), ThresholdSchedule(), Sequential())
}


def policy_of(program: ProgramFields) -> Policy:
    try:
        return POLICIES[program.policy]
    except KeyError:
        raise ValueError(f"no commit rule for policy {program.policy!r}") from None


def step_counts(program: ProgramFields) -> np.ndarray | None:
    """Per-step commit counts of the scheduled policies (``None`` for confidence-driven ones)."""
    return policy_of(program).counts(program)


def commit_mask(
    xp, conf: Array, valid: Array, step: Array, program: ProgramFields, counts: Array | None, values
) -> Array:
    """The policy's commit set S for rows [B]: conf/valid [B, N], step [B]; ``counts``: its count
    table as an array of ``xp`` (``step_counts``, moved once by the caller)."""
    rank = ranks(xp, conf, valid)
    if program.predict_mask:
        # LLaDA's generate.py (policy ``fixed``): exactly the schedule's count at every step, the block's
        # last included, where ``fixed`` commits every position left; once a step wrote [MASK] (which
        # stays masked) more are left, and generate.py leaves them.
        chosen = rank < counts[xp.clip(step, 0, counts.shape[0] - 1)][:, None]
    else:
        chosen = policy_of(program).commit(xp, conf, valid, rank, step, counts, values)
    return chosen & valid


def spatial_commit(xp, conf, token, canvas, valid, step, program: ProgramFields, counts, values):
    """The policy step every decoder starts from: (commit mask S0 [B, N], canvas s0 [B, N])."""
    chosen = commit_mask(xp, conf, valid, step, program, counts, values)
    return chosen, xp.where(chosen, token, canvas)


__all__ = ["POLICIES", "Policy", "commit_mask", "policy_of", "spatial_commit", "step_counts"]
