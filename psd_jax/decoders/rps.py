"""RPS, ripple-pivot search (docs/algorithms.md "RPS").

Among the block's positions left masked by the policy's commit, the pivot is the one with the
highest entropy of its top-``k_max`` distribution whose top-``k_max`` mass reaches ``pivot_tau``.
Candidate 0 (the MASK branch) is ``s0``; candidate c sets the pivot to its c-th most probable
token, kept while that token's probability is at least ``ratio`` times the top one's. One call
forwards every branch; the branch with the best lookahead score (minus the mean entropy of the
other remaining positions, plus ``lam`` times the pivot value's log-probability under ``F(x)``)
wins, ties to MASK.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from ..config import DecodeConfig
from ..predict import Prediction
from .base import Choice, Proposal, leading_true

LOG_FLOOR = 1e-30  # probabilities are clipped here before a log


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
    dcfg: DecodeConfig

    @property
    def branches(self) -> int:
        return self.dcfg.k_max + 1

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {
            "pivot_searched": (batch,),
            "pivot_found": (batch,),
            "pivot_committed": (batch,),
            "winner_rank": (batch, self.dcfg.k_max),
        }

    def candidates(
        self, pred: Prediction, s0: jax.Array, chosen: jax.Array, valid: jax.Array, step: jax.Array
    ) -> Proposal:
        dcfg = self.dcfg
        remaining = valid & ~chosen
        p, ids = pred.topk_prob, pred.topk_id  # [B, N, k] from F(x)
        trunc_entropy = -jnp.sum(p * jnp.log(jnp.maximum(p, LOG_FLOOR)), axis=-1)
        eligible = remaining & (p.sum(-1) >= dcfg.pivot_tau)
        found = eligible.any(-1)
        pivot = jnp.argmax(jnp.where(eligible, trunc_entropy, -jnp.inf), axis=-1)  # ties: lower position
        pivot_p = jnp.take_along_axis(p, pivot[:, None, None], axis=1)[:, 0]  # [B, k]
        pivot_ids = jnp.take_along_axis(ids, pivot[:, None, None], axis=1)[:, 0]
        branch_ok = found[:, None] & (pivot_p >= dcfg.ratio * pivot_p[:, :1])
        at_pivot = jnp.arange(s0.shape[-1])[None, :] == pivot[:, None]  # [B, N]
        branches = jnp.where(at_pivot[:, None, :], pivot_ids[:, :, None], s0[:, None, :])  # [B, k, N]
        state = RPSState(
            remaining.any(-1), found, pivot, branch_ok, jnp.log(jnp.maximum(pivot_p, LOG_FLOOR)), remaining & ~at_pivot
        )
        candidates = jnp.concatenate([s0[:, None], branches], axis=1)
        return Proposal(candidates, s0, valid, 1 + leading_true(branch_ok), state)

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        s: RPSState = proposal.state
        others = s.others[:, None, :]  # R \ {i*}
        n_others = jnp.maximum(others.sum(-1), 1)
        mean_entropy = jnp.sum(jnp.where(others, preds.entropy, 0.0), axis=-1) / n_others  # [B, K]
        plausibility = jnp.concatenate([jnp.zeros_like(s.log_p[:, :1]), s.log_p], axis=1)
        score = -mean_entropy + self.dcfg.lam * plausibility
        ok = jnp.concatenate([jnp.ones_like(s.branch_ok[:, :1]), s.branch_ok], axis=1)
        winner = jnp.argmax(jnp.where(ok, score, -jnp.inf), axis=-1).astype(jnp.int32)  # ties: MASK first
        winner = jnp.where(live, winner, 0)
        committed = winner > 0
        live_i = live.astype(jnp.int32)
        stats = {
            "pivot_searched": s.searched * live_i,
            "pivot_found": s.found * live_i,
            "pivot_committed": committed.astype(jnp.int32),
            "winner_rank": jax.nn.one_hot(winner - 1, self.dcfg.k_max, dtype=jnp.int32) * committed[:, None],
        }
        return Choice(winner, jnp.ones_like(winner), stats)
