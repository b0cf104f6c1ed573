"""The decoders behind one interface (``base.Decoder``): plain, PSD, RPS and token editing.

``decoder_for`` is the one place a ``Program`` maps to its decoder; the engine and the
tests reach decoders only through it (``propose``/``choose`` are its two steps as functions).
"""

from __future__ import annotations

import jax

from ..config import DECODERS as DECODER_NAMES
from ..predict import Prediction
from ..rules import Settings
from ..runtime import Program, RowValues
from .base import Choice, Decoder, Proposal, forward_size_index, forward_sizes, spatial_commit, zero_stats
from .edit import Edit
from .plain import Plain
from .psd import PSD, PSDState
from .rps import RPS, RPSState

DECODERS: dict[str, type] = {"plain": Plain, "psd": PSD, "rps": RPS, "edit": Edit}
assert tuple(DECODERS) == DECODER_NAMES, "config.DECODERS lists the decoders' names"


def decoder_for(program: Settings, values: RowValues | None = None) -> Decoder:
    """The decoder of ``program`` (a compiled ``Program``, or a ``DecodeConfig`` where only its
    shapes are read: ``branches``, ``stat_shapes``); ``values``: the rows' runtime values
    (``runtime.RowValues``), which a decode's rules compare against."""
    return DECODERS[program.decoder](program, values)


def initial_stats(program: Program, batch: int) -> dict[str, jax.Array]:
    """Per-row decoder statistics carried in the loop state, all zero."""
    return zero_stats(decoder_for(program), batch)


def propose(
    pred: Prediction,
    canvas: jax.Array,
    valid: jax.Array,
    step: jax.Array,
    program: Program,
    values: RowValues,
    ahead: jax.Array | None = None,
) -> Proposal:
    """The policy's commit and the decoder's candidates built on it (no model call); ``ahead``:
    the positions the decoder reads beyond the block's masks (``Loop.decoder_positions``)."""
    chosen, s0 = spatial_commit(pred, canvas, valid, step, program, values)
    return decoder_for(program, values).candidates(pred, s0, chosen, valid, step, ahead)


__all__ = [
    "Choice",
    "DECODERS",
    "Decoder",
    "Edit",
    "PSD",
    "PSDState",
    "Plain",
    "Proposal",
    "RPS",
    "RPSState",
    "choose",
    "decoder_for",
    "forward_size_index",
    "forward_sizes",
    "initial_stats",
    "propose",
    "spatial_commit",
]
