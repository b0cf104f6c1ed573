"""``dream`` (Dream ``diffusion_generate``, maskgit_plus/entropy): the k_t most confident positions,
k_t from Dream's timestep schedule (linear in t from 1 to ``dream_eps``), so the last step commits
every remaining position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rules import Settings
from ..schedules import dream_schedule
from .fixed import Fixed


@dataclass(frozen=True)
class Dream(Fixed):
    name: str = "dream"

    def counts(self, dcfg: Settings) -> np.ndarray:
        return dream_schedule(dcfg.block_length, dcfg.steps_per_block, dcfg.dream_eps)
