"""Lowering and compile time of one jitted decode for a full-size config, weights abstract.

Why: the unrolled layer layout (the CPU default, ``models.transformer.default_unroll_layers``)
trades compile time, which grows with depth, for faster forwards; this measures the price for
the real LLaDA-8B / Dream-7B configs without any weights (``nnx.eval_shape`` and
``ShapeDtypeStruct`` only), so it runs on this repository's CPU.

    python -m scripts.figures.compile_time --model LLaDA-8B|Dream-7B --layout unrolled|scan \\
        --decoder fixed|threshold|psd|rps [--gen-length 256] [--block-length 32] [--prompt-length 64]

Its figures are in docs/memory-and-scaling.md.
"""

from __future__ import annotations

import argparse
import sys
import time

from scripts.figures.memory_table import MODELS  # the real configs in ../shared/hf-configs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="LLaDA-8B")
    p.add_argument("--layout", choices=["unrolled", "scan"], default="unrolled")
    p.add_argument("--decoder", choices=["fixed", "threshold", "psd", "rps"], default="threshold")
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import DiffusionLM, load_config
    from psd_jax.core.config import DecodeConfig
    from psd_jax.core.engine import decode
    from psd_jax.core.runtime import Program, RowValues

    cfg = load_config(MODELS[args.model])
    decoder = {
        "fixed": dict(policy="fixed"),
        "threshold": dict(policy="threshold"),
        "psd": dict(policy="threshold", decoder="psd"),
        "rps": dict(policy="threshold", decoder="rps"),
    }
    dcfg = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length, **decoder[args.decoder])
    model = nnx.eval_shape(
        lambda: DiffusionLM(cfg, dtype=jnp.dtype(args.dtype), unroll_layers=args.layout == "unrolled")
    )
    graphdef, state = nnx.split(model)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    ids = jax.ShapeDtypeStruct((1, args.prompt_length), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    start = time.perf_counter()
    lowered = decode.lower(graphdef, params, ids, ids, key, RowValues.of([dcfg]), mcfg=cfg, program=Program.of(dcfg))
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    print(
        f"{args.model} {args.layout} {args.decoder} on {jax.default_backend()}: "
        f"lower {lowered_at - start:.1f} s, compile {done - lowered_at:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
