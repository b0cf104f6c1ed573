"""The attention layouts the decode loop runs on: one strategy object per decode, asked instead of
branching on the model family.

Two layouts (docs/algorithms.md "Block KV cache" and "LLaDA2.0: block diffusion"):

- ``FlatLayout``: bidirectional models (LLaDA, Dream, LLaDA-MoE). The canvas is the left-padded
  prompt then gen_length masks; every position attends to every other, so a block-start refresh is
  a full forward, and a window call attends to every cached key but those it replaces.
- ``BlockCausalLayout``: block-causal models (LLaDA2.0, SDAR: ``ModelConfig.block_causal``). Blocks are
  aligned from each row's own position 0 (``block_layout.BlockLayout``), later blocks are never
  visible to earlier ones, so the cache is exact: a finished block's keys/values are written once,
  by a window over [previous block, current block] at the next block's first call.

Token editing (``decoder="edit"``, LLaDA2.1's) has a layout of each kind, ``EditingLayout`` and
``FlatEditingLayout``: its blocks end by the decoder's own rule (post calls while it edits), a row
stops at the pipeline's EOS rule, and on a block-causal model a generation may end inside its last
block, the rest of which is decoded but hidden as keys.

``layout_for`` picks the layout of a decode once (from ``mcfg.block_causal`` and the decoder); ``Loop`` holds it
and asks it for the canvas, the attention mask, the model-call wrappers, the block advance, the row
end, the block-start cache refresh and the calls it counts, the keys a window attends to, the window
lengths and call shapes, and what a streaming caller reads. The shape-only questions (canvas length,
window lengths, call shapes) are class methods, so callers that know only the prompts' padded length
(``placed_model``, ``costs``) ask ``layout_type(mcfg)`` without building a decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from models import ModelConfig

from ..parallel.sharding import constrain_kv_cache
from . import rules
from .block_layout import BlockLayout, canvas_length, initial_canvas, output_canvas, output_trace
from .calls import CallShape, call_shapes
from .decoders.edit import block_end
from .families import BlockStopRules, block_stop_rules
from .predict import ForwardFn, LogitWindow, Prediction, logits_to_prediction, on_canvas, predict_prefill
from .runtime import Program, RowValues


class LoopView(Protocol):
    """What a layout reads of the engine's ``Loop`` (which is not imported: the engine imports this
    module, and tests/test_import_layers.py allows no import circles): one decode's static pieces."""

    @property
    def mcfg(self) -> ModelConfig: ...
    @property
    def program(self) -> Program: ...
    @property
    def prompt_length(self) -> int: ...
    @property
    def total_length(self) -> int: ...
    @property
    def prefill(self) -> Callable | None: ...
    @property
    def window(self) -> Callable | None: ...
    @property
    def positions(self) -> Callable | None: ...
    def logit_window(self, block: jax.Array) -> LogitWindow | None: ...
    def count_call(self, calls: jax.Array, index: int | jax.Array, made: jax.Array | int = 1) -> jax.Array: ...
    def row_end(self, values: RowValues) -> jax.Array: ...
    def block_span(self, block: jax.Array) -> tuple[jax.Array, jax.Array]: ...
    def in_block(self, block: jax.Array) -> jax.Array: ...


class StateView(Protocol):
    """What a layout reads of the engine's ``DecodeState`` (not imported, as ``LoopView``)."""

    @property
    def canvas(self) -> jax.Array: ...
    @property
    def pred(self) -> Prediction: ...
    @property
    def block(self) -> jax.Array: ...
    @property
    def calls(self) -> jax.Array: ...
    @property
    def values(self) -> RowValues: ...
    @property
    def fresh(self) -> jax.Array: ...
    @property
    def cache(self) -> tuple | None: ...
    def replace(self, **changes: Any) -> StateView: ...


class ModelCalls(NamedTuple):
    """The model as the loop calls it, one signature across families: ``forward(tokens, mask, **kw)``,
    ``prefill(tokens, mask, into=None, **kw)`` (``into = (keys, values, rows)``: the returned cache
    is the given one with ``rows`` replaced), ``window`` (``DiffusionLM.window``) and
    ``positions(mask, batch, n)``."""

    forward: ForwardFn
    prefill: Callable
    window: Callable
    positions: Callable


def where_rows(rows: jax.Array, new, old, axis: int = 0):
    """Per-row select of two pytrees whose batch axis is ``axis``."""

    def pick(a, b):
        shape = [1] * a.ndim
        shape[axis] = rows.shape[0]
        return jnp.where(rows.reshape(shape), a, b)

    return jax.tree.map(pick, new, old)


def final_blocks(block: jax.Array, done: jax.Array) -> jax.Array:
    """Blocks of each row whose tokens are final: those it has left, and its current one once done
    (a row stops in the block that completes it: the last one, or one holding EOS)."""
    return block + done.astype(block.dtype)


def canvas_attention_mask(prompt_mask: jax.Array, gen_length: int, row_gen: jax.Array | None = None) -> jax.Array:
    """The flat canvas's attention mask [B, P + gen_length]: the prompt's, then the generated
    positions of each row's own generation (``row_gen`` [B] positions, default all): the positions
    past it are no row's keys, so the row decodes as on a canvas of its own length."""
    batch = prompt_mask.shape[0]
    generated = jnp.ones((batch, gen_length), jnp.int32)
    if row_gen is not None:
        generated = (jnp.arange(gen_length)[None, :] < row_gen[:, None]).astype(jnp.int32)
    return jnp.concatenate([prompt_mask.astype(jnp.int32), generated], 1)


def full_refresh(loop: LoopView, attention_mask: jax.Array, state: StateView, rows: jax.Array, keys: jax.Array):
    """The block-start full forward of ``rows`` (one call, only if some row needs it): their
    prediction and KV cache rows replaced by those of their current canvas (the prefill writes them
    into the carried cache, ``into``). Returns (pred, cache, calls made)."""

    def do_refresh(_):
        window = loop.logit_window(state.block)  # the refreshed rows' new blocks
        prefill = partial(loop.prefill, into=(*state.cache, rows))
        pred, k, v = predict_prefill(
            prefill,
            state.canvas,
            attention_mask,
            loop.prompt_length,
            keys,
            state.values,
            loop.mcfg,
            loop.program,
            window,
        )
        return where_rows(rows, pred, state.pred), constrain_kv_cache((k, v), loop.mcfg)

    pred, cache = jax.lax.cond(jnp.any(rows), do_refresh, lambda _: (state.pred, state.cache), None)
    return pred, cache, jnp.any(rows).astype(jnp.int32)


class Layout:
    """How the loop's canvas is laid out and attended to (module docstring). Subclasses answer
    every question the loop would otherwise branch on the model family for."""

    block_causal: ClassVar[bool]
    refresh_shapes: ClassVar[int]  # leading ``call_shapes`` of a cached decode that refresh; windows follow

    # ------------------------------------------------------------------ shapes (no decode needed)
    @classmethod
    def decode_start(cls, padded_length: int, program: Program) -> int:
        """The loop's ``prompt_length``: the canvas index of the first decoded block, for prompts
        left-padded to ``padded_length``."""
        raise NotImplementedError

    @classmethod
    def region_length(cls, program: Program) -> int:
        """Canvas positions after ``decode_start`` (where blocks are decoded)."""
        raise NotImplementedError

    @classmethod
    def canvas_length(cls, padded_length: int, program: Program) -> int:
        """Positions of the canvas (``block_layout.canvas_length``)."""
        return canvas_length(padded_length, program, cls.block_causal)

    @classmethod
    def window_lengths(cls, program: Program) -> tuple[int, ...]:
        """Static query windows of a cached call, ascending (``rules.window_lengths``)."""
        return rules.window_lengths(program, cls.block_causal)

    @classmethod
    def call_shapes(cls, program: Program, total_length: int) -> tuple[CallShape, ...]:
        """The shapes of call a decode may make, in the order of its ``calls`` counters."""
        return call_shapes(program, total_length, cls.block_causal)

    # ------------------------------------------------------------------------------- one decode
    def model_calls(self, model: Any, program: Program) -> ModelCalls:
        """The model's calls as the loop makes them."""
        raise NotImplementedError

    def initial_canvas(self, prompt_ids: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        """Canvas [B, N] = prompts + masks."""
        raise NotImplementedError

    def attention_mask(
        self, prompt_mask: jax.Array, total_length: int, program: Program, values: RowValues | None
    ) -> jax.Array:
        """The canvas's attention mask [B, N] (``values``: the rows' own generation lengths)."""
        raise NotImplementedError

    def row_end(self, loop: LoopView, values: RowValues) -> jax.Array:
        """[B] the canvas index after each row's own generation (window keys past it are masked)."""
        raise NotImplementedError

    def advance(self, loop: LoopView, canvas, block, step, done, values: RowValues, before):
        """Move rows whose block is complete to the next block; stop rows at their last block or at
        EOS. Returns (canvas, block, step, done)."""
        raise NotImplementedError

    def refresh(self, loop: LoopView, attention_mask: jax.Array, state: StateView, rows: jax.Array, keys: jax.Array):
        """The cache refresh of ``rows`` at a block start (calls only if some row needs them).
        Returns (pred, cache, calls made, ``state.calls`` with them counted by shape)."""
        raise NotImplementedError

    def cached_keys(self, pos: jax.Array, start: jax.Array, in_window: jax.Array) -> jax.Array:
        """[B, N] the cached keys a window from ``start`` attends to (besides pads)."""
        raise NotImplementedError

    def output_canvas(self, canvas: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        """The canvas as every caller reads it, [B, P + gen_length]."""
        raise NotImplementedError

    def output_trace(self, trace, program: Program):
        """The decode's trace (``core.trace.Trace``) laid out as ``output_canvas`` lays out the canvas."""
        return trace

    def streamed(self, canvas, block, done, num_blocks, mcfg: ModelConfig, program: Program):
        """What a block-streaming caller reads of a state: (``output_canvas``, per row the number of
        final ``block_length`` pieces of its generated ids)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FlatLayout(Layout):
    """Bidirectional models: the canvas is ``[prompt | gen_length]``; every key is visible."""

    block_causal: ClassVar[bool] = False
    refresh_shapes: ClassVar[int] = 1  # refresh

    @classmethod
    def decode_start(cls, padded_length: int, program: Program) -> int:
        return padded_length

    @classmethod
    def region_length(cls, program: Program) -> int:
        """gen_length."""
        return program.gen_length

    def model_calls(self, model: Any, program: Program) -> ModelCalls:
        """The model as it is (its prefill writes a refresh ``into`` the carried cache)."""
        return ModelCalls(model, model.prefill, model.window, model.positions)

    def initial_canvas(self, prompt_ids: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        gen = jnp.full((prompt_ids.shape[0], program.gen_length), mcfg.mask_id, jnp.int32)
        return jnp.concatenate([prompt_ids.astype(jnp.int32), gen], axis=1)

    def attention_mask(
        self, prompt_mask: jax.Array, total_length: int, program: Program, values: RowValues | None
    ) -> jax.Array:
        """The prompt's mask, then each row's own generation (``canvas_attention_mask``)."""
        row_gen = None if values is None else values.num_blocks * program.block_length
        return canvas_attention_mask(prompt_mask, program.gen_length, row_gen)

    def row_end(self, loop: LoopView, values: RowValues) -> jax.Array:
        """After ``values.num_blocks`` blocks (at most the canvas's)."""
        return loop.prompt_length + values.num_blocks * loop.program.block_length

    def advance(self, loop: LoopView, canvas, block, step, done, values: RowValues, before):
        """``rules.advance`` (``before`` is not needed)."""
        return rules.advance(jnp, canvas, block, step, done, loop.prompt_length, loop.mcfg, loop.program, values)

    def refresh(self, loop: LoopView, attention_mask: jax.Array, state: StateView, rows: jax.Array, keys: jax.Array):
        """A full forward (``full_refresh``), counted as ``refresh`` (shape 0)."""
        pred, cache, calls = full_refresh(loop, attention_mask, state, rows, keys)
        return pred, cache, calls, loop.count_call(state.calls, 0, calls)

    def cached_keys(self, pos: jax.Array, start: jax.Array, in_window: jax.Array) -> jax.Array:
        """All but those the window replaces."""
        return ~in_window

    def output_canvas(self, canvas: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        return canvas

    def streamed(self, canvas, block, done, num_blocks, mcfg: ModelConfig, program: Program):
        """The canvas, and ``final_blocks``."""
        return canvas, final_blocks(block, done)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockCausalLayout(Layout):
    """Block-causal models: rows aligned to blocks from their own position 0 (``rows``), later
    blocks never visible to earlier ones; ``stops``: the family's ``BlockStopRules`` (``models.FAMILIES``)."""

    rows: BlockLayout
    stops: BlockStopRules

    block_causal: ClassVar[bool] = True
    refresh_shapes: ClassVar[int] = 2  # refresh (a fresh row's), block_refresh

    @classmethod
    def decode_start(cls, padded_length: int, program: Program) -> int:
        """``BlockLayout.start``: the start of the block holding the prompts' end."""
        return padded_length // program.block_length * program.block_length

    @classmethod
    def region_length(cls, program: Program) -> int:
        """gen_length and one block more, the most a row needs (its first decoded block also holds
        its prompt's tail)."""
        return program.gen_length + program.block_length

    def model_calls(self, model: Any, program: Program) -> ModelCalls:
        """Every call passes ``block_length`` and the rows' own positions (canvas index minus the
        row's block padding, the first position its mask shows). The prefill takes ``into`` as the flat models' does: its keys/values
        of ``rows`` are selected into the given cache."""
        b = program.block_length

        def positions(mask, batch=None, n=None):
            # From the row's first visible position on, whatever is hidden after it (the tail of
            # ``EditingLayout``, whose positions run on as the pipeline's ``arange``).
            first = jnp.argmax(mask, axis=-1)
            return jnp.maximum(jnp.arange(mask.shape[-1])[None, :] - first[:, None], 0)

        def full(call):
            return lambda tokens, mask, **kw: call(tokens, mask, positions=positions(mask), block_length=b, **kw)

        prefill = full(model.prefill)

        def prefill_into(tokens, mask, into=None, **kw):
            logits, k, v = prefill(tokens, mask, **kw)
            if into is None:
                return logits, k, v
            *old, rows = into
            k, v = (jnp.where(rows[None, :, None, None, None], new, o) for new, o in zip((k, v), old))
            return logits, k, v

        return ModelCalls(full(model), prefill_into, partial(model.window, block_length=b), positions)

    def initial_canvas(self, prompt_ids: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        """Each row placed by its ``BlockLayout``."""
        return initial_canvas(prompt_ids, self.rows, mcfg, program)

    def attention_mask(
        self, prompt_mask: jax.Array, total_length: int, program: Program, values: RowValues | None
    ) -> jax.Array:
        """The row's left padding masked, every other position visible (block-causal attention is
        the model's own)."""
        index = jnp.arange(total_length)[None, :]
        return (index >= self.rows.pad[:, None]).astype(jnp.int32)

    def row_end(self, loop: LoopView, values: RowValues) -> jax.Array:
        """The canvas end: a row's blocks are offset by its prompt's tail, and later blocks are never
        visible to earlier ones."""
        return jnp.full(values.num_blocks.shape, loop.total_length, jnp.int32)

    def advance(self, loop: LoopView, canvas, block, step, done, values: RowValues, before):
        """As the family's upstream decoder (``stops``): a row stops after a complete block when its
        generated part holds a stop id (LLaDA2.0: always; SDAR: with ``eos_early_stop``), and after
        its own last block; LLaDA2.0 with ``eos_early_stop`` also mid-block, when this commit placed
        an EOS (``before``: the canvas before it) and every generated position up to the first EOS
        is filled. The canvas is left as is: ``output_canvas`` reads it as upstream returns it."""
        mask_id, eos_id = loop.mcfg.mask_id, loop.mcfg.eos_id
        masked = canvas == mask_id
        complete = ~jnp.any(loop.in_block(block) & masked, axis=-1) & ~done
        pos = jnp.arange(loop.total_length)[None, :]
        generated = pos >= self.rows.gen_start[:, None]
        eos = (canvas == eos_id) & generated
        stop_token = jnp.isin(canvas, jnp.asarray(loop.mcfg.stop_ids)) & generated
        stop = complete & jnp.any(stop_token, axis=-1)  # later blocks are still all masks
        if not self.stops.always_at_block_end:
            stop &= loop.program.eos_early_stop
        if self.stops.mid_block and loop.program.eos_early_stop and before is not None:
            placed = jnp.any((before == mask_id) & (canvas == eos_id), axis=-1)
            first = jnp.where(jnp.any(eos, axis=-1), jnp.argmax(eos, axis=-1), -1)
            filled = ~jnp.any(masked & generated & (pos < first[:, None]), axis=-1)
            stop |= ~done & placed & (first >= 0) & filled
        last = self.rows.last_block(values.gen_length)
        new_done = done | stop | (complete & (block >= last))
        block = jnp.where(complete & ~new_done, block + 1, block)
        return canvas, block, jnp.where(complete, 0, step), new_done

    def refresh(self, loop: LoopView, attention_mask: jax.Array, state: StateView, rows: jax.Array, keys: jax.Array):
        """The first call of a block is a window over [previous block, current block] against the
        cache of the blocks before them (``window_refresh``, counted as ``block_refresh``, shape 1).
        The previous block is final, so its keys/values, written into the cache here, are exact for
        the rest of the decode. A fresh row (joined, its prompt not in the cache yet) gets the full
        forward ``init_state`` gives a new decode instead (``full_refresh``, ``refresh``, shape 0)."""
        pred, cache, window_calls = self.window_refresh(loop, attention_mask, state, rows & ~state.fresh, keys)
        state = state.replace(pred=pred, cache=cache)
        pred, cache, full_calls = full_refresh(loop, attention_mask, state, rows & state.fresh, keys)
        by_shape = loop.count_call(loop.count_call(state.calls, 0, full_calls), 1, window_calls)
        return pred, cache, full_calls + window_calls, by_shape

    def window_refresh(self, loop: LoopView, attention_mask: jax.Array, state: StateView, rows, keys: jax.Array):
        """``refresh``'s window over [previous block, current block] for ``rows`` (one call, only if
        some row needs it). Returns (pred, cache, calls made)."""
        b, (batch, n) = loop.program.block_length, state.canvas.shape

        def do_refresh(_):
            start, _ = loop.block_span(state.block)
            previous = start - b
            index = previous[:, None] + jnp.arange(2 * b)[None, :]
            tokens = jnp.take_along_axis(state.canvas, index, axis=1)[:, None]
            positions = jnp.take_along_axis(loop.positions(attention_mask, batch, n), index, axis=1)[:, None]
            earlier = attention_mask.astype(bool) & (jnp.arange(n)[None, :] < previous[:, None])
            window = index < loop.row_end(state.values)[:, None]  # a row's tail keys (``EditingLayout``)
            logits, k, v = loop.window(tokens, positions, *state.cache, earlier, window, 2 * b, return_kv=True)
            pred = logits_to_prediction(logits[:, 0, b:], keys, state.values.sampling(), loop.mcfg, loop.program)
            pred = on_canvas(pred, state.canvas, loop.prompt_length, LogitWindow(start, b))
            write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new, at, axis=1), (1, 1, 0), 1)
            cache = tuple(
                jnp.where(rows[None, :, None, None, None], write(c, new[:, :, 0, :b], previous), c)
                for c, new in zip(state.cache, (k, v))
            )
            return where_rows(rows, pred, state.pred), constrain_kv_cache(cache, loop.mcfg)

        pred, cache = jax.lax.cond(jnp.any(rows), do_refresh, lambda _: (state.pred, state.cache), None)
        return pred, cache, jnp.any(rows).astype(jnp.int32)

    def cached_keys(self, pos: jax.Array, start: jax.Array, in_window: jax.Array) -> jax.Array:
        """Only the blocks before the window's (later blocks are not visible, and not final)."""
        return pos < start[:, None]

    def output_canvas(self, canvas: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        """Rebuilt from each row's layout, as the family's upstream returns it (``block_layout.output_canvas``)."""
        return output_canvas(canvas, self.rows, mcfg, program, self.stops.cut_after_eos)

    def output_trace(self, trace, program: Program):
        return output_trace(trace, self.rows, program)

    def streamed(self, canvas, block, done, num_blocks, mcfg: ModelConfig, program: Program):
        """A row's blocks are offset by its prompt's tail, so a piece is final once the decoded
        blocks cover it, and once the row is done every piece up to the one holding its first EOS
        (as ``final_blocks`` counts a row that stopped at EOS)."""
        out = self.output_canvas(canvas, mcfg, program)
        is_eos = out[:, self.rows.padded_length :] == mcfg.eos_id
        up_to_eos = jnp.where(
            jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) // program.block_length + 1, num_blocks
        )
        covered = (block + 1) * program.block_length - self.rows.tail  # generated ids up to the current block's end
        pieces = jnp.where(done, up_to_eos, (covered - program.block_length) // program.block_length)
        return out, jnp.clip(pieces, 0, num_blocks)


@dataclasses.dataclass(frozen=True, eq=False)
class EditingLayout(BlockCausalLayout):
    """Block-causal models decoded by LLaDA2.1's token editing (``decoders.edit``), as diffusers'
    ``LLaDA2Pipeline`` runs them: a row's generation need not fill its last block, and the
    positions after it (the block-aligned tail) are decoded but hidden as keys; a block ends by the
    editing decoder's rule (``decoders.edit.block_end``), a row at the pipeline's EOS rule; the
    output is the generated positions as left (only positions never written read EOS)."""

    def attention_mask(
        self, prompt_mask: jax.Array, total_length: int, program: Program, values: RowValues | None
    ) -> jax.Array:
        """The row's left padding and its tail (positions past its own generation) masked."""
        gen = program.gen_length if values is None else values.gen_length
        index = jnp.arange(total_length)[None, :]
        return ((index >= self.rows.pad[:, None]) & (index < (self.rows.gen_start + gen)[:, None])).astype(jnp.int32)

    def row_end(self, loop: LoopView, values: RowValues) -> jax.Array:
        """After the row's own generation: a window's keys past it (the tail) are hidden."""
        return self.rows.gen_start + values.gen_length

    def editable(self, loop: LoopView, canvas: jax.Array, block: jax.Array, frozen: jax.Array) -> jax.Array:
        """[B, N] the positions the decoder may rewrite: the current block's written, generated
        (not prompt) positions, none of a ``frozen`` row's."""
        generated = jnp.arange(canvas.shape[1])[None, :] >= self.rows.gen_start[:, None]
        return loop.in_block(block) & generated & (canvas != loop.mcfg.mask_id) & ~frozen[:, None]

    def advance(self, loop: LoopView, canvas, block, step, done, values: RowValues, before):
        """``edit_advance`` from the row's first generated position, after its own last block."""
        last = self.rows.last_block(values.gen_length)
        return edit_advance(loop, canvas, block, step, done, values, before, self.rows.gen_start, self.rows.pad, last)

    def output_canvas(self, canvas: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        """The generated positions as left, not cut at EOS (the pipeline's ``sequences``)."""
        return output_canvas(canvas, self.rows, mcfg, program, cut_after_eos=False)


@dataclasses.dataclass(frozen=True)
class FlatEditingLayout(FlatLayout):
    """Bidirectional models decoded by the edit decoder: LLaDA's canvas (later blocks' masks
    visible, as LLaDA's ``generate``), the editing decoder's block end and EOS rule
    (``edit_advance``), the generated positions as left (only positions never written read EOS)."""

    def editable(self, loop: LoopView, canvas: jax.Array, block: jax.Array, frozen: jax.Array) -> jax.Array:
        """[B, N] the current block's written positions, none of a ``frozen`` row's."""
        return loop.in_block(block) & (canvas != loop.mcfg.mask_id) & ~frozen[:, None]

    def advance(self, loop: LoopView, canvas, block, step, done, values: RowValues, before):
        """``edit_advance``; EOS is looked for among the generated positions only (left padding
        may be the EOS id)."""
        start = jnp.full(done.shape, loop.prompt_length, jnp.int32)
        return edit_advance(loop, canvas, block, step, done, values, before, start, start, values.num_blocks - 1)

    def output_canvas(self, canvas: jax.Array, mcfg: ModelConfig, program: Program) -> jax.Array:
        """The canvas as left; a position never written (a row stopped at EOS) reads EOS."""
        return jnp.where(canvas == mcfg.mask_id, mcfg.eos_id, canvas)


def edit_advance(loop: LoopView, canvas, block, step, done, values: RowValues, before, gen_start, scan_from, last):
    """One decision of the edit decoder (``step``: the row's counter + 1; ``before``: the canvas
    before it): the block ends by ``decoders.edit.block_end``; a row stops after its ``last`` block
    [B], or (``eos_early_stop``) when this call wrote an EOS and the row's first EOS from
    ``scan_from`` [B] is generated (at or after ``gen_start`` [B]) with no mask before it (the
    pipeline's rule: an EOS written while an earlier position is a mask stops nothing, then or
    later). Returns (canvas, block, step, done) as ``Layout.advance``."""
    mask_id, eos_id = loop.mcfg.mask_id, loop.mcfg.eos_id
    inside = loop.in_block(block)
    had_mask = jnp.any(inside & (before == mask_id), axis=-1)
    has_mask = jnp.any(inside & (canvas == mask_id), axis=-1)
    changed = inside & (canvas != before)
    edited = jnp.any(changed & (before != mask_id), axis=-1)
    ends, counter = block_end(jnp, had_mask, has_mask, edited, step, loop.program.steps_per_block, values)
    stop = jnp.zeros_like(done)
    if loop.program.eos_early_stop:
        n = canvas.shape[1]
        pos = jnp.arange(n)[None, :]
        is_eos = (canvas == eos_id) & (pos >= scan_from[:, None])  # x[:W]: later blocks are masks
        first = jnp.where(jnp.any(is_eos, axis=-1), jnp.argmax(is_eos, axis=-1), n)
        filled = ~jnp.any((canvas == mask_id) & (pos >= gen_start[:, None]) & (pos < first[:, None]), axis=-1)
        wrote = jnp.any(changed & (canvas == eos_id), axis=-1)
        stop = wrote & (first >= gen_start) & filled
    new_done = done | stop | (ends & (block >= last))
    block = jnp.where(ends & ~new_done, block + 1, block)
    return canvas, block, jnp.where(ends, 0, counter), new_done


FLAT = FlatLayout()
FLAT_EDITING = FlatEditingLayout()


def layout_type(mcfg: ModelConfig) -> type[Layout]:
    """The layout of ``mcfg``'s family, for shape-only questions (``Layout``'s class methods)."""
    return BlockCausalLayout if mcfg.block_causal else FlatLayout


def layout_for(mcfg: ModelConfig, program: Program, prompt_mask: jax.Array) -> Layout:
    """The layout of one decode of left-padded prompts (mask [B, P]): chosen here, once."""
    if not mcfg.block_causal:
        return FLAT_EDITING if program.decoder == "edit" else FLAT
    lengths = prompt_mask.astype(jnp.int32).sum(axis=1)
    kind = EditingLayout if program.decoder == "edit" else BlockCausalLayout
    return kind(BlockLayout(lengths, prompt_mask.shape[1], program.block_length), block_stop_rules(mcfg.family))
