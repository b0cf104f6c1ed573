"""DiffusionGemma's benchmark, tuner and harness model on several processes, started as a user
starts them: ``python -m psd_jax.<front end>`` on the tiny checkpoint (with a character
tokenizer), as two processes of one ``jax.distributed`` cluster with ``--mesh data=2``, write what
the same command writes as one process of two devices (rows split over the processes, results
gathered). Its ``generate`` and server on two processes: tests/parallel/test_multihost.py; the same
front ends on one process, against ``generate``: tests/frontends/test_diffusion_gemma_frontends.py.

Marked slow, so left out of the default run: nine processes, about 75 s alone on 2 cores and twice
that beside the rest of the suite, which would take CI past its 15 minutes. Run them with
``python -m pytest -m slow tests/parallel/test_diffusion_gemma_commands.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from command_outputs import MESH, TIMING, harness_files, one_and_two, untimed_tune
from diffusion_gemma_goldens import tiny_with_tokenizer

PROBLEMS = [
    {"question": "What is 2+3?", "answer": "5"},
    {"question": "Say 7", "answer": "7"},
    {"question": "What is 4+4?", "answer": "8"},
    {"question": "Say 9", "answer": "9"},
]
pytestmark = pytest.mark.slow

STEPS = ["--max-denoising-steps", "6"]  # 6 steps a canvas, not the release's 16: the same work, less time


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("diffusion-gemma-commands")


@pytest.fixture(scope="module")
def model(out) -> str:
    return str(tiny_with_tokenizer(out / "model"))


@pytest.fixture(scope="module")
def problems(out) -> Path:
    path = out / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def test_bench_on_two_processes_writes_what_one_process_writes(out, model, problems):
    argv = ["--model", model, "--data", str(problems), "--limit", "2", "--batch", "2", "--gen-length", "64"]
    argv += [*STEPS, "--decoders", "entropy-bound-2-s6", "--latency", "0", *MESH]
    one_and_two("psd_jax.bench", [*argv, "--out", str(out / "bench-one")], out, "dg-bench",
                [*argv, "--out", str(out / "bench-two")])  # fmt: skip
    got, want = (json.loads((out / f"bench-{n}" / "bench.json").read_text()) for n in ("two", "one"))
    untimed = lambda report: [{k: v for k, v in r.items() if k not in TIMING} for r in report["results"]]  # noqa: E731
    assert [r["name"] for r in want["results"]] == ["entropy-bound-0.1-s6", "entropy-bound-2-s6"]
    assert untimed(got) == untimed(want) and all(r["tokens"] > 0 for r in want["results"])
    assert (got["meta"]["processes"], want["meta"]["processes"]) == (2, 1)


def test_tune_on_two_processes_writes_what_one_process_writes(out, model):
    """The sampler's small space over the release's settings at 6 steps, model calls the objective
    (no clock decides between the runs): process 0 writes the report and the log that one process
    writes, and process 1 prints nothing."""
    data = out / "tune.jsonl"  # as tests/frontends' tune on one process: a search with a choice
    data.write_text(
        "".join(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    argv = ["--model", model, "--data", str(data), "--space", "small", "--confirm", "2", "--rungs", "4"]
    argv += ["--batch", "2", "--gen-length", "64", "--base", "entropy-bound-0.1-s6", "--max-loss", "0"]
    argv += ["--confirm-z", "0", "--objective", "calls", *MESH]
    _, (_, other) = one_and_two("psd_jax.tune", [*argv, "--out", str(out / "tune-one")], out, "dg-tune",
                                [*argv, "--out", str(out / "tune-two")])  # fmt: skip
    assert other.out() == "", "only process 0 prints"
    got, want = (json.loads((out / f"tune-{n}" / "tune.json").read_text()) for n in ("two", "one"))
    assert (got["meta"]["processes"], want["meta"]["processes"]) == (2, 1)
    assert set(want["candidates"]) == {"entropy-bound-1-s6", "entropy-bound-1-s24"}
    assert got["choice"] is not None and untimed_tune(got) == untimed_tune(want)
    log, want_log = ((out / f"tune-{n}" / "tune.jsonl").read_text().splitlines() for n in ("two", "one"))
    assert len(log) > 2 and list(map(untimed_tune, map(json.loads, log))) == list(
        map(untimed_tune, map(json.loads, want_log))
    )


def test_evaluate_on_two_processes_writes_what_one_process_writes(out, model):
    args = f"pretrained={model},gen_length=64,max_denoising_steps=6,mesh=data=2"
    argv = ["--tasks", "heldout", "--include_path", "tests/data/tasks", "--limit", "2", "--batch_size", "2"]
    argv += ["--model_args", args]
    one_and_two("psd_jax.evaluate", [*argv, "--output_path", str(out / "eval-one")], out, "dg-evaluate",
                [*argv, "--output_path", str(out / "eval-two")])  # fmt: skip
    (results, efficiency), (want_results, want_efficiency) = (harness_files(out / f"eval-{n}") for n in ("two", "one"))
    assert results["results"] == want_results["results"] and "heldout" in results["results"]
    untimed = lambda record: {k: v for k, v in record.items() if k not in TIMING}  # noqa: E731
    record, want = efficiency["tasks"]["heldout"], want_efficiency["tasks"]["heldout"]
    assert untimed(record) == untimed(want) and record["requests"] == 2 and record["tokens"] > 0
    assert efficiency["settings"] == want_efficiency["settings"]
    assert (efficiency["settings"]["max_denoising_steps"], efficiency["settings"]["gen_length"]) == (6, 64)
