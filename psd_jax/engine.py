"""The decode loop: one ``jax.jit``-compiled ``lax.while_loop`` over blocks and steps.

The carry holds the canvas, the forward of the current canvas (``F(x)``), each row's block and
step counters, ``done`` flags and call counters. One iteration = policy commit and candidate
building (no model call) -> one batched model call over ``[B, K, N]`` candidates -> per-row
choice -> block advance / EOS early exit. Rows decode independently: own confidences, own
schedule position, own EOS; finished rows are frozen with ``where``.

The forward of a candidate that no row will use is skipped: when every row finishes with its
policy commit (end of generation or EOS), no model call is made, so call counts equal upstream's.
``run_python_loop`` runs the same ``step`` in a Python loop and is the test oracle for the
compiled loop.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models import ModelConfig

from .config import DecodeConfig
from .decoders import choose, initial_stats, propose
from .predict import Prediction, forwards_per_call, predict

TRACE_COUNT = {"decode": 0}  # incremented each time the decode loop is traced (compile test)


@struct.dataclass
class DecodeState:
    canvas: jax.Array  # [B, N] int32
    pred: Prediction  # forward of `canvas`, [B, N]
    block: jax.Array  # [B] current block index
    step: jax.Array  # [B] schedule step within the block
    done: jax.Array  # [B] bool
    row_nfe: jax.Array  # [B] model calls while the row was still decoding
    nfe: jax.Array  # () model calls
    sequence_forwards: jax.Array  # () sequences processed by the model
    iteration: jax.Array  # ()
    key: jax.Array
    stats: dict


@dataclasses.dataclass(frozen=True)
class Loop:
    """Static pieces of one decode: settings, shapes and the model call."""

    mcfg: ModelConfig
    dcfg: DecodeConfig
    prompt_length: int
    forward: Callable[[jax.Array, jax.Array | None], jax.Array]

    @property
    def total_length(self) -> int:
        return self.prompt_length + self.dcfg.gen_length

    def call(self, canvases: jax.Array, attention_mask: jax.Array, key: jax.Array) -> Prediction:
        return predict(self.forward, canvases, attention_mask, self.prompt_length, key, self.mcfg, self.dcfg)

    def block_span(self, block: jax.Array) -> tuple[jax.Array, jax.Array]:
        start = self.prompt_length + block * self.dcfg.block_length
        return start, start + self.dcfg.block_length

    def in_block(self, block: jax.Array) -> jax.Array:
        start, end = self.block_span(block)
        pos = jnp.arange(self.total_length)[None, :]
        return (pos >= start[:, None]) & (pos < end[:, None])

    def committable(self, state: DecodeState) -> jax.Array:
        """M(x): masked positions of each row's current block ([B, N]); nothing for done rows."""
        return (state.canvas == self.mcfg.mask_id) & self.in_block(state.block) & ~state.done[:, None]

    def advance(self, canvas, block, step, done):
        """Move rows whose block is complete to the next block; stop rows at the end or at EOS."""
        in_block = self.in_block(block)
        complete = ~jnp.any(in_block & (canvas == self.mcfg.mask_id), axis=-1) & ~done
        stops = jnp.isin(canvas, jnp.asarray(self.mcfg.stop_ids))
        eos_stop = complete & jnp.any(in_block & stops, axis=-1) & self.dcfg.eos_early_stop
        _, end = self.block_span(block)
        after = jnp.arange(self.total_length)[None, :] >= end[:, None]
        canvas = jnp.where(eos_stop[:, None] & after, self.mcfg.eos_id, canvas)
        last = block + 1 >= self.dcfg.num_blocks
        new_done = done | eos_stop | (complete & last)
        block = jnp.where(complete & ~new_done, block + 1, block)
        step = jnp.where(complete, 0, step)
        return canvas, block, step, new_done


def init_state(loop: Loop, prompt_ids: jax.Array, attention_mask: jax.Array, key: jax.Array) -> DecodeState:
    """Canvas = prompt + gen_length masks, and its first forward (one model call)."""
    batch = prompt_ids.shape[0]
    gen = jnp.full((batch, loop.dcfg.gen_length), loop.mcfg.mask_id, jnp.int32)
    canvas = jnp.concatenate([prompt_ids.astype(jnp.int32), gen], axis=1)
    key, sub = jax.random.split(key)
    pred = jax.tree.map(lambda a: a[:, 0], loop.call(canvas[:, None], attention_mask, sub))
    zeros = jnp.zeros(batch, jnp.int32)
    return DecodeState(
        canvas=canvas,
        pred=pred,
        block=zeros,
        step=zeros,
        done=jnp.zeros(batch, bool),
        row_nfe=jnp.ones(batch, jnp.int32),
        nfe=jnp.array(1, jnp.int32),
        sequence_forwards=jnp.array(batch * (2 if loop.dcfg.cfg_scale > 0 else 1), jnp.int32),
        iteration=jnp.array(0, jnp.int32),
        key=key,
        stats=initial_stats(loop.dcfg, batch),
    )


def step(loop: Loop, attention_mask: jax.Array, state: DecodeState) -> DecodeState:
    """One iteration: commit + candidates, one batched forward (if any row needs it), choose, advance."""
    dcfg = loop.dcfg
    valid = loop.committable(state)
    proposal = propose(state.pred, state.canvas, valid, state.step, dcfg)
    # A row is live if it still decodes after its policy commit; only live rows need a forward.
    _, _, _, done_after_s0 = loop.advance(proposal.s0, state.block, state.step + 1, state.done)
    live = ~done_after_s0
    need_forward = jnp.any(live)
    key, sub = jax.random.split(state.key)
    k = proposal.candidates.shape[1]

    def forward_all(_):
        return loop.call(proposal.candidates, attention_mask, sub)

    def skip(_):
        return jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], k, *a.shape[1:])), state.pred)

    preds = jax.lax.cond(need_forward, forward_all, skip, None)
    choice = choose(proposal, preds, live, state.step, dcfg, loop.mcfg.mask_id)
    canvas = jnp.take_along_axis(proposal.candidates, choice.index[:, None, None], axis=1)[:, 0]
    canvas = jnp.where(state.done[:, None], state.canvas, canvas)
    pred = jax.tree.map(lambda a: jnp.take_along_axis(a, _expand(choice.index, a), axis=1)[:, 0], preds)
    canvas, block, new_step, done = loop.advance(canvas, state.block, state.step + choice.steps, state.done)
    calls = need_forward.astype(jnp.int32)
    return DecodeState(
        canvas=canvas,
        pred=pred,
        block=block,
        step=new_step,
        done=done,
        row_nfe=state.row_nfe + live.astype(jnp.int32),
        nfe=state.nfe + calls,
        sequence_forwards=state.sequence_forwards + calls * forwards_per_call(canvas.shape[0], dcfg),
        iteration=state.iteration + 1,
        key=key,
        stats=jax.tree.map(jnp.add, state.stats, choice.stats),
    )


def _expand(index: jax.Array, a: jax.Array) -> jax.Array:
    return index.reshape(index.shape + (1,) * (a.ndim - 1))


def run_while_loop(loop: Loop, prompt_ids, attention_mask, key) -> DecodeState:
    state = init_state(loop, prompt_ids, attention_mask, key)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), partial(step, loop, attention_mask), state)


def run_python_loop(loop: Loop, prompt_ids, attention_mask, key, max_iterations: int = 100_000) -> DecodeState:
    """The same step in a plain Python loop (the oracle the compiled loop is tested against)."""
    state = init_state(loop, prompt_ids, attention_mask, key)
    step_fn = jax.jit(partial(step, loop, attention_mask))
    for _ in range(max_iterations):
        if bool(jnp.all(state.done)):
            return state
        state = step_fn(state)
    raise RuntimeError(f"decode did not finish in {max_iterations} iterations")


@struct.dataclass
class DecodeOutput:
    canvas: jax.Array  # [B, P + gen_length]
    row_nfe: jax.Array  # [B]
    nfe: jax.Array
    sequence_forwards: jax.Array
    iterations: jax.Array
    stats: dict


def finish(state: DecodeState) -> DecodeOutput:
    return DecodeOutput(state.canvas, state.row_nfe, state.nfe, state.sequence_forwards, state.iteration, state.stats)


def _decode(model, prompt_ids, prompt_mask, key, mcfg: ModelConfig, dcfg: DecodeConfig, runner) -> DecodeOutput:
    loop = Loop(mcfg, dcfg, prompt_ids.shape[1], lambda tokens, mask: model(tokens, mask))
    batch = prompt_ids.shape[0]
    attention_mask = jnp.concatenate([prompt_mask.astype(jnp.int32), jnp.ones((batch, dcfg.gen_length), jnp.int32)], 1)
    return finish(runner(loop, prompt_ids, attention_mask, key))


@partial(jax.jit, static_argnames=("graphdef", "mcfg", "dcfg"))
def decode(graphdef, params, prompt_ids, prompt_mask, key, *, mcfg: ModelConfig, dcfg: DecodeConfig) -> DecodeOutput:
    """Decode left-padded prompts [B, P] (mask [B, P]); compiled once per shape and settings."""
    TRACE_COUNT["decode"] += 1
    model = nnx.merge(graphdef, params)
    return _decode(model, prompt_ids, prompt_mask, key, mcfg, dcfg, run_while_loop)


def decode_python_loop(model, prompt_ids, prompt_mask, key, *, mcfg: ModelConfig, dcfg: DecodeConfig) -> DecodeOutput:
    """Same decode with a plain Python loop over the (separately jitted) ``step``; the test oracle."""
    return _decode(model, prompt_ids, prompt_mask, key, mcfg, dcfg, run_python_loop)
