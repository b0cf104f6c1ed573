"""``sequential`` (SDAR ``generate.py``): the schedule's count of the leftmost masked positions
(upstream takes the positions from the first masked one on, all masked under this policy's own
steps)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rules import Array, Settings
from ..schedules import llada_schedule
from .base import scheduled_count


@dataclass(frozen=True)
class Sequential:
    name: str = "sequential"

    def counts(self, dcfg: Settings) -> np.ndarray:
        return llada_schedule(dcfg.block_length, dcfg.steps_per_block)

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: Array, values) -> Array:
        leftmost = xp.cumulative_sum(xp.astype(valid, xp.int32), axis=-1) - 1
        return leftmost < scheduled_count(xp, counts, step, xp.sum(valid, axis=-1))[:, None]
