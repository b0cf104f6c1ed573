"""PSD, parallel speculative decoding (docs/algorithms.md "PSD").

Candidate 0 is the policy's commit ``s0``; candidate j (1..D) adds to ``s_{j-1}`` the next
``m_j`` most confident remaining positions of the block with their ``F(x)`` tokens (temporal
drafts from the same forward). One call verifies all of them; hierarchical acceptance keeps the
deepest level whose drafted tokens the verifier ``F(s_{j-1})`` reproduces (``tokens``), or, with
``strict``, whose positions the policy itself would choose at step + j (lossless). Its rules are
here (``draft_sizes``, ``psd_candidates``, ``psd_accepted``), written against the array API so
that the PyTorch backend runs the same ones, and so is what the engine asks PSD for: the next
block's positions it drafts into with ``draft_next_block`` (``next_block_drafts``, through
``PSD.ahead_positions``). ``rules`` holds what every decoder shares, the block advance and logit
window that drafts into the next block widen included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from .. import rules
from ..policies import commit_mask
from ..predict import Prediction
from ..rules import (
    Array,
    ProgramFields,
    arange_like,
    device_of,
    leading_true,
    per_row,
    ranks,
    repeat_rows,
)
from .base import Choice, DecoderBase, Proposal

# ------------------------------------------------------- the rules (array API: JAX and torch)


def draft_sizes(xp, chosen: Array, step: Array, program: ProgramFields, counts: Array | None) -> Array:
    """m_j for levels j = 1..D, per row: [B, D]. ``fixed``: the schedule's next counts (0 past its
    last step, or with ``draft_next_block`` past the next block's last); otherwise ``draft_rate``, or the policy's own commit count (at least 1)."""
    batch, depth = chosen.shape[0], program.depth
    if program.policy == "fixed":
        n_counts = counts.shape[0]
        nxt = step[:, None] + arange_like(xp, depth, step)[None, :] + 1
        if program.draft_next_block:  # the next block's schedule follows this one's
            return xp.where(nxt < 2 * n_counts, counts[nxt % n_counts], 0)
        return xp.where(nxt < n_counts, counts[xp.clip(nxt, 0, n_counts - 1)], 0)
    if program.draft_rate is not None:
        rate = xp.full((batch,), program.draft_rate, dtype=xp.int32, device=device_of(step))
    else:
        rate = xp.astype(xp.clip(xp.sum(chosen, axis=-1), min=1), xp.int32)
    return xp.broadcast_to(rate[:, None], (batch, depth))


def draft_levels(xp, rank: Array, remaining: Array, sizes: Array) -> Array:
    """[B, D, N]: the positions level j adds, the next ``sizes[:, j]`` of ``remaining`` by rank."""
    ends = xp.cumulative_sum(sizes, axis=-1)
    starts = ends - sizes
    r = rank[:, None, :]
    return remaining[:, None, :] & (r >= starts[..., None]) & (r < ends[..., None])


def psd_candidates(xp, conf, token, s0, chosen, valid, step, program: ProgramFields, counts, ahead=None):
    """PSD's candidates [B, D+1, N] (s0, then s_j = s_{j-1} + level j with F(x)'s tokens), the
    levels [B, D, N] and the leading candidates each row can choose [B] (acceptance stops at the
    first empty level, so the levels after it are never chosen). ``ahead`` [B, N]
    (``draft_next_block``): the next block's masked positions; a level drafts them, all but the
    least confident (so that drafts never complete that block), once the block's own are used up."""
    remaining = valid & ~chosen
    rank = ranks(xp, conf, remaining)  # confidence descending, ties to the lower position
    if ahead is not None:  # after the block's own, in their own confidence order, never the last one
        own = xp.sum(xp.astype(remaining, xp.int32), axis=-1)
        ahead_rank = ranks(xp, conf, ahead)
        ahead = ahead & (ahead_rank < (xp.sum(xp.astype(ahead, xp.int32), axis=-1) - 1)[:, None])
        rank = xp.where(remaining, rank, ahead_rank + own[:, None])
        remaining = remaining | ahead
    levels = draft_levels(xp, rank, remaining, draft_sizes(xp, chosen, step, program, counts))
    cumulative = xp.cumulative_sum(xp.astype(levels, xp.int32), axis=1) > 0
    drafts = xp.where(cumulative, token[:, None, :], s0[:, None, :])
    candidates = xp.concat([s0[:, None], drafts], axis=1)
    return candidates, levels, 1 + leading_true(xp, xp.any(levels, axis=-1))


def psd_accepted(
    xp,
    levels,
    candidates,
    valid,
    verified_token,
    verified_conf,
    live,
    step,
    program: ProgramFields,
    counts,
    mask_id: int,
    values,
):
    """Hierarchical acceptance: per row the number of leading consistent levels [B] (0 for rows
    not ``live``). Level j is consistent when non-empty and F(s_{j-1})'s tokens
    (``verified_token[:, j - 1]``) equal its drafts (with ``accept_confidence`` > 0, where
    F(s_{j-1})'s confidence ``verified_conf`` is at least that value); ``strict`` also asks that the policy run on
    F(s_{j-1}) at step + j chooses exactly its positions (lossless)."""
    draft_token = candidates[:, 1:]
    agrees = verified_token[:, :-1] == draft_token
    if program.gated:  # tokens acceptance only; the value is each row's
        least = per_row(values.accept_confidence, 3)
        agrees = agrees & (verified_conf[:, :-1] >= least)
    consistent = xp.all(~levels | agrees, axis=-1) & xp.any(levels, axis=-1)
    if program.acceptance == "strict":
        b, d, n = levels.shape
        valid_prev = valid[:, None, :] & (candidates[:, :-1] == mask_id)
        steps = step[:, None] + arange_like(xp, d, step)[None, :] + 1
        choice = commit_mask(
            xp,
            xp.reshape(verified_conf[:, :-1], (b * d, n)),
            xp.reshape(valid_prev, (b * d, n)),
            xp.reshape(steps, (b * d,)),
            program,
            counts,
            repeat_rows(values, d),
        )
        consistent = consistent & xp.all(xp.reshape(choice, (b, d, n)) == levels, axis=-1)
    return xp.where(live, leading_true(xp, consistent), 0)


def next_block_drafts(loop: Any, state: Any, rows: Array) -> Array:
    """[B, N] the masked positions of the next block of ``rows``, which PSD may draft
    (``draft_next_block``): none for a row whose generation ends with its current block. ``loop``
    and ``state``: the engine's ``Loop`` and ``DecodeState``."""
    nxt = state.block + 1
    live = rows & ~state.done & (nxt < state.values.num_blocks)
    start = loop.block_span(nxt)[0]
    return rules.committable(jnp, state.canvas, start, ~live, loop.program.block_length, loop.mcfg.mask_id)


@struct.dataclass
class PSDState:
    levels: jax.Array  # [B, D, N] the positions draft level j adds beyond level j - 1


@dataclasses.dataclass(frozen=True)
class PSD(DecoderBase):
    @property
    def branches(self) -> int:
        return self.program.depth + 1

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {"accepted_depth": (batch, self.program.depth + 1)}  # histogram of accepted levels

    def ahead_positions(self, loop: Any, state: Any, frozen: jax.Array) -> jax.Array | None:
        """The next block's masks (``draft_next_block``), else None."""
        return next_block_drafts(loop, state, ~frozen) if self.program.draft_next_block else None

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
        candidates, levels, needed = psd_candidates(
            self.xp, pred.conf, pred.token, s0, chosen, valid, step, program, self.count_table(), ahead
        )
        return Proposal(candidates, s0, valid, needed, PSDState(levels))

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        program = self.program
        levels = proposal.state.levels
        accepted = psd_accepted(
            self.xp, levels, proposal.candidates, proposal.valid, preds.token, preds.conf, live, step, program,
            self.count_table(), mask_id, self.values,
        )  # fmt: skip
        hist = rules.one_hot(self.xp, accepted, program.depth + 1) * live[:, None]
        return Choice(accepted, 1 + accepted, {"accepted_depth": hist})
