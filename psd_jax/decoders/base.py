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

from ..config import DecodeConfig
from ..policies import commit_mask
from ..predict import Prediction


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

    dcfg: DecodeConfig

    @property
    def branches(self) -> int:
        """K: canvases per row in one model call."""

    def stat_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the per-row integer counters carried in the loop state."""

    def candidates(
        self, pred: Prediction, s0: jax.Array, chosen: jax.Array, valid: jax.Array, step: jax.Array
    ) -> Proposal:
        """The K candidates of every row from ``F(x)`` and the policy's commit (``chosen``, ``s0``)."""

    def choose(self, proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, mask_id: int) -> Choice:
        """One candidate per row given the forward of every candidate (``preds`` [B, K, N])."""


def spatial_commit(pred: Prediction, canvas: jax.Array, valid: jax.Array, step: jax.Array, dcfg: DecodeConfig):
    """The policy step shared by every decoder: (commit mask S0, canvas s0)."""
    chosen = commit_mask(pred.conf, valid, step, dcfg)
    return chosen, jnp.where(chosen, pred.token, canvas)


def zero_stats(decoder: Decoder, batch: int) -> dict[str, jax.Array]:
    return {name: jnp.zeros(shape, jnp.int32) for name, shape in decoder.stat_shapes(batch).items()}


def leading_true(flags: jax.Array) -> jax.Array:
    """[B, J] bool -> [B] int32: how many leading entries are True."""
    return jnp.cumprod(flags, axis=-1).sum(-1).astype(jnp.int32)


def forward_sizes(k: int) -> tuple[int, ...]:
    """The static numbers of leading candidates a call may forward: s0 alone, about half, all K.

    A call forwards the smallest size that covers every live row's ``needed`` candidates (deep PSD
    levels past a block's last step, RPS branches past the ratio filter are never forwarded); three
    sizes keep the compiled model calls few.
    """
    return tuple(sorted({1, (k + 1) // 2, k}))


def forward_size_index(needed: jax.Array, live: jax.Array, k: int) -> jax.Array:
    """Index into ``forward_sizes(k)`` of the call that covers the live rows (0 if none is live)."""
    most = jnp.max(jnp.where(live, needed, 1))
    return jnp.sum(jnp.asarray(forward_sizes(k)) < most).astype(jnp.int32)
