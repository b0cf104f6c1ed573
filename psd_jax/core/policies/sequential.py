"""``sequential`` (SDAR ``generate.py``): the schedule's count of the leftmost masked positions
(upstream takes the positions from the first masked one on, all masked under this policy's own
steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Array
from .base import scheduled_count
from .fixed import Fixed


@dataclass(frozen=True)
class Sequential(Fixed):  # Fixed's count table (LLaDA's schedule)
    name: str = "sequential"
    per_block_steps: ClassVar[bool] = True  # ``steps`` counts per block, as upstream

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: Array, values) -> Array:
        leftmost = xp.cumulative_sum(xp.astype(valid, xp.int32), axis=-1) - 1
        return leftmost < scheduled_count(xp, counts, step, xp.sum(valid, axis=-1))[:, None]
