"""Answers: where does a training step of the shipped recipe spend its time, op by op?

Builds the shipped model's training step (``scripts.default_model.train.make_train_step``) on one
batch of word problems, warms it up, records ``--steps`` steps with ``jax.profiler`` (an XLA:CPU
trace) and prints the most expensive compiled ops with their output shapes and the JAX operation
they come from. This is how the slow backward transposes of ``[B, N, D]`` dots were found
(docs/default-model.md).

    python -m scripts.experiments.profile_train_step --steps 5 --top 20
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import re
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx
from transformers import AutoTokenizer

import scripts.default_model.train as td
from models import DiffusionLM
from models.transformer import default_unroll_layers
from scripts.default_model.tasks import make_dataset


def op_times(trace_dir: Path, steps: int) -> collections.Counter:
    """Milliseconds per step of every compiled op in the Perfetto trace under ``trace_dir``."""
    (trace,) = trace_dir.glob("**/*.trace.json.gz")
    totals: collections.Counter = collections.Counter()
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    for event in events:
        if event.get("ph") == "X" and "dur" in event:
            totals[event["name"]] += event["dur"] / 1000 / steps
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/default", help="directory holding the tokenizer")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=20)
    td.add_model_args(parser)
    args = parser.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = td.model_config(tok, args)
    graphdef, params = nnx.split(DiffusionLM(cfg, rngs=nnx.Rngs(args.seed), unroll_layers=default_unroll_layers()))
    optimizer = td.make_optimizer(3e-3, 1000, 100)
    opt_state = optimizer.init(params)
    step = td.make_train_step(graphdef, optimizer, cfg.mask_id, row_mean=True)  # the shipped loss weight
    batch = td.encode_batch(
        tok, make_dataset(args.batch, random.Random(args.seed).randrange(2**31)), cfg.eos_id, cfg.pad_id
    )
    key = jax.random.key(args.seed)
    for _ in range(2):  # compile and warm up
        params, opt_state, loss, _ = step(params, opt_state, *batch, key)
        loss.block_until_ready()
    hlo = step.lower(params, opt_state, *batch, key).compile().as_text()
    with tempfile.TemporaryDirectory() as trace_dir:
        start = time.perf_counter()
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.steps):
            params, opt_state, loss, _ = step(params, opt_state, *batch, key)
            loss.block_until_ready()
        jax.profiler.stop_trace()
        elapsed = (time.perf_counter() - start) / args.steps
        totals = op_times(Path(trace_dir), args.steps)
    print(f"batch {batch[0].shape}, {elapsed * 1000:.0f} ms per step while profiled; top compiled ops (ms per step):")
    shown = 0
    for name, ms in totals.most_common():
        found = re.search(r"%" + re.escape(name) + r" = (\S+) .*?op_name=\"([^\"]+)\"", hlo)
        if not found:  # runtime bookkeeping (executor waits, Python frames), not an op
            continue
        print(f"{ms:8.2f}  {name:28s} {found[1]:34s} {found[2][-60:]}")
        shown += 1
        if shown == args.top:
            break


if __name__ == "__main__":
    main()
