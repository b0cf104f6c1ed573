"""The two XLA:CPU forms of the cache attention inside a whole cache-window call, timed in one process.

``models.cpu_kernels.cached_attention_per_head`` joins each head's cached keys with the window's own
([cached ; window], one score and one value product per head) when a row has at most
``JOINED_WINDOWS_MAX`` windows, and keeps them apart otherwise (a product each, the cache shared by
the windows uncopied). This compiles the model's ``window`` call once with each form forced
(``join=True`` / ``join=False``) and calls the two alternately, so the machine's drift falls on both;
it reports each form's median, the median of the per-pair ratios and how far apart the two forms'
logits are (float32 summation order only), for the window shapes the
decoders make: one window of a block (the dual cache's plain calls), PSD's D + 1 = 4 and RPS's
k_max + 1 = 11 windows of a block, and the prefix cache's long window.

    python -m scripts.figures.cpu_cache_attention [--dtype bfloat16|float32] [--calls 25]

The model is the random LLaDA-shaped one of ``scripts.figures.compare_backends`` (8 layers,
d_model 1024, 108M parameters, fresh random weights: timing does not depend on their values), the
cache 288 positions (a 32-token prompt and 256 generated). Its figures are in docs/xla-vs-pytorch.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import DiffusionLM, cpu_kernels
from psd_jax.cli.flags import positive_int
from scripts.figures.compare_backends import add_random_model_flags, random_llada_config

CACHE = 288
SHAPES = {  # name: (windows per row M, window width W)
    "block window (dual cache)": (1, 32),
    "PSD's 4 windows": (4, 32),
    "RPS's 11 windows": (11, 32),
    "prefix-cache window": (1, 256),
}


def window_args(model: DiffusionLM, m: int, w: int) -> tuple:
    """Inputs of one ``window`` call of m windows of width w at positions 32.. over a full cache."""
    cfg, rng = model.config, np.random.default_rng(0)
    cache_shape = (cfg.n_layers, 1, CACHE, cfg.n_kv_heads, cfg.head_dim)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, m, w)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(32, 32 + w, dtype=jnp.int32), (1, m, w))
    cache_k, cache_v = (jnp.asarray(rng.standard_normal(cache_shape), model.dtype) for _ in range(2))
    cache_mask = jnp.ones((1, CACHE), bool).at[:, 32 : 32 + w].set(False)  # the window's own positions
    return tokens, positions, cache_k, cache_v, cache_mask, jnp.ones((1, w), bool)


def compiled(graphdef, params, args: tuple, join: bool):
    """The window call compiled with the cache attention's ``join`` forced."""
    forced = cpu_kernels.cached_attention_per_head
    cpu_kernels.cached_attention_per_head = lambda *a: forced(*a, join=join)
    try:
        width = args[0].shape[2]
        call = lambda p, *a: nnx.merge(graphdef, p).window(*a, width)  # a fresh function: a fresh trace
        return jax.jit(call).lower(params, *args).compile()
    finally:
        cpu_kernels.cached_attention_per_head = forced


def measure(graphdef, params, args: tuple, calls: int) -> dict:
    forms = {"joined": compiled(graphdef, params, args, True), "apart": compiled(graphdef, params, args, False)}
    times = {name: [] for name in forms}
    joined, apart = (np.asarray(f(params, *args), np.float32) for f in forms.values())
    for _ in range(calls):
        for name, f in forms.items():
            began = time.perf_counter()
            jax.block_until_ready(f(params, *args))
            times[name].append(time.perf_counter() - began)
    ratio = statistics.median(a / j for a, j in zip(times["apart"], times["joined"]))
    medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
    return {**medians, "apart / joined": ratio, "max |logit difference|": float(np.abs(joined - apart).max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.figures.cpu_cache_attention", description=__doc__)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--calls", type=positive_int, default=25, help="timed calls of each form per shape")
    add_random_model_flags(p)
    args = p.parse_args(argv)
    model = DiffusionLM(random_llada_config(args), dtype=jnp.dtype(args.dtype), unroll_layers=True)
    graphdef, params = nnx.split(model)
    print(f"| window call ({args.dtype}) | M x W | joined ms | apart ms | apart / joined | max logit difference |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (m, w) in SHAPES.items():
        r = measure(graphdef, params, window_args(model, m, w), args.calls)
        cells = f"{r['joined']:.2f} | {r['apart']:.2f} | {r['apart / joined']:.3f}x | {r['max |logit difference|']:.2g}"
        print(f"| {name} | {m} x {w} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
