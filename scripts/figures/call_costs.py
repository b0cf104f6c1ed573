"""Predicted seconds (model calls by shape x each shape's measured cost) against measured seconds,
for every setting of the benchmark's matrix on this device (docs/cost-model.md "Seconds from calls").

For each setting: the problems are decoded in batches as the benchmark does (warm executables,
``block_until_ready``), which gives the measured seconds and the calls by shape; then each call
shape those decodes used is compiled alone and timed warm (``psd_jax.costs.measure_call_costs``,
median of repeats), and the prediction is the sum over calls of count x cost.

    python -m scripts.figures.call_costs [--limit 100] [--batch 50] [--decoders a/none,b/dual,...] [--out runs/costs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from psd_jax import load_model
from psd_jax.cli.bench import BASELINE, decoder_matrix
from psd_jax.core.lengths import padded_length
from psd_jax.costs import call_timers, predicted_seconds, record_key
from psd_jax.model_dir import model_settings
from psd_jax.scoring import load_jsonl

DEFAULT_DECODERS = [
    BASELINE,
    "fixed-1/prefix",
    "fixed-1/dual",
    "fixed-2/none",
    "threshold-0.9/none",
    "threshold-0.9/dual",
    "threshold-0.7/dual",
    "psd-fixed-1-d3/none",
    "psd-fixed-1-d3/dual",
    "psd-threshold-0.9-d3/dual",
    "psd-threshold-0.9-d7/none",
    "rps-threshold-0.9/dual",
    "rps-threshold-0.9/none",
]


def run(lm, name: str, settings, examples: list[dict], batch: int, bucket: int, repeats: int) -> dict:
    """Measured seconds of the setting over the problems, its calls, and the prediction from them.
    Everything is compiled and run once first; then in each of ``repeats`` rounds every batch is
    decoded once and every call shape it used is run once, so that a slow moment of the machine (its
    timings vary by a tenth from run to run) weighs on both sides alike; medians are kept."""
    batches = [[ex["question"] for ex in examples[i : i + batch]] for i in range(0, len(examples), batch)]
    calls, iterations, timers = [], 0, {}
    for chunk in batches:
        first = lm.generate(chunk, settings, chat=True, prompt_bucket=bucket, warm=True)[0]
        calls += first.calls
        iterations += first.iterations
        prompt = padded_length(max(len(ids) for ids in lm.prompt_ids(chunk, True)), bucket)
        if not all(record_key(c) in timers for c in first.calls):
            timers.update(call_timers(lm, settings, prompt, len(chunk)))
    decodes: list[list[float]] = [[] for _ in batches]
    costs: dict[str, list[float]] = {key: [] for key in timers}
    for _ in range(repeats):
        for times, chunk in zip(decodes, batches):
            times.append(lm.generate(chunk, settings, chat=True, prompt_bucket=bucket)[0].seconds)
        for key, timer in timers.items():
            costs[key].append(timer())
    measured = sum(statistics.median(times) for times in decodes)
    cost = {key: statistics.median(seconds) for key, seconds in costs.items()}
    predicted = predicted_seconds(calls, cost)
    made = sum(c["count"] for c in calls)
    return {
        "name": name,
        "measured_seconds": measured,
        "predicted_seconds": predicted,
        "ratio": predicted / measured,
        "iterations": iterations,
        "calls": made,
        "costs": cost,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the shipped model)")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--prompt-bucket", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of decodes and calls (medians count)")
    parser.add_argument("--decoders", help="comma-separated bench names with their cache")
    parser.add_argument("--out", default="runs/call_costs")
    args = parser.parse_args(argv)
    lm = load_model(args.model)
    base = model_settings(lm.path, {"cache": "none"})
    names = args.decoders.split(",") if args.decoders else DEFAULT_DECODERS
    try:
        matrix = decoder_matrix(base, names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    examples = load_jsonl(lm.path / "test.jsonl")[: args.limit]
    rows = []
    for name, settings in matrix.items():
        began = time.perf_counter()
        rows.append(run(lm, name, settings, examples, args.batch, args.prompt_bucket, args.repeats))
        row = rows[-1]
        print(
            f"{name:28s} measured {row['measured_seconds']:7.3f} s  predicted {row['predicted_seconds']:7.3f} s  "
            f"ratio {row['ratio']:.3f}  ({time.perf_counter() - began:.0f} s)",
            file=sys.stderr,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": str(lm.path),
        "n": len(examples),
        "batch": args.batch,
        "repeats": args.repeats,
        "time": time.strftime("%Y-%m-%d %H:%M"),
    }
    (out / "call_costs.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    lines = [
        "| setting | calls | iterations | measured s | predicted s | predicted / measured |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['name']} | {r['calls']} | {r['iterations']} | {r['measured_seconds']:.3f} | "
        f"{r['predicted_seconds']:.3f} | {r['ratio']:.3f} |"
        for r in rows
    ]
    (out / "call_costs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
