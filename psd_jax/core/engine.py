"""The decode loop: one ``jax.jit``-compiled ``lax.while_loop`` over blocks and steps.

The carry holds the canvas, the forward of the current canvas (``F(x)``), each row's block and
step counters, ``done`` flags and call counters. One iteration = policy commit and candidate
building (no model call) -> one batched model call over ``[B, K, N]`` candidates -> per-row
choice -> block advance / EOS early exit. Rows decode independently: own confidences, own
schedule position, own EOS; finished rows are frozen with ``where``.

The forward of a candidate that no row will use is skipped: a call forwards only the leading
candidates some live row can choose (one of ``decoders.forward_sizes``: s0 alone, about half, all
K), and when every row finishes with its policy commit (end of generation or EOS), no model call
is made, so call counts equal upstream's.
``run_python_loop`` runs the same ``step`` in a Python loop and is the test oracle for the
compiled loop.

With ``cache="prefix"|"dual"`` (Fast-dLLM's block KV cache) ``step_cached`` replaces ``step``: the
carry also holds fixed-size per-layer keys/values and a per-row ``stale`` flag; a full forward at
each block start refreshes a row's cache (one model call), and the block's other calls run only a
static window of positions (the rest of the canvas, or the block) against it.

A block-causal model (LLaDA2.0, ``ModelConfig.block_causal``) decodes on a canvas aligned to blocks
from each row's position 0, stops as its upstream ``generate`` does, and its cache is exact:
finished blocks' keys/values are written once, by a window over [previous block, current block] at
each block's first call. Where the families differ, the loop asks its ``Loop.layout``
(``layouts.FlatLayout`` or ``layouts.BlockCausalLayout``, chosen once per decode by
``layouts.layout_for``) instead of branching.

Per row, the carry also holds the runtime values (``runtime.RowValues``: threshold, temperature,
..., the row's own generation length within the canvas) and a PRNG key, so rows with different
values share one compiled loop; and a ``fresh`` flag: a row written into a running batch
(``decode_join``, continuous batching) whose first forward is still to come. A fresh row takes
part in the next model call without committing (its first forward, as ``init_state`` gives a new
decode's), and with a cache it is refreshed and sits out that iteration, so it decodes exactly as
a decode of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models import ModelConfig

from ..parallel.sharding import constrain_kv_cache, constrain_rows
from . import rules
from . import trace as tracing
from .calls import CallShape
from .decoders import Proposal, decoder_for, forward_size_index, forward_sizes, initial_stats, propose
from .layouts import FLAT, Layout, layout_for, where_rows
from .predict import (
    ForwardFn,
    LogitWindow,
    Prediction,
    predict,
    predict_prefill,
    predict_window,
    sequences_forwarded,
)
from .records import DecodeOutput
from .runtime import Program, RowValues, split_rows


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
    calls: jax.Array  # [S] int32: model calls by shape, in the order of ``Loop.call_shapes``
    keys: jax.Array  # [B, 2] uint32: each row's PRNG key (runtime.row_keys)
    values: RowValues  # [B] each: the rows' runtime values
    fresh: jax.Array  # [B] bool: the row's first forward is still to come (joined, decode_join)
    stats: dict
    # Block KV cache (cache != "none" only): per-layer keys/values [L, B, N, KV, hd] from each
    # row's last full forward, and rows whose block changed since (they need that full forward).
    cache: tuple | None = None
    stale: jax.Array | None = None
    since_refresh: jax.Array | None = None  # [B] window calls since the row's last full forward
    # A block-by-block decode's prompts' attention mask [B, P] (``decode_start`` on): the state is
    # the one owner of its rows' order, so ``decode_regroup`` and ``decode_join`` move and write it.
    prompt_mask: jax.Array | None = None
    trace: tracing.Trace | None = None  # when and how each position was written (``Program.trace`` only)


ROW_FIELDS = (
    "canvas",
    "pred",
    "block",
    "step",
    "done",
    "row_nfe",
    "keys",
    "values",
    "fresh",
    "stats",
    "stale",
    "since_refresh",
    "prompt_mask",
    "trace",
)


COUNTERS = ("nfe", "sequence_forwards", "iteration", "calls")


def constrain_state(state: DecodeState, mcfg: ModelConfig) -> DecodeState:
    """``state`` in the one layout every program of a block-by-block decode (``decode_start``,
    ``decode_blocks``, ``decode_join``, ``decode_regroup``) takes and returns under a mesh: per-row
    arrays split by rows (``sharding.batch_sharding``), the counters whole on every device, the KV
    cache as ``sharding.kv_cache_spec``. Each program is compiled for the state the previous one
    returned; left to the partitioner, one program's output layout need not be the next one's input."""
    batch = state.done.shape[0]
    rows = {name: constrain_rows(getattr(state, name), batch) for name in ROW_FIELDS}
    counters = {name: constrain_rows(getattr(state, name), batch, replicated=True) for name in COUNTERS}
    cache = None if state.cache is None else constrain_kv_cache(state.cache, mcfg)
    return state.replace(**rows, **counters, cache=cache)


@dataclasses.dataclass(frozen=True)
class Loop:
    """Static pieces of one decode: settings, shapes and the model call."""

    mcfg: ModelConfig
    program: Program
    prompt_length: int
    forward: ForwardFn
    # (tokens, mask, logits_from=, into=) -> (logits, keys, values); cache != "none" (``layouts.ModelCalls``)
    prefill: Callable | None = None
    window: Callable | None = None  # DiffusionLM.window; cache != "none"
    positions: Callable | None = None  # DiffusionLM.positions (the family's position rule); cache != "none"
    layout: Layout = FLAT  # the family's canvas and attention (``layouts``): asked instead of branching

    @property
    def region_length(self) -> int:
        """Canvas positions after ``prompt_length`` (where blocks are decoded): gen_length, or for a
        block-causal layout one block more, the most a row needs (its first block also holds its
        prompt's tail)."""
        return self.total_length - self.prompt_length

    @property
    def total_length(self) -> int:
        """Canvas positions (``Layout.canvas_length``): the decoded region after ``prompt_length``."""
        return self.prompt_length + self.layout.region_length(self.program)

    def call(
        self,
        canvases: jax.Array,
        attention_mask: jax.Array,
        keys: jax.Array,
        values: RowValues,
        block: jax.Array | None = None,
    ) -> Prediction:
        """One model call over canvases [B, K, N]; with ``block`` [B], logits only where a row can
        commit. ``keys``: ``batch_keys``; ``values``: the rows' runtime values."""
        keys = batch_keys(keys, canvases.shape[0])
        window = None if block is None else self.logit_window(block)
        return predict(
            self.forward, canvases, attention_mask, self.prompt_length, keys, values, self.mcfg, self.program, window
        )

    def logit_window(self, block: jax.Array) -> LogitWindow | None:
        """Where a call computes logits (``rules.logit_window``, the PyTorch backend's too)."""
        window = rules.logit_window(self.program, self.prompt_length, self.region_length, block)
        return None if window is None else LogitWindow(*window)

    @property
    def call_shapes(self) -> tuple[CallShape, ...]:
        """The shapes of call this decode may make, in the order of its ``calls`` counters."""
        return self.layout.call_shapes(self.program, self.total_length)

    def count_call(self, calls: jax.Array, index: int | jax.Array, made: jax.Array | int = 1) -> jax.Array:
        """``calls`` with ``made`` (0 or 1) more call of shape ``index``."""
        return calls + made * jax.nn.one_hot(index, len(self.call_shapes), dtype=jnp.int32)

    @property
    def window_lengths(self) -> tuple[int, ...]:
        """Static query windows of a cached call, ascending (``rules.window_lengths``)."""
        return self.layout.window_lengths(self.program)

    def row_end(self, values: RowValues) -> jax.Array:
        """[B] the canvas index after each row's own generation (``Layout.row_end``)."""
        return self.layout.row_end(self, values)

    def block_span(self, block: jax.Array) -> tuple[jax.Array, jax.Array]:
        start = rules.block_start(self.prompt_length, block, self.program.block_length)
        return start, start + self.program.block_length

    def in_block(self, block: jax.Array) -> jax.Array:
        return rules.in_block(jnp, self.total_length, self.block_span(block)[0], self.program.block_length)

    def committable(self, state: DecodeState) -> jax.Array:
        """M(x): masked positions of each row's current block ([B, N]); nothing for done rows."""
        start = self.block_span(state.block)[0]
        since = self.prompt_length if self.program.predict_mask else None  # and earlier blocks' [MASK]s
        return rules.committable(
            jnp, state.canvas, start, state.done, self.program.block_length, self.mcfg.mask_id, since
        )

    def decoder_positions(self, state: DecodeState, frozen: jax.Array) -> jax.Array | None:
        """[B, N] the positions the decoder reads beyond its block's masks (``Decoder.candidates``'
        ``ahead``), none of a ``frozen`` row's, as the decoder says (``Decoder.ahead_positions``:
        PSD's next block, token editing's written positions); None for the others."""
        return decoder_for(self.program).ahead_positions(self, state, frozen)

    def advance(self, canvas, block, step, done, values: RowValues, before=None):
        """Move rows whose block is complete to the next block; stop rows at their last block
        (``values.num_blocks``) or at EOS (``Layout.advance``).

        ``before`` is the canvas before this commit (the block-causal rule needs what was just
        committed)."""
        return self.layout.advance(self, canvas, block, step, done, values, before)


def init_state(
    loop: Loop, prompt_ids: jax.Array, attention_mask: jax.Array, keys: jax.Array, values: RowValues
) -> DecodeState:
    """Canvas = prompt + gen_length masks, and its first forward (one model call). ``keys``
    (``batch_keys``) and ``values`` are the rows' own; a row's keys are split as a refreshed row's are
    (``step_cached``), so a row written into a running batch later (``decode_join``) draws the same."""
    batch = prompt_ids.shape[0]
    keys = batch_keys(keys, batch)
    canvas = loop.layout.initial_canvas(prompt_ids, loop.mcfg, loop.program)
    cached = {}
    if loop.program.cache != "none":
        # Block 0's block-start full forward, which also fills the KV cache.
        keys, sub, _ = split_rows(keys, 3)
        first = loop.logit_window(jnp.zeros(batch, jnp.int32))
        pred, k, v = predict_prefill(
            loop.prefill, canvas, attention_mask, loop.prompt_length, sub, values, loop.mcfg, loop.program, first
        )
        cached = {
            "cache": constrain_kv_cache((k, v), loop.mcfg),
            "stale": jnp.zeros(batch, bool),
            "since_refresh": jnp.zeros(batch, jnp.int32),
        }
    else:
        keys, sub = split_rows(keys, 2)
        first = loop.call(canvas[:, None], attention_mask, sub, values, jnp.zeros(batch, jnp.int32))
        pred = jax.tree.map(lambda a: a[:, 0], first)
    zeros = jnp.zeros(batch, jnp.int32)
    return DecodeState(
        canvas=canvas,
        pred=pred,
        block=zeros,
        step=zeros,
        done=jnp.zeros(batch, bool),
        row_nfe=jnp.ones(batch, jnp.int32),
        nfe=jnp.array(1, jnp.int32),
        sequence_forwards=jnp.array(batch * (2 if loop.program.guided else 1), jnp.int32),
        iteration=jnp.array(0, jnp.int32),
        calls=loop.count_call(jnp.zeros(len(loop.call_shapes), jnp.int32), 0),  # full 1, or refresh: shape 0
        keys=keys,
        values=values,
        fresh=jnp.zeros(batch, bool),
        stats=initial_stats(loop.program, batch),
        trace=tracing.empty(canvas) if loop.program.trace else None,
        **cached,
    )


def step(loop: Loop, attention_mask: jax.Array, state: DecodeState) -> DecodeState:
    """One iteration: commit + candidates, one batched forward (if any row needs it), choose, advance.

    A fresh row commits nothing: its canvas is its only candidate, and this call is its first
    forward (``init_state``'s, for a decode of its own)."""
    if loop.program.cache != "none":
        return step_cached(loop, attention_mask, state)
    fresh, values = state.fresh, state.values
    valid = loop.committable(state) & ~fresh[:, None]
    ahead = loop.decoder_positions(state, fresh | state.done)
    proposal = propose(state.pred, state.canvas, valid, state.step, loop.program, values, ahead)
    # A row is live if it still decodes after its policy commit; only live rows need a forward.
    _, _, _, done_after_s0 = loop.advance(proposal.s0, state.block, state.step + 1, state.done, values, state.canvas)
    live = ~done_after_s0
    keys, sub = split_rows(state.keys, 2)
    preds, calls, forwarded, shape = _forward_leading(
        proposal, live, state.pred, lambda candidates: loop.call(candidates, attention_mask, sub, values, state.block)
    )
    sequences = sequences_forwarded(state.canvas.shape[0], forwarded, loop.program)
    by_shape = loop.count_call(state.calls, shape, calls)
    new = _apply_choice(
        loop, state, proposal, preds, live & ~fresh, state.done | fresh, keys, live, calls, sequences, by_shape
    )
    return new.replace(done=new.done & ~(fresh & ~state.done), fresh=jnp.zeros_like(fresh))


def _forward_leading(
    proposal: Proposal,
    rows: jax.Array,
    pred: Prediction,
    call: Callable,
    variants: tuple = (None,),
    variant_index: jax.Array | int = 0,
):
    """The candidates' predictions [B, K, ...] from one call over the leading ones ``rows`` can choose.

    ``call(candidates)`` (or ``call(candidates, variant)`` for several ``variants``, chosen by
    ``variant_index``) runs the model; no call at all when no row needs one (the predictions are
    then ``pred`` repeated). Branch 0 is that skip; branch 1 + i * V + v forwards the first
    ``forward_sizes(K)[i]`` candidates (the fewest covering every row's choosable ones: PSD
    levels, RPS branches) with variant v. Returns (predictions, calls made, candidates forwarded,
    the call's index i * V + v among the forwarding branches: its shape, ``calls.call_shapes``).
    """
    k = proposal.candidates.shape[1]
    sizes = forward_sizes(k)

    def forward(size: int, variant):
        run = call if variant is None else (lambda c: call(c, variant))
        return lambda _: _pad_candidates(run(proposal.candidates[:, :size]), k)

    size_index = forward_size_index(proposal.needed, rows, k)
    branch = jnp.where(jnp.any(rows), 1 + size_index * len(variants) + variant_index, 0)
    skip = lambda _: _broadcast(pred, k)  # noqa: E731
    preds = jax.lax.switch(branch, [skip] + [forward(size, v) for size in sizes for v in variants], None)
    calls = (branch > 0).astype(jnp.int32)
    return preds, calls, calls * jnp.asarray(sizes)[size_index], jnp.maximum(branch - 1, 0)


def _apply_choice(
    loop: Loop,
    state: DecodeState,
    proposal: Proposal,
    preds: Prediction,
    live: jax.Array,
    frozen: jax.Array,
    keys: jax.Array,
    row_calls: jax.Array,
    calls: jax.Array,
    sequences: jax.Array,
    by_shape: jax.Array,
    **cached,
) -> DecodeState:
    """The tail shared by both steps: each row's choice, its canvas and forward, block advance, counters.

    ``frozen`` rows (finished, waiting for a block-start refresh, or fresh) keep their canvas and
    step; ``keys`` are the rows' next PRNG keys."""
    choice = decoder_for(loop.program, state.values).choose(proposal, preds, live, state.step, loop.mcfg.mask_id)
    canvas = jnp.take_along_axis(proposal.candidates, choice.index[:, None, None], axis=1)[:, 0]
    canvas = jnp.where(frozen[:, None], state.canvas, canvas)
    pred = jax.tree.map(lambda a: jnp.take_along_axis(a, _expand(choice.index, a), axis=1)[:, 0], preds)
    written = state.trace
    if written is not None:
        # A frozen row keeps its canvas, so it writes nothing and its proposal is never read.
        mask_id, decoder = loop.mcfg.mask_id, loop.program.decoder
        args = (state.canvas, canvas, proposal.s0, proposal.candidates, choice.index, state.row_nfe)
        written = tracing.record(written, *args, mask_id, decoder)
    steps = state.step + jnp.where(frozen, 0, choice.steps)
    canvas, block, new_step, done = loop.advance(canvas, state.block, steps, frozen, state.values, state.canvas)
    return DecodeState(
        canvas=canvas,
        pred=pred,
        block=block,
        step=new_step,
        done=done,
        row_nfe=state.row_nfe + row_calls.astype(jnp.int32),
        nfe=state.nfe + calls,
        sequence_forwards=state.sequence_forwards + sequences,
        iteration=state.iteration + 1,
        calls=by_shape,
        keys=keys,
        values=state.values,
        fresh=state.fresh,
        stats=jax.tree.map(jnp.add, state.stats, choice.stats),
        prompt_mask=state.prompt_mask,
        trace=written,
        **cached,
    )


def step_cached(loop: Loop, attention_mask: jax.Array, state: DecodeState) -> DecodeState:
    """``step`` with the block KV cache (Fast-dLLM semantics, docs/algorithms.md "Block KV cache").

    1. Rows whose block changed since their last full forward (``stale``) get the block-start
       full forward of their canvas: it refreshes their cache rows and their prediction, and is
       one model call. Rows move through blocks together, as in Fast-dLLM's batched loop: a row
       that completed its block waits (frozen, no calls counted for it) until every live row has,
       so one block-start forward serves the whole batch. Without this, rows at different block
       phases would cost a full forward each, on top of the window call of the others.
    2. Commit + candidates exactly as ``step``. Rows that stay in their block after the policy
       commit, or have drafts into the next block, forward their candidates as windows against the
       cache (``_window_forwards``); the others are refreshed next iteration (as Fast-dLLM's next
       block starts with a full forward).
    Each kind of call runs only if some row needs it; results merge per row, so a row decodes
    exactly as alone. Shapes are static (fixed-size caches and windows). A fresh row (joined) is
    stale too: its refresh is its first forward, and it sits the rest of that iteration out, as a
    new decode's first forward (``init_state``) comes before its first step.
    """
    program, batch = loop.program, state.canvas.shape[0]
    keys, refresh_key, window_key = split_rows(state.keys, 3)
    waiting, refresh = rules.cache_phase(jnp, state.stale, state.done)
    refresh |= rules.refresh_due(jnp, state.since_refresh, state.stale, state.done, program.refresh_every)
    primed = refresh & state.fresh  # joined rows: this refresh is their first forward
    pred, cache, refresh_calls, by_shape = loop.layout.refresh(loop, attention_mask, state, refresh, refresh_key)

    frozen = state.done | waiting | primed  # waiting rows are frozen like finished ones
    valid = loop.committable(state.replace(done=frozen))
    ahead = loop.decoder_positions(state, frozen)
    proposal = propose(pred, state.canvas, valid, state.step, program, state.values, ahead)
    _, block_after_s0, _, done_after_s0 = loop.advance(
        proposal.s0, state.block, state.step + 1, frozen, state.values, state.canvas
    )
    live = ~done_after_s0
    # Drafts into the next block are verified by the window from the row's block start.
    windowed = live & ((block_after_s0 == state.block) | (proposal.needed > 1))
    preds, window_calls, forwarded, shape = _window_forwards(
        loop, attention_mask, state, cache, pred, proposal, windowed, window_key
    )
    sequences = refresh_calls * batch + sequences_forwarded(batch, forwarded, program)
    # The window shapes follow the layout's refresh shapes in ``Loop.call_shapes``.
    by_shape = loop.count_call(by_shape, loop.layout.refresh_shapes + shape, window_calls)
    new = _apply_choice(
        loop,
        state,
        proposal,
        preds,
        live,
        frozen,
        jnp.where(waiting[:, None], state.keys, keys),  # a waiting row draws nothing this iteration
        refresh.astype(jnp.int32) + windowed.astype(jnp.int32),
        refresh_calls + window_calls,
        sequences,
        by_shape,
        cache=cache,
        stale=state.stale,
        since_refresh=jnp.where(refresh, 0, state.since_refresh) + windowed.astype(jnp.int32),
    )
    done, stale = rules.cache_stale(jnp, waiting, new.done, state.block, new.block)
    done = done & ~(primed & ~state.done)
    return new.replace(done=done, stale=stale & ~primed, fresh=state.fresh & ~primed)


def _window_forwards(loop: Loop, attention_mask, state: DecodeState, cache, pred, proposal: Proposal, windowed, key):
    """The windowed rows' candidates forwarded against the cache (``_forward_leading``): one static
    window length (dual: the block; prefix: buckets up to gen_length), the shortest covering every
    windowed row's rest of its generation (dual: the block, always)."""
    start, _ = loop.block_span(state.block)
    lengths = loop.window_lengths
    rest = jnp.max(jnp.where(windowed, loop.row_end(state.values) - start, 0))
    bucket = jnp.minimum(rules.covering_index(jnp, lengths, rest), len(lengths) - 1)
    call = partial(_window_call, loop, attention_mask, cache, pred, start, key, state.values)
    return _forward_leading(proposal, windowed, pred, call, lengths, bucket)


def _window_call(
    loop: Loop,
    attention_mask: jax.Array,
    cache: tuple,
    pred: Prediction,
    start: jax.Array,
    keys: jax.Array,
    values: RowValues,
    candidates: jax.Array,
    w: int,
) -> Prediction:
    """Forward candidates [B, M, N] as windows of w positions from each row's block start, against
    the cache; the window's fresh keys/values replace the cached ones at its positions, and its
    predictions overwrite the candidates' (``pred``'s) at those positions."""
    mcfg, program = loop.mcfg, loop.program
    batch, m, n = candidates.shape
    index = start[:, None] + jnp.arange(w)[None, :]  # [B, W]
    # Prefix windows may reach past the row's generation (or the canvas end): those keys are masked.
    window_mask = index < loop.row_end(values)[:, None]
    index = jnp.minimum(index, n - 1)
    pos = jnp.arange(n)[None, :]
    in_window = (pos >= start[:, None]) & (pos < start[:, None] + w)
    tokens = jnp.take_along_axis(candidates, jnp.broadcast_to(index[:, None], (batch, m, w)), axis=2)
    positions = jnp.take_along_axis(loop.positions(attention_mask, batch, n), index, axis=1)
    shift = mcfg.logit_shift
    # The block's predictions, and the next block's for PSD's drafts into it (``rules.logit_width``).
    out = min(rules.logit_count(program, loop.region_length), w) - shift
    win = predict_window(
        loop.window,
        tokens,
        jnp.broadcast_to(positions[:, None], (batch, m, w)),
        cache,
        attention_mask.astype(bool) & loop.layout.cached_keys(pos, start, in_window),
        window_mask,
        out,
        keys,
        values,
        mcfg,
        program,
    )

    # Window position j predicts canvas position start + j + shift (Dream: the block's first
    # position keeps the prediction of its block-start full forward, as Fast-dLLM does). Predictions
    # past the canvas end (a next block after the last) are dropped: the canvas is padded to hold them.
    def place(a: jax.Array, b: jax.Array, s: jax.Array) -> jax.Array:
        if out <= program.block_length - shift:  # always inside the canvas
            return jax.lax.dynamic_update_slice_in_dim(a, b, s, axis=1)
        padded = jnp.concatenate([a, jnp.zeros_like(a[:, :out])], axis=1)
        return jax.lax.dynamic_update_slice_in_dim(padded, b, s, axis=1)[:, :n]

    return jax.tree.map(lambda a, b: jax.vmap(place)(a, b, start + shift), _broadcast(pred, m), win)


def _broadcast(pred: Prediction, k: int) -> Prediction:
    """A Prediction [B, ...] repeated as the prediction of K candidates [B, K, ...]."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], k, *a.shape[1:])), pred)


def _pad_candidates(pred: Prediction, k: int) -> Prediction:
    """Predictions of the first candidates [B, M, ...] -> [B, K, ...]; the M..K-1 slots repeat
    candidate 0's (no row can choose them: they were not forwarded)."""
    m = pred.token.shape[1]
    if m == k:
        return pred
    return jax.tree.map(lambda a: jnp.concatenate([a, _broadcast(a[:, 0], k - m)], axis=1), pred)


def _expand(index: jax.Array, a: jax.Array) -> jax.Array:
    return index.reshape(index.shape + (1,) * (a.ndim - 1))


def run_while_loop(loop: Loop, prompt_ids, attention_mask, keys, values) -> DecodeState:
    state = init_state(loop, prompt_ids, attention_mask, keys, values)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), partial(step, loop, attention_mask), state)


def run_python_loop(loop: Loop, prompt_ids, attention_mask, keys, values, max_iterations: int = 100_000) -> DecodeState:
    """The same step in a plain Python loop (the oracle the compiled loop is tested against)."""
    state = init_state(loop, prompt_ids, attention_mask, keys, values)
    step_fn = jax.jit(partial(step, loop, attention_mask))
    for _ in range(max_iterations):
        if bool(jnp.all(state.done)):
            return state
        state = step_fn(state)
    raise RuntimeError(f"decode did not finish in {max_iterations} iterations")


def finish(state: DecodeState, canvas: jax.Array | None = None, trace: tracing.Trace | None = None) -> DecodeOutput:
    """The decode's record; ``canvas`` (``output_canvas``) and ``trace`` (``output_trace``) replace
    the state's own if given."""
    canvas = state.canvas if canvas is None else canvas
    trace = state.trace if trace is None else trace
    return DecodeOutput(
        canvas, state.row_nfe, state.nfe, state.sequence_forwards, state.iteration, state.stats, state.calls, trace
    )


def _loop_for(model, prompt_length: int, mcfg: ModelConfig, program: Program, layout: Layout = FLAT) -> Loop:
    """The loop of ``model`` on ``layout`` (its ``prompt_length``: ``Layout.decode_start``), with the
    model's calls as the layout makes them."""
    calls = layout.model_calls(model, program)
    return Loop(
        mcfg,
        program,
        prompt_length,
        calls.forward,
        prefill=calls.prefill,
        window=calls.window,
        positions=calls.positions,
        layout=layout,
    )


def loop_and_mask(
    model, prompt_mask: jax.Array, mcfg: ModelConfig, program: Program, values: RowValues | None = None
) -> tuple[Loop, jax.Array]:
    """The decode's ``Loop`` (its layout chosen here, ``layouts.layout_for``) and its canvas
    attention mask [B, N] (``Layout.attention_mask``: the rows' own generation lengths from
    ``values``, default all of the canvas)."""
    layout = layout_for(mcfg, program, prompt_mask)
    loop = _loop_for(model, layout.decode_start(prompt_mask.shape[1], program), mcfg, program, layout)
    return loop, layout.attention_mask(prompt_mask, loop.total_length, program, values)


def batch_keys(key: jax.Array, batch: int) -> jax.Array:
    """Per-row raw keys [B, 2] of a decode: ``key`` is one key for the batch (typed or raw: row r
    draws from ``fold_in(key, r)``, as ``runtime.row_keys``) or the rows' raw keys [B, 2]."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return key if key.ndim == 2 else jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(batch))


def _decode(model, prompt_ids, prompt_mask, key, values, mcfg: ModelConfig, program: Program, runner) -> DecodeOutput:
    keys = batch_keys(key, prompt_ids.shape[0])
    loop, attention_mask = loop_and_mask(model, prompt_mask, mcfg, program, values)
    state = runner(loop, prompt_ids, attention_mask, keys, values)
    trace = None if state.trace is None else loop.layout.output_trace(state.trace, program)
    return finish(state, loop.layout.output_canvas(state.canvas, mcfg, program), trace)


@partial(jax.jit, static_argnames=("graphdef", "mcfg", "program"))
def decode(
    graphdef, params, prompt_ids, prompt_mask, key, values: RowValues, *, mcfg: ModelConfig, program: Program
) -> DecodeOutput:
    """Decode left-padded prompts [B, P] (mask [B, P]); compiled once per shape and ``program``
    (``runtime.Program.of`` the settings). ``key``: ``batch_keys``; ``values``: the rows' runtime
    values (``RowValues.of`` their settings)."""
    model = nnx.merge(graphdef, params)
    return _decode(model, prompt_ids, prompt_mask, key, values, mcfg, program, run_while_loop)


def decode_python_loop(
    model, prompt_ids, prompt_mask, key, values: RowValues, *, mcfg: ModelConfig, program: Program
) -> DecodeOutput:
    """Same decode with a plain Python loop over the (separately jitted) ``step``; the test oracle."""
    return _decode(model, prompt_ids, prompt_mask, key, values, mcfg, program, run_python_loop)


# ---------------------------------------------------------------------------- block streaming
# The same loop, stopped on the host's behalf at block boundaries: a block is final once a row has
# left it, so a server can send it while the next one decodes. ``decode_start`` is ``init_state``;
# each ``decode_blocks`` call runs ``step`` in one while_loop until every row that was decoding has
# left its block or finished (one host round trip per block, none per step). Calling
# ``decode_blocks`` until every row is done runs exactly the iterations of ``decode``, with the
# same keys, so the outputs are the same. Between two calls ``decode_join`` writes new requests
# into rows that are done (continuous batching): each decodes from there exactly as on its own.


@partial(jax.jit, static_argnames=("graphdef", "mcfg", "program"))
def decode_start(
    graphdef, params, prompt_ids, prompt_mask, keys, values, live, *, mcfg: ModelConfig, program: Program
) -> DecodeState:
    """The decode's first state (its first forward); rows where ``live`` [B] is false start done.

    Rows that start done are padding: a server pads a batch to one of a few compiled sizes, and a
    done row is frozen, gets no model calls of its own and does not hold the others back."""
    model = nnx.merge(graphdef, params)
    loop, attention_mask = loop_and_mask(model, prompt_mask, mcfg, program, values)
    state = init_state(loop, prompt_ids, attention_mask, keys, values)
    return constrain_state(state.replace(done=~live, prompt_mask=prompt_mask), mcfg)


@partial(jax.jit, static_argnames=("graphdef", "mcfg", "program"), donate_argnames=("state",))
def decode_blocks(graphdef, params, state: DecodeState, *, mcfg: ModelConfig, program: Program):
    """Advance ``state`` until every row that was decoding has left its block or finished."""
    model = nnx.merge(graphdef, params)
    loop, attention_mask = loop_and_mask(model, state.prompt_mask, mcfg, program, state.values)
    return constrain_state(run_until_block_ends(loop, attention_mask, state), mcfg)


@partial(jax.jit, static_argnames=("graphdef", "mcfg", "program"), donate_argnames=("state",))
def decode_join(
    graphdef, params, prompt_ids, prompt_mask, state: DecodeState, join, keys, values, *, mcfg, program: Program
) -> DecodeState:
    """``state`` with the rows where ``join`` [B] is true started afresh on their new prompts
    (``prompt_ids``/``prompt_mask`` [B, P]: these rows' new ones; the other rows' are not read), keys [B, 2] and values:
    their canvas, counters and statistics reset, and marked fresh (their first forward comes with
    the next call, stale with a cache, so the refresh fills their cache rows). No model call (the
    model arguments are those of every compiled decode program, unused); the other rows are
    unchanged. A joining row must be done (finished or padding)."""
    prompt_mask = jnp.where(join[:, None], prompt_mask, state.prompt_mask)  # the batch's from here on
    layout = layout_for(mcfg, program, prompt_mask)
    batch = prompt_ids.shape[0]
    zeros = jnp.zeros(batch, jnp.int32)
    fresh = {
        "canvas": layout.initial_canvas(prompt_ids, mcfg, program),
        "block": zeros,
        "step": zeros,
        "done": jnp.zeros(batch, bool),
        "row_nfe": zeros,
        "keys": keys,
        "values": values,
        "fresh": jnp.ones(batch, bool),
        "stats": initial_stats(program, batch),
    }
    if program.cache != "none":
        fresh["stale"] = jnp.ones(batch, bool)
        fresh["since_refresh"] = zeros
    if program.trace:
        fresh["trace"] = tracing.empty(fresh["canvas"])
    current = {name: getattr(state, name) for name in fresh}
    return constrain_state(state.replace(prompt_mask=prompt_mask, **where_rows(join, fresh, current)), mcfg)


def run_until_block_ends(loop: Loop, attention_mask: jax.Array, state: DecodeState) -> DecodeState:
    """``step`` while some row is still decoding the block it was in when called.

    Without a cache, rows leave blocks at different iterations; a row that has left keeps decoding
    its next block until the last one has (so a call may finish two blocks of a fast row). With a
    cache, rows already move through blocks together."""
    entry_block = state.block
    still_in_block = lambda s: jnp.any(~s.done & (s.block == entry_block))  # noqa: E731
    return jax.lax.while_loop(still_in_block, partial(step, loop, attention_mask), state)


@partial(jax.jit, static_argnames=("graphdef", "mcfg", "program"))
def decode_regroup(graphdef, params, state: DecodeState, index, *, mcfg: ModelConfig, program: Program):
    """``state``'s rows ``index`` [S] (-1: an empty row, done) as a state of S rows: a running batch
    moved to another compiled size (continuous batching). Each kept row is exactly as it was; no
    model call (the model arguments are every compiled decode program's, unused)."""
    empty = index < 0
    rows = jnp.maximum(index, 0)
    names = ("canvas", "pred", "block", "step", "row_nfe", "keys", "values", "fresh", "stats", "prompt_mask")
    names += ("trace",) if program.trace else ()
    moved = {name: jax.tree.map(lambda a: jnp.take(a, rows, axis=0), getattr(state, name)) for name in names}
    moved["done"] = jnp.take(state.done, rows) | empty
    if state.cache is not None:
        moved["cache"] = constrain_kv_cache(tuple(jnp.take(c, rows, axis=1) for c in state.cache), mcfg)
        moved["stale"] = jnp.take(state.stale, rows) & ~empty
        moved["since_refresh"] = jnp.take(state.since_refresh, rows)
    return constrain_state(state.replace(**moved), mcfg)


@partial(jax.jit, static_argnames=("graphdef", "mcfg", "program"), donate_argnames=("state",))
def decode_stop(graphdef, params, state: DecodeState, stopped, *, mcfg: ModelConfig, program: Program) -> DecodeState:
    """``state`` with the rows where ``stopped`` [B] is true frozen as finished rows are (their output
    is no longer wanted, and they no longer hold the batch back). No model call (the model arguments
    are every compiled decode program's, unused)."""
    return constrain_state(state.replace(done=state.done | stopped), mcfg)


@partial(jax.jit, static_argnames=("mcfg", "program"))
def streamed(canvas, block, done, prompt_mask, num_blocks, trace=None, *, mcfg, program: Program):
    """What a block-streaming caller reads of a state, computed on device (one dispatch per block):
    the canvas as ``output_canvas`` gives it, and per row the number of final ``block_length``
    pieces of its generated ids (``final_blocks``; block-causal: a row's blocks are offset by its
    prompt's tail, so a piece is final once the decoded blocks cover it, and once the row is done
    every piece up to the one holding its first EOS, as ``final_blocks`` counts a row that stopped
    at EOS; ``Layout.streamed``), and the state's trace laid out as that canvas (``None``: none)."""
    layout = layout_for(mcfg, program, prompt_mask)
    out, final = layout.streamed(canvas, block, done, num_blocks, mcfg, program)
    return out, final, None if trace is None else layout.output_trace(trace, program)
