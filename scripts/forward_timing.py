"""One forward of the same random LLaDA-shaped model in JAX (jitted ``DiffusionLM``) and in PyTorch
(``TorchDiffusionLM``, ``inference_mode``): median wall time of 15 calls after a warm-up.

Separates the frameworks' forward passes from everything the decoders add (README, "XLA against
PyTorch"). XLA's thread count is fixed when its CPU client starts, so run one process per setting:

    python scripts/forward_timing.py --backend jax [--batch 1 --length 64] [--scan-layers]
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
        python scripts/forward_timing.py --backend jax
    python scripts/forward_timing.py --backend torch --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_backends import random_llada_config  # noqa: E402  (the comparison's model shape)
from models import ModelConfig  # noqa: E402

REPEATS = 15


def median_ms(call) -> float:
    call()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_jax(cfg: ModelConfig, batch: int, length: int, unroll_layers: bool) -> float:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import DiffusionLM

    graphdef, params = nnx.split(DiffusionLM(cfg, rngs=nnx.Rngs(0), unroll_layers=unroll_layers))
    forward = jax.jit(lambda p, ids, mask: nnx.merge(graphdef, p)(ids, mask))
    ids = jnp.ones((batch, length), jnp.int32)
    return median_ms(lambda: forward(params, ids, ids).block_until_ready())


def time_torch(cfg: ModelConfig, batch: int, length: int, threads: int | None) -> float:
    import torch

    from psd_jax.torch_backend.model import TorchDiffusionLM

    if threads:
        torch.set_num_threads(threads)
    model = TorchDiffusionLM(cfg).to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ids = torch.ones((batch, length), dtype=torch.long)
    with torch.inference_mode():
        return median_ms(lambda: model(ids, ids))


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
    p.add_argument("--scan-layers", action="store_true",
                   help="jax: lax.scan over stacked layer weights (default: unrolled, load_model's CPU layout)")
    args = p.parse_args()
    cfg = random_llada_config(args)
    if args.backend == "jax":
        ms = time_jax(cfg, args.batch, args.length, unroll_layers=not args.scan_layers)
    else:
        ms = time_torch(cfg, args.batch, args.length, args.threads)
    layout = "" if args.backend == "torch" else (" (scan)" if args.scan_layers else " (unrolled)")
    print(f"{args.backend}{layout}: batch {args.batch} x {args.length} tokens, {cfg.param_count():,} parameters: "
          f"median {ms:.1f} ms per forward")


if __name__ == "__main__":
    main()
