"""What a transfer policy is, and the count every scheduled policy reads from its table."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..rules import Array, ProgramFields


class Policy(Protocol):
    """A transfer policy: ``name`` is its ``DecodeConfig.policy``; ``per_block_steps``: its ``steps``
    are per block (as LLaDA2.0's and SDAR's decoders), not the total (``config.PER_BLOCK_STEPS``)."""

    name: str
    per_block_steps: bool

    def counts(self, program: ProgramFields) -> np.ndarray | None:
        """The per-step commit counts of one block (host-side), or ``None`` when confidence decides."""

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: Array | None, values) -> Array:
        """The positions to commit [B, N] (the caller keeps only ``valid`` ones): ``rank`` [B, N] from
        ``rules.ranks``, ``step`` [B] the rows' steps within their blocks, ``values`` the rows'
        runtime values (``threshold``, ``factor``: one per row, or the ``DecodeConfig``'s number)."""


def scheduled_count(xp, counts: Array, step: Array, remaining: Array) -> Array:
    """How many positions the schedule commits at ``step`` [B] (all remaining at or past the last step)."""
    last = counts.shape[0] - 1
    k = counts[xp.clip(step, 0, last)]  # integer-array indexing (the standard's since 2024.12)
    return xp.where(step >= last, remaining, k)
