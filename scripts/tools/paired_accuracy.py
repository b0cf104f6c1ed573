"""Accuracy change between two benchmark runs on the same problems, with its paired error.

Two runs of ``python -m psd_jax.bench`` (e.g. ``--cache none`` against ``--cache dual``, or two
models) over the same jsonl record which problems each setting got right; this prints, for every
setting both ran, the accuracy difference B − A, the standard error of that paired difference and
the problems only A or only B answered:

    python -m scripts.tools.paired_accuracy runs/none/bench.json runs/dual/bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from psd_jax.cli.bench import paired_difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="bench.json of run A")
    parser.add_argument("b", type=Path, help="bench.json of run B")
    args = parser.parse_args()
    runs = [json.loads(path.read_text()) for path in (args.a, args.b)]
    (a_meta, b_meta) = (run["meta"] for run in runs)
    if a_meta["n"] != b_meta["n"]:
        sys.exit(
            f"error: the runs scored different problem counts: {a_meta['data']} ({a_meta['n']}) "
            f"and {b_meta['data']} ({b_meta['n']})"
        )
    if Path(a_meta["data"]).name != Path(b_meta["data"]).name:
        print(f"warning: different data files {a_meta['data']} and {b_meta['data']}: is problem i the same in both?")
    a_rows, b_rows = ({r["name"]: r for r in run["results"]} for run in runs)
    for path, rows in zip((args.a, args.b), (a_rows, b_rows)):
        if any("correct_by_problem" not in r for r in rows.values()):
            sys.exit(f"error: {path} has no per-problem records (written before they existed); rerun that benchmark")
    print(f"A: {args.a}\nB: {args.b}\n")
    print("| decoder | A | B | B − A | paired s.e. | only A right | only B right |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in (n for n in a_rows if n in b_rows):
        p = paired_difference(a_rows[name]["correct_by_problem"], b_rows[name]["correct_by_problem"])
        print(
            f"| {name} | {100 * p['accuracy_a']:.1f}% | {100 * p['accuracy_b']:.1f}% | "
            f"{100 * p['difference']:+.1f} | {100 * p['standard_error']:.1f} | {p['only_a']} | {p['only_b']} |"
        )


if __name__ == "__main__":
    main()
