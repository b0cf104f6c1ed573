"""Token editing, LLaDA2.1's decoder (diffusers' ``LLaDA2Pipeline`` with its
``BlockRefinementScheduler``; docs/algorithms.md "LLaDA2.1: token editing").

Every model call fills masks of the current block by ``threshold_schedule`` (mask-to-token) and
also rewrites the block's written, non-prompt positions whose predicted token differs from the one
there with probability above the row's ``editing_threshold`` (token-to-token). A block whose masks
are all filled before its ``steps`` calls is re-run ("post" calls) while the previous call still
edited, at most ``max_post_steps + 1`` times. Earlier blocks are frozen, so the block cache stays
exact.

Here are the per-call rules (``edit_positions``) and the block's end (``block_end``), written against
the array API as the other decoders' rules; the block-causal layout that runs them
(``layouts.EditingLayout``) decides each row's block from its own counters, so a row decodes as
alone whatever shares its batch (the pipeline shares the counters across the batch).

Counters: ``step`` is the row's mask-filling step in its block while the block has masks; once they
are filled it is minus the post calls made (0 before the first). The engine adds 1 per decision
before it asks the layout (``Choice.steps``), which reads the counter back from that.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ..predict import Prediction
from ..rules import Array, device_of, per_row
from .base import Choice, DecoderBase, Proposal


def edit_positions(xp, token: Array, conf: Array, canvas: Array, editable: Array, editing_threshold) -> Array:
    """[B, N] the positions rewritten this call: editable (the current block's written, non-prompt
    positions of a decoding row) where the predicted token differs and its probability is above the
    row's threshold; none for a row whose threshold is 0 or negative (editing off)."""
    on = per_row(editing_threshold) > 0
    return editable & on & (conf > per_row(editing_threshold)) & (token != canvas)


def block_end(xp, had_mask: Array, has_mask: Array, edited: Array, step: Array, steps: int, values):
    """Each row's block after one decision: (block ends [B], the counter for the next call [B]).

    ``step``: the row's counter plus the engine's 1. While the block had masks: the fill step; the
    block ends at ``steps`` (masks or not, as the pipeline), and the post calls start (counter 0)
    once the masks are gone earlier. After: post = the post calls made so far, this one included;
    the block ends when editing is off, nothing was edited, or the cap is passed."""
    post = 2 - step  # counter = -(post calls before this one), plus 1
    editing = per_row(values.editing_threshold, 1) > 0
    ends = xp.where(had_mask, step >= steps, ~editing | ~edited | (post > per_row(values.max_post_steps, 1)))
    counter = xp.where(had_mask, xp.where(has_mask, step, 0), -post)
    return ends, counter


@dataclasses.dataclass(frozen=True)
class Edit(DecoderBase):
    """The fill commit ``s0`` and this call's edits as one candidate (K = 1): the pipeline's one
    update per call. Statistics: edits applied, and the post calls (decisions after the masks)."""

    @property
    def branches(self) -> int:
        return 1

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {"edits": (batch,), "post_calls": (batch,)}

    def ahead_positions(self, loop: Any, state: Any, frozen: jax.Array) -> jax.Array:
        """The current block's written positions it may rewrite (``layouts.EditingLayout.editable``)."""
        return loop.layout.editable(loop, state.canvas, state.block, frozen)

    def candidates(
        self,
        pred: Prediction,
        s0: jax.Array,
        chosen: jax.Array,
        valid: jax.Array,
        step: jax.Array,
        ahead: jax.Array | None = None,
    ) -> Proposal:
        """``ahead``: the editable positions (``layouts.EditingLayout.editable``)."""
        xp = self.xp
        edits = edit_positions(xp, pred.token, pred.conf, s0, ahead, self.values.editing_threshold)
        canvas = xp.where(edits, pred.token, s0)
        deciding = xp.any(valid | ahead, axis=-1)
        stats = {
            "edits": xp.sum(edits, axis=-1, dtype=xp.int32),
            "post_calls": xp.astype(deciding & ~xp.any(valid, axis=-1), xp.int32),
        }
        return Proposal(
            canvas[:, None], canvas, valid, xp.ones(s0.shape[:1], dtype=xp.int32, device=device_of(s0)), stats
        )

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        xp, batch, device = self.xp, live.shape[0], device_of(live)
        return Choice(
            xp.zeros(batch, dtype=xp.int32, device=device),
            xp.ones(batch, dtype=xp.int32, device=device),
            proposal.state,
        )
