"""The model calls a compiled decode makes, by shape: what its time is made of.

A decode's seconds are, to a good approximation, the sum over its model calls of what each call
costs on the device, and a call's cost depends only on its shape: the kind of call, the canvases
per row it forwards, the positions per canvas and the rows of the batch. The engine counts its
calls per shape (``DecodeOutput.calls``, in the order of ``call_shapes``), so a decode's cost on
any device is ``sum(count * cost(shape))`` (``psd_jax.costs``) without decoding again.

Kinds (docs/algorithms.md "Counting"):

- ``full``: the uncached call, ``candidates`` canvases of the whole canvas per row (its logits only
  in the window a row can commit in); the start forward of an uncached decode is ``full`` with 1.
- ``refresh``: the block-start full forward of a cached decode, which also writes the KV cache (and
  its start forward).
- ``window``: a cached call, ``candidates`` windows of ``positions`` queries per row against the
  cache (dual: the block; prefix: the rest of the canvas, in a few static lengths).
- ``block_refresh``: a block-causal model's first call of a block, a window over the previous and
  the current block that writes the finished block into the cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import rules
from .config import DecodeConfig

KINDS = ("full", "refresh", "window", "block_refresh")


class CallShape(NamedTuple):
    kind: str  # one of KINDS
    candidates: int  # canvases per row
    positions: int  # query positions per canvas

    @property
    def key(self) -> str:
        """``window 4x16``: a readable name, also the key of a cost table."""
        return f"{self.kind} {self.candidates}x{self.positions}"


def call_shapes(dcfg: DecodeConfig, total_length: int, block_causal: bool = False) -> tuple[CallShape, ...]:
    """Every shape of call a decode of ``dcfg`` on a canvas of ``total_length`` positions may make,
    in the order of the engine's counters: uncached, ``full`` at each forward size; cached,
    ``refresh`` (and ``block_refresh`` for a block-causal model), then ``window`` at each forward
    size and each window length (the engine's ``lax.switch`` order: size-major)."""
    from .decoders import decoder_for  # here: the cost tables read shapes without the engine's imports

    sizes = rules.forward_sizes(decoder_for(dcfg).branches)
    if dcfg.cache == "none":
        return tuple(CallShape("full", m, total_length) for m in sizes)
    refresh = [CallShape("refresh", 1, total_length)]
    if block_causal:
        refresh.append(CallShape("block_refresh", 1, 2 * dcfg.block_length))
    lengths = rules.window_lengths(dcfg, block_causal)
    return (*refresh, *(CallShape("window", m, w) for m in sizes for w in lengths))


def record_shape(call: dict[str, Any]) -> CallShape:
    """The shape of one of a decode's call records (``call_records``)."""
    return CallShape(call["kind"], call["candidates"], call["positions"])


def call_records(shapes: tuple[CallShape, ...], counts: Any, batch: int, logits: int) -> list[dict[str, Any]]:
    """The calls a decode made, one record per shape it used: ``{"kind", "candidates",
    "positions", "batch", "count", "logits"}`` (``batch``: the rows every call forwards;
    ``logits``: the positions per canvas that get logits, at most ``logits``, the decode's
    ``rules.logit_width``: what a modeled device's LM head costs)."""
    return [
        {
            "kind": s.kind,
            "candidates": s.candidates,
            "positions": s.positions,
            "batch": batch,
            "count": int(c),
            "logits": min(s.positions, logits),
        }
        for s, c in zip(shapes, counts)
        if int(c)
    ]
