"""FLOPs per token of LLaDA2.0-mini's routed-expert compute against the active-parameter ideal.
Abstract arrays only (``jax.ShapeDtypeStruct``): no weight is materialised, so it runs on a laptop CPU.

    python -m scripts.figures.moe_cost [--config DIR] [--shapes 1x32,8x32,1x512,1x4096] [--dtype float32]

Rows, per token shape B x L (tokens T = B * L), for one MoE layer against the ideal
2 x k x 3 x d x F_expert:
- off TPU, ``models.moe.expert_slots``: every expert on ``slot_rows`` rows per slot, as many slots
  as the largest group needs (one slot per ``slot_rows`` rows of it). Counted from the shapes at a
  balanced routing (every expert T k / E rows), because XLA counts a loop's body once whatever its
  trip count;
- ``models.moe.routed_experts`` with ``jax.lax.ragged_dot`` as the grouped product (TPU's path; off
  TPU it lowers to a dense product of every row with every expert), XLA's count.

Its figures are in docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from models import config_from_dict
from models.moe import ragged_matmul, routed_experts, slot_rows
from models.transformer import swiglu

MINI = Path(__file__).resolve().parents[3] / "shared" / "hf-configs" / "LLaDA2.0-mini"
DTYPE = jnp.float32  # set by --dtype


def flops(fn, *args) -> float:
    return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


def ragged_flops(cfg, tokens: int) -> float:
    """XLA's FLOPs of one MoE layer's routed experts with ``ragged_matmul`` as the grouped product."""
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
    return flops(lambda *a: routed_experts(*a, swiglu, grouped=ragged_matmul), *args)


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
    print(
        f"LLaDA2.0 config {args.config}: {cfg.param_count():,} parameters, {cfg.active_param_count():,} active, "
        f"{args.dtype}, jax {jax.__version__} on {jax.default_backend()}"
    )
    print("| B x L | slot rows | slots | experts / token | ideal | ratio | with ragged_dot (XLA) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        tokens = batch * length
        rows = slot_rows(tokens * k, cfg.n_experts, tokens)
        group = math.ceil(tokens * k / cfg.n_experts)  # each expert's rows at a balanced routing
        slots = math.ceil(group / rows)
        ours = slots * 2 * cfg.n_experts * rows * 3 * d * F / tokens
        ragged = ragged_flops(cfg, tokens) / tokens
        print(
            f"| {batch} x {length} | {rows} | {slots} | {ours / 1e6:.1f} M | {ideal_experts / 1e6:.1f} M | "
            f"{ours / ideal_experts:.2f} | {ragged / 1e6:.0f} M | {ragged / ideal_experts:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
