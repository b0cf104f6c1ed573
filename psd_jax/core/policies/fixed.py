"""``fixed`` (LLaDA ``generate.py``): the k_t most confident positions, k_t from LLaDA's
``get_num_transfer_tokens`` (the block's masked positions spread evenly over its steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..rules import Array, ProgramFields
from ..schedules import llada_schedule
from .base import scheduled_count


@dataclass(frozen=True)
class Fixed:
    name: str = "fixed"
    per_block_steps: ClassVar[bool] = False

    def counts(self, program: ProgramFields) -> np.ndarray:
        return llada_schedule(program.block_length, program.steps_per_block)

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: Array, values) -> Array:
        return rank < scheduled_count(xp, counts, step, xp.sum(valid, axis=-1))[:, None]
