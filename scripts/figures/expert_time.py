"""Seconds of the routed-expert product off TPU (``models.moe.routed_experts``), one jitted call of
``--layers`` expert layers on random weights and a random routing, median of ``--runs`` calls after
a warm-up:

    python -m scripts.figures.expert_time [--experts 16] [--top-k 2] [--d 512] [--hidden 256]
        [--layers 8] [--tokens 32,128] [--rows default,8,32] [--runs 15]

``--rows`` picks the slot size of ``models.moe.expert_slots`` (``default``: the library's own,
``slot_rows``'s).
Figures: docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.moe import interleave_gate_up, routed_experts, slot_rows
from models.transformer import swiglu


def expert_layers(chosen: jax.Array, weights: jax.Array, rows: int | None):
    """A jitted stack of expert layers, each adding its routed experts' output to the rows."""

    @jax.jit
    def layers(x, gate_up, down):
        for g, w in zip(gate_up, down):
            x = x + 0.01 * routed_experts(x, chosen, weights, g, None, w, swiglu, rows)
        return x

    return layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", default="32,128")
    parser.add_argument("--rows", default="default,8,32")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)
    E, k, d, F = args.experts, args.top_k, args.d, args.hidden
    rng = np.random.default_rng(0)
    gate_up = [
        jnp.asarray(interleave_gate_up(*(0.05 * rng.normal(size=(2, E, d, F))).astype(np.float32)))
        for _ in range(args.layers)
    ]
    down = [jnp.asarray(0.05 * rng.normal(size=(E, F, d)).astype(np.float32)) for _ in range(args.layers)]
    print(f"{E} experts top {k}, d {d}, hidden {F}, {args.layers} layers, float32, jax {jax.__version__}")
    print("| tokens | slot rows | ms per call (median) |")
    print("|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        x = jnp.asarray(rng.normal(size=(tokens, d)).astype(np.float32))
        chosen = jnp.asarray(np.argsort(-rng.normal(size=(tokens, E)), axis=1)[:, :k].astype(np.int32))
        weights = jnp.asarray(rng.random((tokens, k)).astype(np.float32))
        for choice in args.rows.split(","):
            default = choice == "default"
            rows = slot_rows(tokens * k, E, tokens) if default else int(choice)
            layers = expert_layers(chosen, weights, None if default else rows)
            jax.block_until_ready(layers(x, gate_up, down))
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                jax.block_until_ready(layers(x, gate_up, down))
                times.append(time.perf_counter() - start)
            print(f"| {tokens} | {rows}{' (default)' if default else ''} | {1e3 * statistics.median(times):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
