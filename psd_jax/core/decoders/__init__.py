"""The decoders behind one interface (``base.Decoder``): plain, PSD, RPS and token editing.

``DECODERS`` is the one registration of a decoder, and ``decoder_for`` the one place a program maps
to its decoder object: the engine, the PyTorch backend (``torch_backend.decode``, the same objects
over ``array_api_compat.torch``) and the tests reach decoders only through it (``propose`` is its
first step as a function).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..config import DECODERS as DECODER_NAMES
from ..predict import Prediction
from ..rules import ProgramFields
from ..runtime import Program, RowValues
from .base import Choice, Decoder, DecoderBase, Proposal, forward_size_index, forward_sizes, zero_stats
from .edit import Edit
from .plain import Plain
from .psd import PSD, PSDState
from .rps import RPS, RPSState

DECODERS: dict[str, type] = {"plain": Plain, "psd": PSD, "rps": RPS, "edit": Edit}
assert tuple(DECODERS) == DECODER_NAMES, "config.DECODERS lists the decoders' names"


def decoder_for(program: ProgramFields, values: Any = None, xp: Any = jnp, counts: Any = None) -> Decoder:
    """The decoder of ``program`` (a compiled ``Program``, or a ``DecodeConfig`` where only its
    shapes are read: ``branches``, ``stat_shapes``); ``values``: the rows' runtime values
    (``runtime.RowValues``), which a decode's rules compare against; ``xp`` and ``counts``: the
    array namespace and the count table made once (``base.DecoderBase``; the PyTorch backend's)."""
    return DECODERS[program.decoder](program, values, xp, counts)


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
    return decoder_for(program, values).propose(pred, canvas, valid, step, ahead)


__all__ = [
    "Choice",
    "DECODERS",
    "Decoder",
    "DecoderBase",
    "Edit",
    "PSD",
    "PSDState",
    "Plain",
    "Proposal",
    "RPS",
    "RPSState",
    "decoder_for",
    "forward_size_index",
    "forward_sizes",
    "initial_stats",
    "propose",
]
