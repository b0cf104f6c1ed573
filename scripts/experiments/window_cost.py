"""Answers: where does a dual-cache window forward's time go on the larger random model?

Batch 1, the random model of ``scripts/bench_cache.py`` (the block KV cache measurement of
docs/benchmark.md).

Times, jitted, median of ``--repeats``: the full forward of the 544-token canvas (``prefill``),
a 32-token ``window`` against its cache, and the window's matrix products alone, once inside a
``lax.scan`` over the stacked ``[L, ...]`` weights (as the model runs them) and once over
per-layer arrays (the difference is the scan's per-layer weight slicing).

    python -m scripts.experiments.window_cost
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scripts.bench_cache import random_model

PRODUCTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def median_ms(f, *args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def layer_products(x, w):
    """A layer's matrix products (no attention, no norms): what dominates a short window."""
    x = x + (x @ w["wq"] + x @ w["wk"] + x @ w["wv"]) @ w["wo"]
    return x + (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--gen-length", type=int, default=512)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    n, w_len = args.prompt_length + args.gen_length, args.window
    model = random_model(4, 512, 8, 4096, 30.0, n).model
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 4000, (1, n)), jnp.int32)
    mask = jnp.ones((1, n), bool)
    full = jax.jit(lambda params, t, m: nnx.merge(graphdef, params).prefill(t, m, logits_from=args.prompt_length))
    window = jax.jit(lambda params, *a: nnx.merge(graphdef, params).window(*a, w_len))
    _, keys, values = full(params, tokens, mask)
    at = n // 2
    window_args = (
        tokens[:, None, at : at + w_len],
        jnp.arange(at, at + w_len)[None, None],
        keys,
        values,
        mask.at[:, at : at + w_len].set(False),
        jnp.ones((1, w_len), bool),
    )
    stacked = {name: model.layer_weights()[name] for name in PRODUCTS}
    per_layer = [{name: jnp.array(a[i]) for name, a in stacked.items()} for i in range(model.config.n_layers)]
    head = model.head_weight()
    scanned = jax.jit(lambda w, h, x: jax.lax.scan(lambda x, lw: (layer_products(x, lw), None), x, w)[0] @ h)

    def unstacked(ws, h, x):
        for lw in ws:
            x = layer_products(x, lw)
        return x @ h

    unstacked = jax.jit(unstacked)
    r = args.repeats
    print(f"full forward, {n} tokens: {median_ms(full, params, tokens, mask, repeats=max(3, r // 4)):.1f} ms")
    print(f"window, {w_len} tokens: {median_ms(window, params, *window_args, repeats=r):.1f} ms")
    for rows in (w_len, n):
        x = jnp.full((1, rows, 512), 0.01)
        print(
            f"matrix products, {rows} rows: scan over stacked weights {median_ms(scanned, stacked, head, x, repeats=r):.1f} ms, "
            f"per-layer weights {median_ms(unstacked, per_layer, head, x, repeats=r):.1f} ms"
        )


if __name__ == "__main__":
    main()
