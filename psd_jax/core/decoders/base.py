"""The interface every decoder implements, and the pieces the engine shares between them.

One iteration of the decode loop: the policy's spatial commit ``s0`` (``spatial_commit``), the
decoder's K candidate canvases built from the current forward ``F(x)`` without a model call
(``Decoder.candidates``), ONE batched model call over all ``[B, K, N]`` candidates (the engine),
and the decoder's per-row choice among them (``Decoder.choose``), whose forward becomes the next
``F``. Decoders never see logits, only ``Prediction``s, and never call the model.

A decoder object is written against the array API (``DecoderBase.xp``), so both backends run the
same one: the engine with ``jax.numpy``, the PyTorch backend (``torch_backend.decode``) with
``array_api_compat.torch``. ``decoders.DECODERS`` is the one place a decoder is registered.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from .. import policies, rules
from ..predict import Prediction
from ..rules import ProgramFields, forward_sizes


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

    program: ProgramFields
    values: Any  # runtime.RowValues (one value per row); None where only shapes are read
    xp: Any  # the array namespace its rules run in

    @property
    def branches(self) -> int:
        """K: canvases per row in one model call."""

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the per-row integer counters carried in the loop state."""

    def propose(
        self, pred: Prediction, canvas: jax.Array, valid: jax.Array, step: jax.Array, ahead: jax.Array | None = None
    ) -> Proposal:
        """The policy's commit and the candidates built on it (``DecoderBase.propose``)."""

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
        ``ahead``: the positions the decoder reads beyond the block's masks (``ahead_positions``),
        else None."""

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        """One candidate per row given the forward of every candidate (``preds`` [B, K, N])."""

    def ahead_positions(self, loop: Any, state: Any, frozen: jax.Array) -> jax.Array | None:
        """[B, N] the positions the decoder reads beyond its block's masks (``candidates``'
        ``ahead``), none of a ``frozen`` row's; None for a decoder that reads none. ``loop`` and
        ``state``: the engine's ``Loop`` and ``DecodeState``."""


@dataclasses.dataclass(frozen=True)
class DecoderBase:
    """What every decoder holds, and the policy step they all start from.

    ``program``: a compiled ``runtime.Program`` (the engine), or a ``DecodeConfig`` (the PyTorch
    backend, and callers that read only shapes: ``branches``, ``stat_shapes``). ``values``: the
    rows' runtime values (``runtime.RowValues``; the PyTorch backend's ``DecodeConfig``), which the
    rules compare against. ``xp``: the array namespace. ``counts``: the policy's count table already
    in ``xp`` on the decode's device (the PyTorch backend makes it once); None: made from the
    program wherever it is read (the engine: a constant of the compiled loop)."""

    program: ProgramFields
    values: Any = None
    xp: Any = jnp
    counts: Any = None

    def count_table(self) -> Any:
        """The scheduled policies' per-step counts as an array of ``xp`` (``None`` for
        confidence-driven ones)."""
        if self.counts is not None:
            return self.counts
        counts = policies.step_counts(self.program)
        return None if counts is None else self.xp.asarray(counts)

    def propose(self, pred: Prediction, canvas: Any, valid: Any, step: Any, ahead: Any = None) -> Proposal:
        """The policy's commit (S0, s0: ``policies.spatial_commit``) and the candidates built on it
        (no model call)."""
        xp = self.xp
        chosen, s0 = policies.spatial_commit(
            xp, pred.conf, pred.token, canvas, valid, step, self.program, self.count_table(), self.values
        )
        return self.candidates(pred, s0, chosen, valid, step, ahead)

    def ahead_positions(self, loop: Any, state: Any, frozen: Any) -> Any:
        """None: the decoder reads the block's masks alone."""
        return None


def zero_stats(decoder: Decoder, batch: int) -> dict[str, jax.Array]:
    return {name: jnp.zeros(shape, jnp.int32) for name, shape in decoder.stat_shapes(batch).items()}


def forward_size_index(needed: jax.Array, live: jax.Array, k: int) -> jax.Array:
    """Index into ``forward_sizes(k)`` (``rules.forward_sizes``) of the call that covers the live
    rows (0 if none is live)."""
    return rules.covering_index(jnp, forward_sizes(k), rules.most_needed(jnp, needed, live))
