"""Tokens/s of the block KV cache modes (none / prefix / dual) on a random LLaDA-shaped model.

Random weights (``DiffusionLM(cfg, rngs=nnx.Rngs(0))``); the LM head is scaled by ``--head-scale``
so that predictions are confident and threshold decoding commits several tokens per step, as a
trained model does. EOS early stop is off, so every run decodes all ``gen_length`` positions.
Each setting is compiled ahead of time (compile time reported separately) and timed over
``--repeats`` runs; the median is reported.

    python -m scripts.figures.bench_cache --gen-lengths 256,512 --batches 1,4 --policies fixed,threshold

Its figures are in docs/benchmark.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from models import DiffusionLM, ModelConfig
from psd_jax import DecodeConfig
from psd_jax.api import LoadedModel


def random_model(layers: int, d_model: int, heads: int, vocab: int, head_scale: float, max_length: int) -> LoadedModel:
    cfg = ModelConfig(
        family="llada",
        vocab_size=vocab,
        d_model=d_model,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        mlp_hidden=4 * d_model,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_length=max_length,
        mask_id=vocab - 1,
        eos_id=vocab - 2,
        pad_id=vocab - 2,
    )
    model = DiffusionLM(cfg, rngs=nnx.Rngs(0))
    model.lm_head[...] = model.lm_head[...] * head_scale
    return LoadedModel(model, None, Path("random"))


def settings(name: str, policy: str, cache: str, gen: int, block: int, steps_ratio: int) -> DecodeConfig:
    base = DecodeConfig(gen_length=gen, block_length=block, eos_early_stop=False, cache=cache)
    if policy == "fixed":
        base = base.replace(policy="fixed", steps=gen // steps_ratio)
    else:
        base = base.replace(policy="threshold", threshold=0.9)
    if name == "psd":
        base = base.replace(decoder="psd", depth=3)
    elif name == "rps":
        base = base.replace(decoder="rps", k_max=4)
    return base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--head-scale", type=float, default=30.0)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--gen-lengths", default="256")
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--batches", default="1")
    p.add_argument("--policies", default="fixed,threshold")
    p.add_argument("--decoders", default="plain", help="comma-separated subset of plain,psd,rps")
    p.add_argument("--caches", default="none,prefix,dual")
    p.add_argument("--steps-ratio", type=int, default=1, help="fixed policy: gen_length / steps tokens per step")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()

    gens = [int(g) for g in args.gen_lengths.split(",")]
    lm = random_model(
        args.layers, args.d_model, args.heads, args.vocab, args.head_scale, args.prompt_length + max(gens)
    )
    print(
        f"backend {jax.default_backend()}; {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}"
    )
    print("| gen | batch | decoder | policy | cache | NFE/row | s | tokens/s | vs none | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for gen in gens:
        for batch in [int(b) for b in args.batches.split(",")]:
            # Different prompt lengths per row (left padding inside one bucket).
            prompts = [rng.integers(0, args.vocab - 2, args.prompt_length - 3 * r).tolist() for r in range(batch)]
            for name in args.decoders.split(","):
                for policy in args.policies.split(","):
                    base = None
                    for cache in args.caches.split(","):
                        dcfg = settings(name, policy, cache, gen, args.block_length, args.steps_ratio)
                        # Generation.seconds is the decode's wall time, compilation excluded.
                        first = out = lm.generate(prompts, dcfg, prompt_bucket=args.prompt_length)
                        times = [first[0].seconds]
                        for _ in range(args.repeats - 1):
                            out = lm.generate(prompts, dcfg, prompt_bucket=args.prompt_length)
                            times.append(out[0].seconds)
                        median = float(np.median(times))
                        tps = batch * gen / median
                        base = tps if cache == "none" else base
                        ratio = f"{tps / base:.2f}x" if base else "-"
                        nfe = np.mean([r.nfe for r in out])
                        print(
                            f"| {gen} | {batch} | {name} | {policy} | {cache} | {nfe:.1f} | {median:.2f} | {tps:.1f} | {ratio} "
                            f"| {first[0].compile_seconds:.1f} |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
