"""The server's three ways of decoding the same requests, in one process and without HTTP: one at a
time, static batches (a batch decodes until its last row is done) and continuous batching (done
rows are refilled between block calls), through the same ``BlockDecode`` calls the server makes.
It separates what the engine's batching gains from the HTTP and client work around it.

    python -m scripts.figures.batching_modes --requests 96 --batch 16 --policy threshold
    python -m scripts.figures.batching_modes --requests 96 --batch 16 --policy threshold --decoder psd --depth 3 --cache dual

Requests are the first N held-out questions of the shipped model, each with ``max_tokens`` drawn
from ``--max-tokens-mix`` (seeded), in a canvas of the largest; every mode is run twice and the
second run is reported (the first compiles). Prints wall seconds, block calls and requests/s.

Its figures are in docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path

from psd_jax import DecodeConfig, load_model
from psd_jax.cli.flags import ArgumentParser, add_decode_flags, decode_fields, positive_int

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "default"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m scripts.figures.batching_modes", description=__doc__)
    p.add_argument("--requests", type=positive_int, default=96)
    p.add_argument("--batch", type=positive_int, default=16, help="rows per batch (static and continuous)")
    p.add_argument("--max-tokens-mix", default="16,32,48", help="comma-separated generation lengths, mixed (seeded)")
    p.add_argument("--seed", type=int, default=0)
    add_decode_flags(p)
    return p


def decode_one_at_a_time(lm, prompts, settings, canvas: int) -> int:
    calls = 0
    for prompt, dcfg in zip(prompts, settings):
        run = lm.start_rows([prompt], [dcfg], [0], batch_size=1, gen_length=canvas)
        while not run.done:
            run.advance()
            calls += 1
    return calls


def decode_static(lm, prompts, settings, canvas: int, batch: int) -> int:
    calls = 0
    for i in range(0, len(prompts), batch):
        rows = prompts[i : i + batch]
        run = lm.start_rows(rows, settings[i : i + batch], [0] * len(rows), batch_size=batch, gen_length=canvas)
        while not run.done:
            run.advance()
            calls += 1
    return calls


def decode_continuous(lm, prompts, settings, canvas: int, batch: int) -> int:
    first = min(batch, len(prompts))
    run = lm.start_rows(prompts[:first], settings[:first], [0] * first, batch_size=batch, gen_length=canvas)
    waiting, calls, free = first, 0, set(range(first, batch))
    while True:
        progress = run.advance()
        calls += 1
        done = [r for r in range(batch) if progress.done[r] and r not in free]
        take = done[: len(prompts) - waiting]
        run.join(take, prompts[waiting : waiting + len(take)], settings[waiting : waiting + len(take)], [0] * len(take))
        waiting += len(take)
        free |= set(done[len(take) :])
        if run.done and waiting == len(prompts):
            return calls


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    lengths = [int(t) for t in args.max_tokens_mix.split(",") if t.strip()]
    lm = load_model(DEFAULT_MODEL)
    base = lm.settings(DecodeConfig(gen_length=max(lengths), block_length=16), decode_fields(args))
    questions = [json.loads(line)["question"] for line in (DEFAULT_MODEL / "test.jsonl").read_text().splitlines()]
    prompts = lm.prompt_ids([questions[i % len(questions)] for i in range(args.requests)])
    rng = random.Random(args.seed)
    settings = [lm.settings(dataclasses.replace(base, gen_length=rng.choice(lengths))) for _ in prompts]
    modes = {
        "one at a time": lambda: decode_one_at_a_time(lm, prompts, settings, base.gen_length),
        f"static, batch {args.batch}": lambda: decode_static(lm, prompts, settings, base.gen_length, args.batch),
        f"continuous, batch {args.batch}": lambda: decode_continuous(
            lm, prompts, settings, base.gen_length, args.batch
        ),
    }
    print(f"{args.requests} requests, max_tokens {lengths}, {base.changed()}")
    print("| mode | seconds | block calls | requests/s |\n| --- | ---: | ---: | ---: |")
    for name, decode in modes.items():
        decode()  # compiles
        began = time.perf_counter()
        calls = decode()
        seconds = time.perf_counter() - began
        print(f"| {name} | {seconds:.2f} | {calls} | {args.requests / seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
