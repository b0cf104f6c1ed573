"""Plain decoding: the policy's commit alone (K = 1), as upstream LLaDA, Dream and Fast-dLLM."""

from __future__ import annotations

import dataclasses

import jax

from ..predict import Prediction
from ..rules import device_of
from .base import Choice, DecoderBase, Proposal


@dataclasses.dataclass(frozen=True)
class Plain(DecoderBase):
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
        xp = self.xp
        return Proposal(s0[:, None], s0, valid, xp.ones(s0.shape[:1], dtype=xp.int32, device=device_of(s0)))

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        xp, batch, device = self.xp, live.shape[0], device_of(live)
        return Choice(xp.zeros(batch, dtype=xp.int32, device=device), xp.ones(batch, dtype=xp.int32, device=device), {})
