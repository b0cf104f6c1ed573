"""Answers: which GEMM kernel does each XLA:CPU route run, and how fast against torch's?

Why: on CPU both backends spend ~90% of a decode in the layers' products (docs/xla-vs-pytorch.md),
so the JAX/torch ratio there is the ratio of the two GEMM libraries. This times the products of the
comparison's 8-layer d_model-1024 model, 16 distinct [1024, 2688] weights times [M, 1024] inputs
(M = 32, 128, 288: a cache window, a few rows, one full 288-token forward), in bfloat16 and
float32, once per route:

- ``jax``: XLA's default (YNNPACK dot fusions);
- ``jax-onednn``: YNNPACK off and XLA's oneDNN dot fusion on
  (``--xla_cpu_experimental_ynn_fusion_type=invalid --xla_cpu_use_onednn=true
  --xla_cpu_experimental_onednn_fusion_type=dot``); with YNNPACK on, the oneDNN flags change nothing;
- ``jax-eigen``: YNNPACK off (Eigen's contraction, which calls oneDNN's sgemm on blocks);
- ``torch``: ``x @ w`` under ``torch.inference_mode``.

Each route runs in its own process (XLA flags are per process) with ``ONEDNN_VERBOSE=1``, so the
report also names the oneDNN kernels that ran (``none``: no oneDNN call, e.g. YNNPACK's own), e.g.
torch's AMX brgemm against XLA's float32 ones. Rounds alternate the routes, because this machine's
speed drifts between minutes; the table gives each cell's median over rounds.

    python -m scripts.experiments.cpu_gemm_routes [--rounds 2]    # from the repository root
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIZES = (32, 128, 288)
ROUTES = {
    "jax": "",
    "jax-onednn": "--xla_cpu_experimental_ynn_fusion_type=invalid --xla_cpu_use_onednn=true "
    "--xla_cpu_experimental_onednn_fusion_type=dot",
    "jax-eigen": "--xla_cpu_experimental_ynn_fusion_type=invalid",
    "torch": None,
}


def worker(route: str, dtype: str) -> None:
    """Print one line per M: ``M ms_per_product`` (median of ``forward_timing.time_call``'s calls)."""
    import numpy as np

    from scripts.experiments.forward_timing import time_call

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((1024, 2688)).astype(np.float32) * 0.03 for _ in range(16)]
    inputs = {m: rng.standard_normal((m, 1024)).astype(np.float32) for m in SIZES}
    if route == "torch":
        import torch

        dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        ws = [torch.tensor(w, dtype=dt) for w in weights]
        with torch.inference_mode():
            for m in SIZES:
                x = torch.tensor(inputs[m], dtype=dt)
                print(m, time_call(lambda: [x @ w for w in ws])[0] / 16, flush=True)  # noqa: B023 (called at once)
        return
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    ws = [jnp.asarray(w, dt) for w in weights]
    # As models.transformer.matmul: a float32 result, rounded once (the bfloat16-result dot is
    # rewritten by XLA:CPU as a float32 one on upcast operands).
    products = jax.jit(lambda x, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dt) for w in ws])
    for m in SIZES:
        x = jnp.asarray(inputs[m], dt)
        print(m, time_call(lambda: jax.block_until_ready(products(x, ws)))[0] / 16, flush=True)  # noqa: B023 (called at once)


def onednn_kernels(stderr: str) -> str:
    """The distinct oneDNN kernels in ONEDNN_VERBOSE's exec lines, e.g. ``matmul brg_matmul:avx512_core_amx bf16``."""
    seen = collections.Counter()
    for line in stderr.splitlines():
        parts = line.split(",")
        if len(parts) > 8 and parts[0] == "onednn_verbose" and parts[2] == "primitive" and parts[3] == "exec":
            kind, impl, desc = parts[5], parts[6], parts[8]
            src = next((t.split(":")[1] for t in desc.split() if t.startswith("src")), "?")
            if kind == "gemm_api":  # "src_f32::blocked:ab:f0"
                src = desc.split()[0].split("::")[0].removeprefix("src_")
            seen[f"{kind} {impl or '-'} {src}".replace("  ", " ")] += 1
    return "; ".join(k for k, _ in seen.most_common(2)) or "none"


def run(route: str, dtype: str) -> tuple[dict[int, float], str]:
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    if ROUTES[route]:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {ROUTES[route]}".strip()
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.experiments.cpu_gemm_routes", "--worker", route, "--dtype", dtype],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    times = {}
    for line in proc.stdout.splitlines():
        if line.startswith("onednn_verbose"):
            continue
        m, ms = line.split()
        times[int(m)] = float(ms)
    return times, onednn_kernels(proc.stdout + proc.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.dtype)
        return 0
    cells: dict[tuple[str, str], list[dict[int, float]]] = collections.defaultdict(list)
    kernels: dict[tuple[str, str], str] = {}
    for rnd in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for route in ROUTES:
                times, kernels[dtype, route] = run(route, dtype)
                cells[dtype, route].append(times)
                print(
                    f"round {rnd + 1} {dtype} {route}: " + ", ".join(f"M={m} {t:.3f} ms" for m, t in times.items()),
                    file=sys.stderr,
                    flush=True,
                )
    print("| dtype | route | " + " | ".join(f"M = {m} ms" for m in SIZES) + " | oneDNN kernels that ran |")
    print("| --- | --- | " + " | ".join("---:" for _ in SIZES) + " | --- |")
    for (dtype, route), runs in cells.items():
        medians = [statistics.median(r[m] for r in runs) for m in SIZES]
        print(f"| {dtype} | {route} | " + " | ".join(f"{t:.2f}" for t in medians) + f" | {kernels[dtype, route]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
