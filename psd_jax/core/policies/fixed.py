"""``fixed`` (LLaDA ``generate.py``): the k_t most confident positions, k_t from LLaDA's
``get_num_transfer_tokens`` (the block's masked positions spread evenly over its steps)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rules import Array, Settings
from ..schedules import llada_schedule
from .base import scheduled_count


@dataclass(frozen=True)
class Fixed:
    name: str = "fixed"

    def counts(self, dcfg: Settings) -> np.ndarray:
        return llada_schedule(dcfg.block_length, dcfg.steps_per_block)

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: Array, values) -> Array:
        return rank < scheduled_count(xp, counts, step, xp.sum(valid, axis=-1))[:, None]
