"""Plain decoding: the policy's commit alone (K = 1), as upstream LLaDA, Dream and Fast-dLLM."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..predict import Prediction
from ..runtime import Program
from .base import Choice, Proposal


@dataclasses.dataclass(frozen=True)
class Plain:
    program: Program
    values: Any = None  # runtime.RowValues (one value per row); None where only shapes are read

    @property
    def branches(self) -> int:
        return 1

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {}

    def candidates(
        self,
        pred: Prediction,
        s0: jax.Array,
        chosen: jax.Array,
        valid: jax.Array,
        step: jax.Array,
        ahead: jax.Array | None = None,
    ) -> Proposal:
        return Proposal(s0[:, None], s0, valid, jnp.ones(s0.shape[:1], jnp.int32))

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        batch = live.shape[0]
        return Choice(jnp.zeros(batch, jnp.int32), jnp.ones(batch, jnp.int32), {})
