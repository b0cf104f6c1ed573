"""RPS, ripple-pivot search (docs/algorithms.md "RPS").

Among the block's positions left masked by the policy's commit, the pivot is the one with the
highest entropy of its top-``k_max`` distribution whose top-``k_max`` mass reaches ``pivot_tau``.
Candidate 0 (the MASK branch) is ``s0``; candidate c sets the pivot to its c-th most probable
token, kept while that token's probability is at least ``ratio`` times the top one's. One call
forwards every branch; the branch with the best lookahead score (minus the mean entropy of the
other remaining positions, plus ``lam`` times the pivot value's log-probability under ``F(x)``)
wins, ties to MASK. The rules are ``psd_jax.rules`` (``rps_candidates``, ``rps_winner``,
``rps_stats``), shared with the PyTorch backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from .. import rules
from ..predict import Prediction
from ..runtime import Program
from .base import Choice, Proposal


@struct.dataclass
class RPSState:
    searched: jax.Array  # [B] the row had remaining positions to search
    found: jax.Array  # [B] an eligible pivot exists
    pivot: jax.Array  # [B] its position
    branch_ok: jax.Array  # [B, k_max] pivot values passing the ratio filter
    log_p: jax.Array  # [B, k_max] their log-probabilities under F(x)
    others: jax.Array  # [B, N] remaining positions other than the pivot (scored by the lookahead)


@dataclasses.dataclass(frozen=True)
class RPS:
    program: Program
    values: Any = None  # runtime.RowValues (one value per row); None where only shapes are read

    @property
    def branches(self) -> int:
        return self.program.k_max + 1

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {
            "pivot_searched": (batch,),
            "pivot_found": (batch,),
            "pivot_committed": (batch,),
            "winner_rank": (batch, self.program.k_max),
        }

    def candidates(
        self,
        pred: Prediction,
        s0: jax.Array,
        chosen: jax.Array,
        valid: jax.Array,
        step: jax.Array,
        ahead: jax.Array | None = None,
    ) -> Proposal:
        candidates, needed, state = rules.rps_candidates(
            jnp, pred.topk_prob, pred.topk_id, s0, chosen, valid, self.program, self.values
        )
        return Proposal(candidates, s0, valid, needed, RPSState(**state))

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        s: RPSState = proposal.state
        winner = rules.rps_winner(jnp, s.others, preds.entropy, s.log_p, s.branch_ok, live, self.values.lam)
        stats = rules.rps_stats(jnp, s.searched, s.found, winner, live, self.program.k_max)
        return Choice(winner, jnp.ones_like(winner), stats)
