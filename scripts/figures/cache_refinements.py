"""The dual cache's window past the block (``vicinity``) and refreshes within a block
(``refresh_every``) against the plain caches, on the shipped model: the table of
docs/benchmark.md "The dual cache's window past the block".

Every setting decodes the same problems in the same batches, interleaved with the upstream
baseline (``fixed-1/none``) as the benchmark does (``psd_jax.cli.bench.run_matrix``); the columns are
the benchmark's (tokens/s and its ratio to the baseline, the paired accuracy difference).

    python -m scripts.figures.cache_refinements --data dev.jsonl --limit 700 --out /tmp/cache-refinements
"""

from __future__ import annotations

import argparse
from pathlib import Path

from psd_jax.api import load_model
from psd_jax.cli.bench import BASELINE, markdown_table, run_matrix
from psd_jax.core.config import DecodeConfig, cache_fields
from psd_jax.model_dir import model_directory, model_settings
from psd_jax.scoring import load_jsonl

# (policy fields, cache names): the threshold the shipped model is tuned to, a faster one, and one
# token per step, whose blocks take the most window calls.
SETTINGS = (
    (
        "threshold-0.98",
        {"policy": "threshold", "threshold": 0.98},
        ("none", "prefix", "dual", "dual+v1", "dual+v2", "dual+v4", "dual+v8", "dual+v16", "dual+r2", "dual+r3"),
    ),
    ("threshold-0.95", {"policy": "threshold", "threshold": 0.95}, ("dual", "dual+v4", "dual+v8")),
    ("fixed-1", {"policy": "fixed"}, ("dual", "dual+v4", "dual+r4")),
)


def matrix(base: DecodeConfig) -> dict[str, DecodeConfig]:
    """The baseline first, then every setting of ``SETTINGS`` on ``base``'s lengths."""
    out = {BASELINE: base}
    for name, fields, caches in SETTINGS:
        for cache in caches:
            out[f"{name}/{cache}"] = base.replace(**fields, **cache_fields(cache))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the shipped one)")
    p.add_argument("--data", required=True, help="jsonl with question/answer fields")
    p.add_argument("--limit", type=int, default=700, help="the last N problems of --data")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("/tmp/cache-refinements"))
    args = p.parse_args(argv)
    model_dir = model_directory(args.model)
    base = model_settings(model_dir, {})
    examples = load_jsonl(args.data)[-args.limit :]
    lm = load_model(model_dir)
    bench_args = argparse.Namespace(batch=args.batch, chat=None, prompt_bucket=32, latency=0)
    table = markdown_table(run_matrix(lm, matrix(base), examples, bench_args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_refinements.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
