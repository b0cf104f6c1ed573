"""FLOPs per token of LLaDA2.0-mini's expert compute and forward, from XLA's cost analysis, against
the active-parameter ideal. Abstract arrays only (``jax.ShapeDtypeStruct``, ``nnx.eval_shape``): no
weight is materialised, so it runs on a laptop CPU.

    python -m scripts.figures.moe_cost [--config DIR] [--shapes 1x32,8x32,1x512,1x4096] [--dtype float32]

Rows, per token shape B x L (tokens T = B * L):
- routed experts of one MoE layer (``models.moe.routed_experts``) with ``grouped_matmul`` and with
  ``jax.lax.ragged_dot`` in its place, against 2 x k x 3 x d x F_expert;
- the whole bidirectional forward (logits at every position), against 2 x (active parameters -
  embedding) + attention (4 x L x H x hd per layer). XLA counts a ``lax.scan`` body once, so the
  forward is measured unrolled with one and with two MoE layers, and the difference is the MoE layer.

XLA counts elementwise ops as FLOPs too; in bfloat16 on CPU that includes converting the gathered
expert weights to float32 for the batched product (+0.5 of the ideal at tile 1), so float32 (the
default) shows the products' work alone.

Its figures are in docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from models import LLaDA2MoE, config_from_dict
from models.moe import routed_experts, tile_size
from models.transformer import swiglu

MINI = Path(__file__).resolve().parents[3] / "shared" / "hf-configs" / "LLaDA2.0-mini"
DTYPE = jnp.float32  # set by --dtype


def flops(fn, *args) -> float:
    return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


def expert_flops(cfg, tokens: int, grouped=None) -> float:
    d, E, F, k = cfg.d_model, cfg.n_experts, cfg.moe_hidden, cfg.n_experts_per_tok
    s = jax.ShapeDtypeStruct
    args = (
        s((tokens, d), DTYPE),
        s((tokens, k), jnp.int32),
        s((tokens, k), jnp.float32),
        s((E, d, F), DTYPE),
        s((E, d, F), DTYPE),
        s((E, F, d), DTYPE),
    )
    return flops(lambda *a: routed_experts(*a, swiglu, grouped=grouped), *args)


def forward_flops(cfg, batch: int, length: int, n_moe: int) -> float:
    small = dataclasses.replace(cfg, n_layers=cfg.n_dense_layers + n_moe)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaDA2MoE(small, dtype=DTYPE, unroll_layers=True)))
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    return flops(lambda st, i: nnx.merge(graphdef, st)(i), state, ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(MINI), help="directory with a llada2_moe config.json")
    parser.add_argument("--shapes", default="1x32,8x32,1x512,1x4096", help="B x L token shapes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    global DTYPE
    DTYPE = jnp.dtype(args.dtype)
    raw = json.loads((Path(args.config) / "config.json").read_text())
    cfg = config_from_dict(raw, args.config, {"mask_token_id": 0, "eos_token_id": 0})  # ids do not matter here
    d, k, F = cfg.d_model, cfg.n_experts_per_tok, cfg.moe_hidden
    ideal_experts = 2 * k * 3 * d * F
    dense_params = cfg.active_param_count() - cfg.vocab_size * d  # the embedding lookup is no FLOPs
    print(
        f"LLaDA2.0 config {args.config}: {cfg.param_count():,} parameters, {cfg.active_param_count():,} active, "
        f"{args.dtype}, jax {jax.__version__} on {jax.default_backend()}"
    )
    print(
        "| B x L | tile | routed experts / token (XLA) | ideal | ratio | with ragged_dot | ratio "
        "| forward / token (XLA) | ideal | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        tokens = batch * length
        ours = expert_flops(cfg, tokens) / tokens
        ragged = expert_flops(cfg, tokens, grouped=jax.lax.ragged_dot) / tokens
        one, two = forward_flops(cfg, batch, length, 1), forward_flops(cfg, batch, length, 2)
        forward = (one + (cfg.n_moe_layers - 1) * (two - one)) / tokens
        attention = 4 * length * cfg.n_heads * cfg.head_dim * cfg.n_layers
        ideal_forward = 2 * dense_params + attention
        print(
            f"| {batch} x {length} | {tile_size(tokens * k, cfg.n_experts)} | {ours / 1e6:.1f} M | "
            f"{ideal_experts / 1e6:.1f} M | {ours / ideal_experts:.2f} | {ragged / 1e6:.0f} M | "
            f"{ragged / ideal_experts:.1f} | {forward / 1e9:.3f} G | {ideal_forward / 1e9:.3f} G | "
            f"{forward / ideal_forward:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
