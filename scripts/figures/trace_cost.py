"""What recording the trace (``generate(..., trace=True)``) costs: warm decode seconds with and
without it, on the shipped model's held-out questions, in one process, runs alternating.

Why: the trace is four [B, N] arrays more in the loop's state, updated at every step; this says
what that costs a decode next to the same decode without it (the tokens and calls are equal, and
checked here).

    python -m scripts.figures.trace_cost [--settings recommended,fixed-1/none,psd-fixed-1-d3/none] [--batch 50] [--runs 7]

Its figures are in docs/trace.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="recommended,fixed-1/none,psd-fixed-1-d3/none")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args(argv)

    from psd_jax import load_model
    from psd_jax.cli.generate import held_out_examples
    from psd_jax.model_dir import checked_settings
    from psd_jax.names import setting_fields

    lm = load_model()
    questions = [ex["question"] for ex in held_out_examples(lm.path, args.batch)]
    print(f"{len(questions)} questions of {lm.path}, {args.runs} alternating warm runs each, median (range)")
    print("| setting | seconds without | seconds with | with / without |")
    print("| --- | ---: | ---: | ---: |")
    for name in args.settings.split(","):
        if name == "recommended":
            settings, _ = checked_settings(lm.path, {}, "recommended")
        else:
            settings, _ = checked_settings(lm.path, setting_fields(name, checked_settings(lm.path, {})[0].gen_length))
        runs = {False: [], True: []}
        outputs = {}
        for _ in range(args.runs + 1):  # the first of each: compilation and a first run, not counted
            for trace in (False, True):
                out = lm.generate(questions, settings, trace=trace, warm=True)
                runs[trace].append(out[0].seconds)
                outputs[trace] = [(r.output_ids, r.nfe) for r in out]
        assert outputs[False] == outputs[True], name
        off, on = runs[False][1:], runs[True][1:]
        ratios = [b / a for a, b in zip(off, on)]
        print(
            f"| {name} | {statistics.median(off):.3f} | {statistics.median(on):.3f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
