"""``dream`` (Dream ``diffusion_generate``, maskgit_plus/entropy): the k_t most confident positions,
k_t from Dream's timestep schedule (linear in t from 1 to ``dream_eps``), so the last step commits
every remaining position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rules import ProgramFields
from ..schedules import dream_schedule
from .fixed import Fixed


@dataclass(frozen=True)
class Dream(Fixed):
    name: str = "dream"

    def counts(self, program: ProgramFields) -> np.ndarray:
        return dream_schedule(program.block_length, program.steps_per_block, program.dream_eps)
