"""Seconds per model call, by shape: measured on this device, or modeled for a named target.

A decode's time is, to a good approximation, the sum over its calls of what each call costs
(``calls.py``: a decode records its calls by shape). So the cost of a setting on a device is
``predicted_seconds(calls, costs)``, and a finished search re-ranks for another device without
decoding again. Two sources of per-call costs:

- ``measure_call_costs``: each shape a decode program uses, compiled alone from that program's own
  pieces (the engine's call functions on a state of the program) and timed warm on this device,
  the median of a few runs.
- ``roofline_call_cost``: a named model on a named chip, ``max(FLOPs / peak, bytes / bandwidth)``
  per call, with the FLOPs and bytes of the call's shape counted analytically (docs/cost-model.md).

A key is ``"<kind> <candidates>x<positions> b<batch>"`` (``cost_key``). The loop's own work between
calls (the policy's ranks, the candidates, the choice, the block advance) is left out: on this CPU
it is within the timing noise (docs/cost-model.md "Seconds from calls").
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

from .core.calls import CallShape, record_shape
from .core.layouts import full_refresh, layout_type

REPEATS = 5  # timed runs of a call; the median is its cost


def cost_key(shape: CallShape, batch: int) -> str:
    return f"{shape.key} b{batch}"


def record_key(call: dict[str, Any]) -> str:
    """The cost key of one of a decode's call records (``calls.call_records``)."""
    return cost_key(record_shape(call), call["batch"])


def predicted_seconds(calls: Iterable[dict[str, Any]], costs: dict[str, float]) -> float:
    """Seconds of a decode whose calls are ``calls`` (records), with ``costs`` seconds per call by key."""
    calls = list(calls)
    missing = sorted({record_key(c) for c in calls} - set(costs))
    if missing:
        raise KeyError(f"no cost for the call shape(s) {missing}")
    return sum(c["count"] * costs[record_key(c)] for c in calls)


# -------------------------------------------------------------------------------- measured here


def measure_call_costs(
    lm, program, prompt_length: int, batch: int, shapes: Iterable[CallShape] | None = None, repeats: int = REPEATS
) -> dict[str, float]:
    """Seconds per call of each of ``shapes`` (default: every shape ``program`` may use) at ``batch``
    rows on a canvas after ``prompt_length`` prompt positions, on ``lm``'s device: the median of
    ``repeats`` timed runs of each (``call_timers``), the shapes taken in turn in each round, so a
    slow moment of the machine weighs on every shape alike."""
    timers = call_timers(lm, program, prompt_length, batch, shapes)
    runs: dict[str, list[float]] = {key: [] for key in timers}
    for _ in range(repeats):
        for key, timer in timers.items():
            runs[key].append(timer())
    return {key: statistics.median(seconds) for key, seconds in runs.items()}


def call_timers(
    lm, settings, prompt_length: int, batch: int, shapes: Iterable[CallShape] | None = None
) -> dict[str, Callable[[], float]]:
    """Per shape (default: every shape ``settings``' program may use), keyed by ``cost_key``, a function that
    runs that call once on ``lm``'s device and returns its seconds (``block_until_ready``): each
    call compiled alone from the engine's own call functions and given a first state of the
    program, made beforehand; compiled and run once to warm up here, so nothing of that is timed."""
    import jax
    import jax.numpy as jnp

    from .core.runtime import Program, RowValues, row_keys

    program = Program.of(settings)
    first_state, calls = _call_functions(lm, program, prompt_length, batch)
    params = lm.params
    keys = jnp.asarray(row_keys([0] * batch, range(batch)))
    values = jax.tree.map(jnp.asarray, RowValues.of([settings] * batch))
    state = jax.block_until_ready(jax.jit(first_state)(params, keys, values))

    def timer(compiled) -> Callable[[], float]:
        def run() -> float:
            began = time.perf_counter()
            jax.block_until_ready(compiled(params, state, keys, values))
            return time.perf_counter() - began

        run()  # warm: an executable's first run carries one-off costs
        return run

    return {
        cost_key(shape, batch): timer(jax.jit(calls[shape]).lower(params, state, keys, values).compile())
        for shape in (calls if shapes is None else shapes)
    }


def _call_functions(lm, program, prompt_length: int, batch: int):
    """(a function (params, keys, values) -> a first state of ``program``: all-mask canvases after
    ``prompt_length`` pad tokens, every row live; per shape of the program, a function (params,
    state, keys, values) -> that call's outputs, made of the engine's own call functions)."""
    import jax.numpy as jnp
    from flax import nnx

    from .core import engine

    mcfg = lm.config
    ids = jnp.full((batch, prompt_length), mcfg.pad_id, jnp.int32)
    prompt_mask = jnp.ones((batch, prompt_length), jnp.int32)

    def loop_of(params, values):
        return engine.loop_and_mask(nnx.merge(lm.graphdef, params), prompt_mask, mcfg, program, values)

    def first_state(params, keys, values):
        loop, mask = loop_of(params, values)
        return engine.init_state(loop, ids, mask, keys, values)

    layout = layout_type(mcfg)
    shapes = layout.call_shapes(program, layout.canvas_length(prompt_length, program))
    rows = jnp.ones(batch, bool)

    def call(shape: CallShape):
        def run(params, state, keys, values):
            loop, mask = loop_of(params, values)
            if shape.kind == "full":
                canvases = jnp.repeat(state.canvas[:, None], shape.candidates, axis=1)
                return loop.call(canvases, mask, keys, values, state.block)
            if shape.kind == "refresh":
                return full_refresh(loop, mask, state.replace(fresh=rows), rows, keys)[:2]
            if shape.kind == "block_refresh":
                second = state.replace(block=jnp.ones(batch, jnp.int32))
                return loop.layout.window_refresh(loop, mask, second, rows, keys)[:2]
            canvases = jnp.repeat(state.canvas[:, None], shape.candidates, axis=1)
            start = loop.block_span(state.block)[0]
            return engine._window_call(
                loop, mask, state.cache, state.pred, start, keys, values, canvases, shape.positions
            )

        return run

    return first_state, {shape: call(shape) for shape in shapes}


# ------------------------------------------------------------------------------- modeled target


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak dense bfloat16 FLOP/s and memory bandwidth (bytes/s) of one chip, with their source."""

    name: str
    flops: float
    bandwidth: float
    source: str


CHIPS = {
    "h200": Chip(
        "NVIDIA H200",
        989e12,
        4.8e12,
        "NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity (989 dense), 4.8 TB/s",
    ),
    "tpu-v5e": Chip("TPU v5e", 197e12, 819e9, "Google Cloud TPU v5e documentation: 197 TFLOPS bf16, 819 GB/s"),
}


def roofline_call_cost(
    mcfg,
    chip: Chip,
    shape: CallShape,
    batch: int,
    block_length: int,
    logits: int | None = None,
    bytes_per_param: int = 2,
) -> float:
    """Seconds of one call of ``shape`` for the model ``mcfg`` on ``chip``: max(FLOPs / peak,
    bytes / bandwidth), where the FLOPs are 2 x layer parameters x tokens through the layers, the LM
    head over the positions that get logits per canvas (``logits``, as the call records give it;
    when not given, a decode without ``draft_next_block``'s: two blocks uncached, one cached) and
    attention's two products, and the bytes the weights read once, the KV cache read by window calls
    (written by refreshes) and the tokens' activations in and out of each layer."""
    d, hd = mcfg.d_model, mcfg.head_dim
    layer = d * mcfg.n_heads * hd * 2 + d * mcfg.n_kv_heads * hd * 2 + 3 * d * mcfg.mlp_hidden
    layer_params = layer * mcfg.n_layers
    head = d * mcfg.vocab_size
    rows = batch * shape.candidates
    queries = shape.positions
    keys = shape.positions if shape.kind in ("full", "refresh") else None
    kv_per_position = 2 * mcfg.n_layers * mcfg.n_kv_heads * hd * bytes_per_param
    if keys is None:  # a window attends to the whole cached canvas: its keys are the cache's
        keys = max(shape.positions, 2 * block_length)
    if logits is None:
        logits = block_length * (1 if shape.kind != "full" else 2)
    committable = min(logits, queries)
    flops = 2 * layer_params * rows * queries + 2 * head * rows * committable
    flops += 4 * mcfg.n_layers * rows * queries * keys * mcfg.n_heads * hd
    weight_bytes = (layer_params + head) * bytes_per_param
    cache_bytes = kv_per_position * batch * keys if shape.kind in ("window", "block_refresh", "refresh") else 0
    activation_bytes = 2 * mcfg.n_layers * rows * queries * d * bytes_per_param
    return max(flops / chip.flops, (weight_bytes + cache_bytes + activation_bytes) / chip.bandwidth)
