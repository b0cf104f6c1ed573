"""Answers: how fast is one forward in JAX against PyTorch, apart from the decoders?

One forward of the same random LLaDA-shaped model in JAX (jitted ``DiffusionLM``) and in PyTorch
(``TorchDiffusionLM``, ``inference_mode``): median wall time of 15 calls after a warm-up, the
process's CPU time per call (how many cores it kept busy), and the forward's matmul rate.

Separates the frameworks' forward passes from everything the decoders add (docs/xla-vs-pytorch.md).
``--matmuls-only`` times just the forward's matrix products (every projection, MLP and head weight
of the model, each a [rows, d_in] x [d_in, d_out] product on fresh inputs, one call): the floor that
the backend's GEMM sets on its forward. One process per setting; pin to one core with ``taskset``
(XLA's ``--xla_cpu_multi_thread_eigen=false`` still keeps two cores busy, so it is not a one-core
measurement):

    python -m scripts.experiments.forward_timing --backend jax|torch [--batch 1 --length 64] [--scan-layers]
    python -m scripts.experiments.forward_timing --backend jax|torch --matmuls-only
    taskset -c 0 python -m scripts.experiments.forward_timing --backend jax|torch
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from models import ModelConfig
from models.transformer import param_shapes
from scripts.compare_backends import random_llada_config  # the comparison's model shape

REPEATS = 15


def time_call(call) -> tuple[float, float]:
    """(median wall ms, mean process CPU ms) per call, after one warm-up call."""
    call()
    times = []
    cpu_start = os.times()
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    cpu_end = os.times()
    cpu = (cpu_end.user + cpu_end.system - cpu_start.user - cpu_start.system) / REPEATS
    return 1e3 * statistics.median(times), 1e3 * cpu


def matmul_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(d_in, d_out) of every weight matrix one forward multiplies by: per layer the attention
    projections and the MLP, then the LM head (the embedding is a gather, not a product)."""
    shapes = param_shapes(cfg)
    per_layer = [shapes[name][1:] for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    return per_layer * cfg.n_layers + [(cfg.d_model, cfg.vocab_size)]


def forward_flops(cfg: ModelConfig, rows: int) -> float:
    """Multiply-adds x 2 of one forward's matrix products (attention scores excluded: under 2% here)."""
    return 2.0 * rows * sum(d_in * d_out for d_in, d_out in matmul_shapes(cfg))


def time_jax(cfg: ModelConfig, batch: int, length: int, unroll_layers: bool, matmuls_only: bool, dtype: str):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import DiffusionLM
    from models.transformer import matmul

    if matmuls_only:
        shapes = matmul_shapes(cfg)
        w_keys, x_keys = jnp.split(jax.random.split(jax.random.key(0), 2 * len(shapes)), 2)
        weights = [(0.02 * jax.random.normal(k, s)).astype(dtype) for k, s in zip(w_keys, shapes)]
        inputs = [jax.random.normal(k, (batch * length, s[0])).astype(dtype) for k, s in zip(x_keys, shapes)]
        # The head's product is a float32-out einsum in the model; the layers' go through ``matmul``.
        products = jax.jit(lambda xs, ws: [matmul(x, w) for x, w in zip(xs, ws)])
        return time_call(lambda: jax.block_until_ready(products(inputs, weights)))
    model = DiffusionLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0), unroll_layers=unroll_layers)
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, ids, mask: nnx.merge(graphdef, p)(ids, mask))
    ids = jnp.ones((batch, length), jnp.int32)
    return time_call(lambda: forward(params, ids, ids).block_until_ready())


def time_torch(cfg: ModelConfig, batch: int, length: int, threads: int | None, matmuls_only: bool, dtype: str):
    import torch

    from psd_jax.torch_backend.model import TorchDiffusionLM

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    if matmuls_only:
        shapes = matmul_shapes(cfg)
        weights = [(0.02 * torch.randn(s)).to(torch_dtype) for s in shapes]
        inputs = [torch.randn(batch * length, s[0]).to(torch_dtype) for s in shapes]
        with torch.inference_mode():
            return time_call(lambda: [x @ w for x, w in zip(inputs, weights)])
    model = TorchDiffusionLM(cfg, torch_dtype).to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ids = torch.ones((batch, length), dtype=torch.long)
    with torch.inference_mode():
        return time_call(lambda: model(ids, ids))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["jax", "torch"], required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, help="default: --heads")
    p.add_argument("--mlp", type=int, help="MLP hidden size (default: 8/3 d_model, rounded to 64)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (torch only)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations (logits and softmax stay float32 in both backends)",
    )
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="jax: lax.scan over stacked layer weights (default: unrolled, load_model's CPU layout)",
    )
    p.add_argument(
        "--matmuls-only",
        action="store_true",
        help="time only the forward's matrix products (same shapes and FLOPs), not the model",
    )
    args = p.parse_args()
    cfg = random_llada_config(args)
    if args.backend == "jax":
        ms, cpu_ms = time_jax(cfg, args.batch, args.length, not args.scan_layers, args.matmuls_only, args.dtype)
    else:
        ms, cpu_ms = time_torch(cfg, args.batch, args.length, args.threads, args.matmuls_only, args.dtype)
    what = (
        "matmuls only" if args.matmuls_only else ("scan" if args.scan_layers and args.backend == "jax" else "forward")
    )
    gflops = forward_flops(cfg, args.batch * args.length) / ms / 1e6
    print(
        f"{args.backend} ({what}, {args.dtype}): batch {args.batch} x {args.length} tokens, {cfg.param_count():,} parameters: "
        f"median {ms:.1f} ms per call, {cpu_ms / ms:.2f} cores busy, {gflops:.0f} GFLOP/s of matmul work"
    )


if __name__ == "__main__":
    main()
