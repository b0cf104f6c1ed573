"""``threshold_schedule`` (LLaDA2.0 ``generate``): the positions with confidence above the row's
``threshold`` if at least the schedule's k = min(k_t, remaining) of them qualify, else the k most
confident ones, so a step never commits fewer than the schedule."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rules import Array, Settings, per_row
from ..schedules import llada_schedule
from .base import scheduled_count


@dataclass(frozen=True)
class ThresholdSchedule:
    name: str = "threshold_schedule"

    def counts(self, dcfg: Settings) -> np.ndarray:
        return llada_schedule(dcfg.block_length, dcfg.steps_per_block)

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: Array, values) -> Array:
        remaining = xp.sum(valid, axis=-1)
        k = xp.minimum(scheduled_count(xp, counts, step, remaining), remaining)
        sure = valid & (conf > per_row(values.threshold))
        return xp.where((xp.sum(sure, axis=-1) >= k)[:, None], sure, rank < k[:, None])
