"""PSD, parallel speculative decoding (docs/algorithms.md "PSD").

Candidate 0 is the policy's commit ``s0``; candidate j (1..D) adds to ``s_{j-1}`` the next
``m_j`` most confident remaining positions of the block with their ``F(x)`` tokens (temporal
drafts from the same forward). One call verifies all of them; hierarchical acceptance keeps the
deepest level whose drafted tokens the verifier ``F(s_{j-1})`` reproduces (``tokens``), or, with
``strict``, whose positions the policy itself would choose at step + j (lossless). The rules are
``psd_jax.rules`` (``psd_candidates``, ``psd_accepted``), shared with the PyTorch backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from .. import rules
from ..policies import count_table
from ..predict import Prediction
from ..runtime import Program
from .base import Choice, Proposal


@struct.dataclass
class PSDState:
    levels: jax.Array  # [B, D, N] the positions draft level j adds beyond level j - 1


@dataclasses.dataclass(frozen=True)
class PSD:
    program: Program
    values: Any = None  # runtime.RowValues (one value per row); None where only shapes are read

    @property
    def branches(self) -> int:
        return self.program.depth + 1

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {"accepted_depth": (batch, self.program.depth + 1)}  # histogram of accepted levels

    def candidates(
        self,
        pred: Prediction,
        s0: jax.Array,
        chosen: jax.Array,
        valid: jax.Array,
        step: jax.Array,
        ahead: jax.Array | None = None,
    ) -> Proposal:
        program = self.program
        candidates, levels, needed = rules.psd_candidates(
            jnp, pred.conf, pred.token, s0, chosen, valid, step, program, count_table(program), ahead
        )
        return Proposal(candidates, s0, valid, needed, PSDState(levels))

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        program = self.program
        levels = proposal.state.levels
        accepted = rules.psd_accepted(
            jnp, levels, proposal.candidates, proposal.valid, preds.token, preds.conf, live, step, program,
            count_table(program), mask_id, self.values,
        )  # fmt: skip
        hist = rules.one_hot(jnp, accepted, program.depth + 1) * live[:, None]
        return Choice(accepted, 1 + accepted, {"accepted_depth": hist})
