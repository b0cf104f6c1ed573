"""DiffusionGemma's sampler one canvas per call, each row at its own canvas: what a server's
continuous batching drives (``serve.batcher``: between two calls, finished rows leave and queued
requests join, and the batch moves to another compiled size).

The state (``CanvasRows``) is the whole decode's carry with a canvas index per row: the cache of
every canvas the batch's program may run (``[B, P + K * C]``: the prompt's slots, then canvas k's
at ``P + k * C``), each row's canvases done and its own number of canvases (its generation
length), its ids so far, its PRNG key and counters. ``advance_rows`` runs one canvas for every row
still decoding (``entropy_bound.denoise_canvas``: rows that are not start frozen, so they do not
hold the loop; then ``finish_canvas``, each row writing at its own offsets); ``join_rows`` encodes
new prompts into rows that are done and resets them. A row's draws are keyed by its own key, canvas
and step, as in ``entropy_bound``'s whole decode, so a row with key ``row_keys([seed], [0])``
decodes exactly as ``generate([prompt], seed=seed)``'s only row, whatever shares its batch.

Traced under a mesh, each function's state comes out with its rows split as
``sharding.batch_sharding`` splits them (``constrain_rows``; the rest of each array whole), so one
call's state goes into the next call as that call was compiled for; on one device nothing is pinned.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.diffusion_gemma import Cache
from models.diffusion_gemma_config import GROUPS

from ..parallel.sharding import constrain_rows
from .entropy_bound import Draws, SamplerProgram, SamplerValues, denoise_canvas, finish_canvas


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CanvasRows:
    """A batch of rows between two canvases (every array [B, ...])."""

    cache: Cache  # [B, P + K * C] slots: the prompt's, then every canvas's
    canvas: jax.Array  # [B] canvases each row has finished
    canvases: jax.Array  # [B] canvases each row runs (its generation length / C)
    ended: jax.Array  # [B] not decoding: an end id written, its canvases done, stopped, or empty
    ids: jax.Array  # [B, K * C] each row's canvases so far (pad after its end)
    keys: jax.Array  # [B, 2] each row's PRNG key (``runtime.row_keys``)
    values: SamplerValues  # each row's entropy bound, temperatures and stopping confidence
    passes: jax.Array  # [B] upstream's decoder_passes so far
    row_nfe: jax.Array  # [B] denoiser calls while the row decoded, so far


def empty_rows(cfg, dtype, batch: int, prompt_length: int, program: SamplerProgram) -> CanvasRows:
    """``batch`` empty (ended) rows for prompts of ``prompt_length`` and ``program``'s canvases,
    the cache (``Cache.for_decode``'s layout) in the model's ``dtype``."""
    canvases = program.canvases(cfg.canvas_length)
    n = cfg.n_layers
    zeros = lambda: tuple(  # noqa: E731
        jnp.zeros((batch, prompt_length, *cfg.kv_shape(GROUPS[kind])), dtype) for kind in cfg.layer_types
    )
    positions = jnp.broadcast_to(jnp.arange(prompt_length, dtype=jnp.int32), (batch, prompt_length))
    prompt = Cache(zeros(), zeros(), (positions,) * n, (jnp.zeros((batch, prompt_length), bool),) * n)
    row = jnp.zeros((batch,), jnp.int32)
    return CanvasRows(
        cache=prompt.for_decode(cfg, canvases * cfg.canvas_length),
        canvas=row,
        canvases=row,
        ended=jnp.ones((batch,), bool),
        ids=jnp.full((batch, canvases * cfg.canvas_length), cfg.pad_id, jnp.int32),
        keys=jnp.zeros((batch, 2), jnp.uint32),
        values=SamplerValues(
            jnp.zeros((batch,), jnp.float32),
            jnp.ones((batch, program.max_denoising_steps + 1), jnp.float32),
            jnp.zeros((batch,), jnp.float32),
        ),
        passes=row,
        row_nfe=row,
    )


@jax.jit(static_argnames=("cfg", "dtype", "batch", "prompt_length", "program"))
def placed_empty_rows(cfg, dtype, batch: int, prompt_length: int, program: SamplerProgram) -> CanvasRows:
    """``empty_rows`` made by a program (a session on a mesh): traced under the mesh, its rows come
    out split over it, each process's devices writing their own shards."""
    return constrain_rows(empty_rows(cfg, dtype, batch, prompt_length, program), batch)


@jax.jit(static_argnames=("graphdef",))
def join_rows(
    graphdef, params, state: CanvasRows, joined, prompt_ids, prompt_valid, keys, canvases, values: SamplerValues
) -> CanvasRows:
    """``state`` with the ``joined`` rows [B] restarted on left-padded ``prompt_ids`` [B, P]
    (``prompt_valid``: the real tokens), their ``keys`` [B, 2], ``canvases`` [B] and sampler
    ``values``; the other rows as they were. The prompts are encoded for every row (one static shape), kept for the joined."""
    model = nnx.merge(graphdef, params)
    batch, prompt_length = prompt_ids.shape
    positions = jnp.broadcast_to(jnp.arange(prompt_length, dtype=jnp.int32), (batch, prompt_length))
    _, prompt = model.encode(prompt_ids, positions, prompt_valid)
    fresh = prompt.for_decode(model.config, state.ids.shape[1])
    pick = lambda new, old: jnp.where(joined.reshape(-1, *[1] * (old.ndim - 1)), new.astype(old.dtype), old)  # noqa: E731
    zero = jnp.zeros_like(state.canvas)
    restarted = CanvasRows(
        cache=fresh,
        canvas=zero,
        canvases=canvases,
        ended=canvases < 1,
        ids=jnp.full_like(state.ids, model.config.pad_id),
        keys=keys,
        values=values,
        passes=zero,
        row_nfe=zero,
    )
    return constrain_rows(jax.tree.map(pick, restarted, state), batch)


@jax.jit(static_argnames=("graphdef", "program"))
def advance_rows(graphdef, params, state: CanvasRows, program: SamplerProgram) -> CanvasRows:
    """One canvas for every row still decoding, each at its own canvas; the others unchanged."""
    model = nnx.merge(graphdef, params)
    C = model.config.canvas_length
    full = [GROUPS[kind] for kind in model.config.layer_types].index("full")  # a full layer keeps every slot
    prompt_length = state.cache.valid[full].shape[1] - state.ids.shape[1]
    live = ~state.ended
    k = jnp.minimum(state.canvas, state.ids.shape[1] // C - 1)  # an ended row's index stays in range
    at = prompt_length + k[:, None] * C + jnp.arange(C, dtype=jnp.int32)
    counters = {"nfe": jnp.int32(0), "passes": state.passes, "row_nfe": state.row_nfe, "step": jnp.int32(0)}
    a, counters, _ = denoise_canvas(
        model, program, state.values, Draws(key=state.keys), state.cache, at, k, state.ended, state.ended, counters,
        {}, False,
    )  # fmt: skip
    ids, ended, cache = finish_canvas(model, a, at, state.ended, state.ids, state.cache, k * C, prompt_length + k * C)
    canvas = state.canvas + live.astype(jnp.int32)
    advanced = CanvasRows(
        cache=cache,
        canvas=canvas,
        canvases=state.canvases,
        ended=state.ended | ended | (canvas >= state.canvases),
        ids=jnp.where(live[:, None], ids, state.ids),  # an ended row's output stays as it ended
        keys=state.keys,
        values=state.values,
        passes=counters["passes"],
        row_nfe=counters["row_nfe"],
    )
    return constrain_rows(advanced, live.shape[0])


@jax.jit
def regroup_rows(state: CanvasRows, index: jax.Array) -> CanvasRows:
    """``len(index)`` rows: new row i is row ``index[i]`` as it is (-1: an empty, ended row)."""
    moved = jax.tree.map(lambda x: x[jnp.maximum(index, 0)], state)
    return constrain_rows(dataclasses.replace(moved, ended=moved.ended | (index < 0)), index.shape[0])


@jax.jit
def stop_rows(state: CanvasRows, stopped: jax.Array) -> CanvasRows:
    """``state`` with the ``stopped`` rows [B] ended (their output no longer wanted)."""
    return constrain_rows(dataclasses.replace(state, ended=state.ended | stopped), stopped.shape[0])
