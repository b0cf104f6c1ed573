"""PSD, parallel speculative decoding (docs/algorithms.md "PSD").

Candidate 0 is the policy's commit ``s0``; candidate j (1..D) adds to ``s_{j-1}`` the next
``m_j`` most confident remaining positions of the block with their ``F(x)`` tokens (temporal
drafts from the same forward). One call verifies all of them; hierarchical acceptance keeps the
deepest level whose drafted tokens the verifier ``F(s_{j-1})`` reproduces (``tokens``), or, with
``strict``, whose positions the policy itself would choose at step + j (lossless).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from ..config import DecodeConfig
from ..policies import commit_mask, ranks, step_counts
from ..predict import Prediction
from .base import Choice, Proposal, leading_true


@struct.dataclass
class PSDState:
    levels: jax.Array  # [B, D, N] the positions draft level j adds beyond level j - 1


@dataclasses.dataclass(frozen=True)
class PSD:
    dcfg: DecodeConfig

    @property
    def branches(self) -> int:
        return self.dcfg.depth + 1

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {"accepted_depth": (batch, self.dcfg.depth + 1)}  # histogram of accepted levels

    def draft_sizes(self, chosen: jax.Array, step: jax.Array) -> jax.Array:
        """m_j for levels j = 1..D, per row: [B, D]."""
        dcfg = self.dcfg
        levels = jnp.arange(1, dcfg.depth + 1)
        if dcfg.policy == "fixed":
            # The schedule's next counts; past the last step nothing is drafted.
            counts = jnp.asarray(step_counts(dcfg))
            nxt = step[:, None] + levels[None, :]
            return jnp.where(nxt < counts.shape[0], counts[jnp.clip(nxt, 0, counts.shape[0] - 1)], 0)
        if dcfg.draft_rate is not None:
            rate = jnp.full(chosen.shape[:1], dcfg.draft_rate, jnp.int32)
        else:
            rate = jnp.maximum(1, chosen.sum(-1)).astype(jnp.int32)
        return jnp.broadcast_to(rate[:, None], (chosen.shape[0], dcfg.depth))

    def candidates(
        self, pred: Prediction, s0: jax.Array, chosen: jax.Array, valid: jax.Array, step: jax.Array
    ) -> Proposal:
        remaining = valid & ~chosen
        rank = ranks(pred.conf, remaining)  # confidence descending, ties to the lower position
        sizes = self.draft_sizes(chosen, step)  # [B, D]
        ends = jnp.cumsum(sizes, axis=-1)
        starts = ends - sizes
        r = rank[:, None, :]
        levels = remaining[:, None, :] & (r >= starts[..., None]) & (r < ends[..., None])
        cumulative = jnp.cumsum(levels, axis=1) > 0  # s_j = s_{j-1} + level j
        drafts = jnp.where(cumulative, pred.token[:, None, :], s0[:, None, :])
        candidates = jnp.concatenate([s0[:, None], drafts], axis=1)
        # Acceptance stops at the first empty level, so the levels after it are never chosen.
        return Proposal(candidates, s0, valid, 1 + leading_true(levels.any(-1)), PSDState(levels))

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        levels = proposal.state.levels  # [B, D, N]
        prev_token = preds.token[:, :-1]  # F(s_{j-1}) for j = 1..D
        draft_token = proposal.candidates[:, 1:]
        consistent = jnp.all(~levels | (prev_token == draft_token), axis=-1) & levels.any(-1)
        if self.dcfg.acceptance == "strict":
            consistent &= self._policy_agrees(proposal, preds, step, mask_id)
        accepted = jnp.where(live, leading_true(consistent), 0)
        hist = jax.nn.one_hot(accepted, self.dcfg.depth + 1, dtype=jnp.int32) * live[:, None]
        return Choice(accepted, 1 + accepted, {"accepted_depth": hist})

    def _policy_agrees(self, proposal: Proposal, preds: Prediction, step: jax.Array, mask_id: int) -> jax.Array:
        """[B, D]: the policy run on F(s_{j-1}) at step + j chooses exactly level j's positions."""
        levels = proposal.state.levels
        b, d, n = levels.shape
        valid_prev = proposal.valid[:, None, :] & (proposal.candidates[:, :-1] == mask_id)
        steps = step[:, None] + jnp.arange(1, d + 1)[None, :]
        choice = commit_mask(
            preds.conf[:, :-1].reshape(b * d, n), valid_prev.reshape(b * d, n), steps.reshape(b * d), self.dcfg
        ).reshape(b, d, n)
        return jnp.all(choice == levels, axis=-1)
