"""RPS, ripple-pivot search (docs/algorithms.md "RPS").

Among the block's positions left masked by the policy's commit, the pivot is the one with the
highest entropy of its top-``k_max`` distribution whose top-``k_max`` mass reaches ``pivot_tau``.
Candidate 0 (the MASK branch) is ``s0``; candidate c sets the pivot to its c-th most probable
token, kept while that token's probability is at least ``ratio`` times the top one's. One call
forwards every branch; the branch with the best lookahead score (minus the mean entropy of the
other remaining positions, plus ``lam`` times the pivot value's log-probability under ``F(x)``)
wins, ties to MASK. Its rules are here (``rps_candidates``, ``rps_winner``, ``rps_stats``),
written against the array API so that the PyTorch backend runs the same ones.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import struct

from ..predict import Prediction
from ..rules import (
    Array,
    ProgramFields,
    arange_like,
    leading_true,
    one_hot,
    per_row,
)
from .base import Choice, DecoderBase, Proposal

LOG_FLOOR = 1e-30  # probabilities are clipped here before a log


# ------------------------------------------------------- the rules (array API: JAX and torch)


def rps_candidates(xp, topk_prob, topk_id, s0, chosen, valid, program: ProgramFields, values):
    """RPS's branches from F(x)'s top-k (docs/algorithms.md "RPS"): (candidates [B, k+1, N], the
    leading candidates each row can choose [B], and for ``rps_winner`` and the statistics a dict:
    ``searched``/``found`` [B], ``pivot`` [B], ``branch_ok`` [B, k], ``log_p`` [B, k], ``others``
    [B, N] the remaining positions other than the pivot)."""
    remaining = valid & ~chosen
    p = topk_prob  # [B, N, k]
    trunc_entropy = -xp.sum(p * xp.log(xp.clip(p, min=LOG_FLOOR)), axis=-1)
    eligible = remaining & (xp.sum(p, axis=-1) >= per_row(values.pivot_tau))
    found = xp.any(eligible, axis=-1)
    pivot = xp.argmax(xp.where(eligible, trunc_entropy, -float("inf")), axis=-1)  # ties: lower position
    pivot_p = xp.take_along_axis(p, pivot[:, None, None], axis=1)[:, 0]  # [B, k]
    pivot_ids = xp.take_along_axis(topk_id, pivot[:, None, None], axis=1)[:, 0]
    branch_ok = found[:, None] & (pivot_p >= per_row(values.ratio) * pivot_p[:, :1])
    at_pivot = arange_like(xp, s0.shape[-1], s0)[None, :] == pivot[:, None]  # [B, N]
    branches = xp.where(at_pivot[:, None, :], pivot_ids[:, :, None], s0[:, None, :])  # [B, k, N]
    state = {
        "searched": xp.any(remaining, axis=-1),
        "found": found,
        "pivot": pivot,
        "branch_ok": branch_ok,
        "log_p": xp.log(xp.clip(pivot_p, min=LOG_FLOOR)),
        "others": remaining & ~at_pivot,
    }
    candidates = xp.concat([s0[:, None], branches], axis=1)
    return candidates, 1 + leading_true(xp, branch_ok), state


def rps_winner(xp, others, entropy, log_p, branch_ok, live, lam) -> Array:
    """Per row the winning branch [B] (0: MASK; 0 for rows not ``live``): the valid branch with the
    best -mean entropy of ``others`` under its forward (``entropy`` [B, k+1, N]) + lam * log p of
    the pivot value under F(x); ties to the lower branch, so to MASK first. ``lam``: a number, or
    one per row [B]."""
    others = others[:, None, :]  # R \ {i*}
    n_others = xp.clip(xp.sum(others, axis=-1), min=1)
    mean_entropy = xp.sum(xp.where(others, entropy, 0.0), axis=-1) / n_others  # [B, K]
    plausibility = xp.concat([xp.zeros_like(log_p[:, :1]), log_p], axis=1)
    score = -mean_entropy + per_row(lam) * plausibility
    ok = xp.concat([xp.ones_like(branch_ok[:, :1]), branch_ok], axis=1)
    winner = xp.argmax(xp.where(ok, score, -float("inf")), axis=-1)
    return xp.where(live, winner, 0)


def rps_stats(xp, searched: Array, found: Array, winner: Array, live: Array, k_max: int) -> dict[str, Array]:
    """Increments of RPS's per-row statistics (``decoders.RPS.stat_shapes``), int32."""
    committed = winner > 0
    return {
        "pivot_searched": xp.astype(searched & live, xp.int32),
        "pivot_found": xp.astype(found & live, xp.int32),
        "pivot_committed": xp.astype(committed, xp.int32),
        "winner_rank": one_hot(xp, winner - 1, k_max) * xp.astype(committed[:, None], xp.int32),
    }


@struct.dataclass
class RPSState:
    searched: jax.Array  # [B] the row had remaining positions to search
    found: jax.Array  # [B] an eligible pivot exists
    pivot: jax.Array  # [B] its position
    branch_ok: jax.Array  # [B, k_max] pivot values passing the ratio filter
    log_p: jax.Array  # [B, k_max] their log-probabilities under F(x)
    others: jax.Array  # [B, N] remaining positions other than the pivot (scored by the lookahead)


@dataclasses.dataclass(frozen=True)
class RPS(DecoderBase):
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
        candidates, needed, state = rps_candidates(
            self.xp, pred.topk_prob, pred.topk_id, s0, chosen, valid, self.program, self.values
        )
        return Proposal(candidates, s0, valid, needed, RPSState(**state))

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        s: RPSState = proposal.state
        xp = self.xp
        winner = rps_winner(xp, s.others, preds.entropy, s.log_p, s.branch_ok, live, self.values.lam)
        stats = rps_stats(xp, s.searched, s.found, winner, live, self.program.k_max)
        return Choice(winner, xp.ones_like(winner), stats)
