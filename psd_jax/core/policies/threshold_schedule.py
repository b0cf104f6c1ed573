"""``threshold_schedule`` (LLaDA2.0 ``generate``): the positions with confidence above the row's
``threshold`` if at least the schedule's k = min(k_t, remaining) of them qualify, else the k most
confident ones, so a step never commits fewer than the schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Array, per_row
from .base import scheduled_count
from .fixed import Fixed


@dataclass(frozen=True)
class ThresholdSchedule(Fixed):  # Fixed's count table (LLaDA's schedule)
    name: str = "threshold_schedule"
    per_block_steps: ClassVar[bool] = True  # ``steps`` counts per block, as upstream

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: Array, values) -> Array:
        remaining = xp.sum(valid, axis=-1)
        k = xp.minimum(scheduled_count(xp, counts, step, remaining), remaining)
        sure = valid & (conf > per_row(values.threshold))
        return xp.where((xp.sum(sure, axis=-1) >= k)[:, None], sure, rank < k[:, None])
