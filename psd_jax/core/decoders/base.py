"""The interface every decoder implements, and the pieces the engine shares between them.

One iteration of the decode loop: the policy's spatial commit ``s0`` (``spatial_commit``), the
decoder's K candidate canvases built from the current forward ``F(x)`` without a model call
(``Decoder.candidates``), ONE batched model call over all ``[B, K, N]`` candidates (the engine),
and the decoder's per-row choice among them (``Decoder.choose``), whose forward becomes the next
``F``. Decoders never see logits, only ``Prediction``s, and never call the model.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from .. import policies, rules
from ..predict import Prediction
from ..rules import forward_sizes
from ..runtime import Program, RowValues


@struct.dataclass
class Proposal:
    candidates: jax.Array  # [B, K, N] canvases to forward
    s0: jax.Array  # [B, N] the policy's commit (candidate 0)
    valid: jax.Array  # [B, N] masked positions of the current block before the commit
    needed: jax.Array  # [B] leading candidates the row can choose from (1: only s0); the rest need no forward
    state: Any = None  # the decoder's own typed state for ``choose`` (PSDState, RPSState; None for plain)


@struct.dataclass
class Choice:
    index: jax.Array  # [B] chosen candidate
    steps: jax.Array  # [B] schedule steps consumed (1 + accepted PSD levels)
    stats: dict  # increments of the decoder's statistics (``Decoder.stat_shapes``)


class Decoder(Protocol):
    """A decoder: its candidates, its choice among their forwards, and its statistics."""

    program: Program
    values: Any  # runtime.RowValues (one value per row); None where only shapes are read

    @property
    def branches(self) -> int:
        """K: canvases per row in one model call."""

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the per-row integer counters carried in the loop state."""

    def candidates(
        self,
        pred: Prediction,
        s0: jax.Array,
        chosen: jax.Array,
        valid: jax.Array,
        step: jax.Array,
        ahead: jax.Array | None = None,
    ) -> Proposal:
        """The K candidates of every row from ``F(x)`` and the policy's commit (``chosen``, ``s0``);
        ``ahead``: the next block's positions PSD may draft (``draft_next_block``), else None."""

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        """One candidate per row given the forward of every candidate (``preds`` [B, K, N])."""


def spatial_commit(
    pred: Prediction, canvas: jax.Array, valid: jax.Array, step: jax.Array, program: Program, values: RowValues
):
    """The policy step shared by every decoder: (commit mask S0, canvas s0); ``values``: the rows'
    runtime values."""
    return policies.spatial_commit(
        jnp, pred.conf, pred.token, canvas, valid, step, program, count_table(program), values
    )


def count_table(program: Program) -> jax.Array | None:
    """The scheduled policies' per-step counts as a constant of the compiled loop (``None`` for
    confidence-driven ones)."""
    counts = policies.step_counts(program)
    return None if counts is None else jnp.asarray(counts)


def zero_stats(decoder: Decoder, batch: int) -> dict[str, jax.Array]:
    return {name: jnp.zeros(shape, jnp.int32) for name, shape in decoder.stat_shapes(batch).items()}


def forward_size_index(needed: jax.Array, live: jax.Array, k: int) -> jax.Array:
    """Index into ``forward_sizes(k)`` (``rules.forward_sizes``) of the call that covers the live
    rows (0 if none is live)."""
    return rules.covering_index(jnp, forward_sizes(k), rules.most_needed(jnp, needed, live))
