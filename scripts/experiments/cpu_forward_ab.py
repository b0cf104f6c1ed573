"""Answers: how much do the CPU forward fixes of ``models/transformer.py`` save?

The current model against the forms they replaced, compiled side by side in one process and called
alternately (so drift in the machine's speed hits both alike), on the random LLaDA-shaped model of
``scripts/compare_backends.py`` (docs/xla-vs-pytorch.md).

- ``full``: one forward of [1, N] tokens. ``before`` returns the RoPE tables without the identity
  gather (XLA then fuses sin/cos into every head's RoPE) and takes ``jax.nn.silu`` in the layer
  dtype; ``rope only`` has just the first fix.
- ``window``: one KV-cache window forward (``DiffusionLM.window``, M windows of W positions over a
  cache of N) with the head-batched cache attention (``cached_attention_grouped``, the GPU/TPU form)
  against the per-head one used on CPU.

Reports the median of each form's calls and the median of the per-call ratios ``before / this``::

    python -m scripts.experiments.cpu_forward_ab --what full --dtype bfloat16 --length 288
    python -m scripts.experiments.cpu_forward_ab --what window --dtype float32 --windows 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import models.transformer as T
from scripts.compare_backends import random_llada_config


def layer_dtype_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def compiled_forms(forms: dict, build) -> dict:
    """Compile ``build()`` once per form, with the form's functions patched into the model module."""
    saved = {name: getattr(T, name) for patch in forms.values() for name in patch}
    compiled = {}
    for label, patch in forms.items():
        for name, fn in {**saved, **patch}.items():
            setattr(T, name, fn)
        compiled[label] = build()
    for name, fn in saved.items():
        setattr(T, name, fn)
    return compiled


def alternate(compiled: dict, args: tuple, calls: int) -> dict[str, list[float]]:
    for fn in compiled.values():
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    times = {label: [] for label in compiled}
    for _ in range(calls):
        for label, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[label].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["full", "window"], default="full")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--length", type=int, default=288, help="tokens of the forward / of the cache")
    p.add_argument("--width", type=int, default=32, help="window: positions per window")
    p.add_argument("--windows", type=int, default=1, help="window: windows per row (PSD/RPS candidates)")
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    shape = argparse.Namespace(
        layers=args.layers, d_model=args.d_model, heads=args.heads, kv_heads=None, mlp=None, vocab=4096
    )
    cfg = random_llada_config(shape)
    graphdef, params = nnx.split(T.DiffusionLM(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0), unroll_layers=True))
    ids = jnp.ones((1, args.length), jnp.int32)
    if args.what == "full":
        forms = {
            "before": {"_materialized": lambda table: table, "swiglu": layer_dtype_swiglu},
            "rope only": {"swiglu": layer_dtype_swiglu},
            "now": {},
        }
        call_args = (params, ids)
        build = lambda: jax.jit(lambda p, i: nnx.merge(graphdef, p)(i, i)).lower(*call_args).compile()
    else:
        _, cache_k, cache_v = jax.jit(lambda p, i: nnx.merge(graphdef, p).prefill(i))(params, ids)
        start, w, m = 64, args.width, args.windows
        tokens = jnp.ones((1, m, w), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(start, start + w), (1, m, w))
        cache_mask = ((jnp.arange(args.length) < start) | (jnp.arange(args.length) >= start + w))[None]
        call_args = (params, tokens, positions, cache_k, cache_v, cache_mask, jnp.ones((1, w), bool))
        forms = {"before": {"cached_attention": T.cached_attention_grouped}, "now": {}}
        build = lambda: (
            jax.jit(lambda p, *a: nnx.merge(graphdef, p).window(*a, out_length=w)).lower(*call_args).compile()
        )
    times = alternate(compiled_forms(forms, build), call_args, args.calls)
    what = f"{args.what} {args.dtype}, {args.layers} layers d_model {args.d_model}, N {args.length}"
    if args.what == "window":
        what += f", {args.windows} x {args.width}-position windows"
    print(what)
    for label, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(times["before"], ts))
        print(f"  {label:10s} median {1e3 * statistics.median(ts):7.1f} ms   before / this {ratio:.3f}")


if __name__ == "__main__":
    main()
