"""Every front end that runs on several processes, started as a user starts it: ``python -m
psd_jax.<front end>`` on the shipped model with its recommended setting, as two processes of one
``jax.distributed`` cluster, gives what the same command gives as one process on the same mesh.

The recommended setting is chosen per device kind, so reading it asks JAX for the backend, which
must not happen before the cluster starts (``jax.distributed.initialize`` refuses to start after
it): each command here starts from nothing, as a user's does, so each front end's start-up order
is what runs. The mesh is ``data=2`` over one simulated CPU device per process (a row on each
process: the processes split the batch and gather the results); heads split across processes,
and the other decoders and caches, are tests/parallel/test_multihost.py's, on a smaller model.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from command_outputs import MESH, TIMEOUT_S, TIMING, harness_files, one_and_two, untimed_tune
from paths import DEFAULT_MODEL, ROOT
from processes import finish, free_port, start, stop

from psd_jax.recommended import RECOMMENDED_FILE, read_recommended

MODEL = str(DEFAULT_MODEL.relative_to(ROOT))  # as a user in the repository writes it
QUESTIONS = [json.loads(line)["question"] for line in (DEFAULT_MODEL / "test.jsonl").read_text().splitlines()[1:3]]
PROMPT_LENGTH = 64  # both questions' padded length (37 and 39 tokens in the bucket of 32)
GENERATE = ["--model", MODEL, "--settings", "recommended", *MESH, "--json"]
GENERATE += [arg for q in QUESTIONS for arg in ("--prompt", q)]
UNTIMED = lambda line: {k: v for k, v in json.loads(line).items() if k not in ("seconds", "compile_seconds")}  # noqa: E731


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("commands")


@pytest.fixture(scope="module")
def generated(out):
    return one_and_two("psd_jax.generate", GENERATE, out, "generate")


def test_generate_recommended_on_two_processes_prints_what_one_process_prints(generated):
    one, (zero, other) = generated
    lines = one.out().splitlines()
    assert len(lines) == len(QUESTIONS) and all(json.loads(line)["tokens"] > 0 for line in lines)
    assert list(map(UNTIMED, zero.out().splitlines())) == list(map(UNTIMED, lines))
    assert other.out() == "", "only process 0 prints"


def test_bench_recommended_on_two_processes_writes_what_one_process_writes(out):
    argv = ["--model", MODEL, "--decoders", "recommended", "--limit", "2", "--batch", "2", "--latency", "0", *MESH]
    one_and_two(
        "psd_jax.bench",
        [*argv, "--out", str(out / "bench-one")],
        out,
        "bench",
        [*argv, "--out", str(out / "bench-two")],
    )
    got, want = (json.loads((out / f"bench-{n}" / "bench.json").read_text()) for n in ("two", "one"))
    untimed = lambda report: [{k: v for k, v in r.items() if k not in TIMING} for r in report["results"]]  # noqa: E731
    assert [r["name"] for r in want["results"]] == ["fixed-1/none", "recommended"]
    assert untimed(got) == untimed(want)
    assert (got["meta"]["processes"], want["meta"]["processes"]) == (2, 1)


def linked_model(directory: Path) -> Path:
    """The shipped model's files linked into ``directory``, without its recommended setting: what
    ``tune --write`` writes there."""
    directory.mkdir()
    for file in DEFAULT_MODEL.iterdir():
        if file.name != RECOMMENDED_FILE:
            (directory / file.name).symlink_to(file)
    return directory


TUNE_PROBLEMS = {"dev": (3, 5), "confirm": (5, 7)}  # lines of the held-out set: a search and a confirmation


def test_tune_on_two_processes_writes_what_one_process_writes(out):
    """The tuner's smallest search on two processes: process 0 writes the log, the report and
    (``--write``) the choice that one process writes; process 1 prints nothing. The small space at
    4 tokens in blocks of 1 holds one candidate (threshold-0.9 with the dual cache; the others do
    not fit the block), so each run compiles two programs, the base's and its; one rung of two
    problems and two confirmation problems; model calls the objective, so that no clock decides
    between the two runs."""
    lines = (DEFAULT_MODEL / "test.jsonl").read_text().splitlines()
    for name, (first, end) in TUNE_PROBLEMS.items():
        (out / f"tune-{name}.jsonl").write_text("\n".join(lines[first:end]) + "\n")
    argv = ["--data", str(out / "tune-dev.jsonl"), "--confirm-data", str(out / "tune-confirm.jsonl")]
    argv += ["--space", "small", "--rungs", "2", "--batch", "2", "--max-loss", "0", "--confirm-z", "0"]
    argv += ["--gen-length", "4", "--block-length", "1", "--objective", "calls", *MESH]
    runs = {
        n: ["--model", str(linked_model(out / f"tune-model-{n}")), "--out", str(out / f"tune-{n}"), "--write"]
        for n in ("one", "two")
    }
    _, (_, other) = one_and_two("psd_jax.tune", [*argv, *runs["one"]], out, "tune", [*argv, *runs["two"]])
    assert other.out() == "", "only process 0 prints"
    got, want = (json.loads((out / f"tune-{n}" / "tune.json").read_text()) for n in ("two", "one"))
    assert (got["meta"]["processes"], want["meta"]["processes"]) == (2, 1)
    assert got["choice"] is not None and untimed_tune(got) == untimed_tune(want)
    log, want_log = ((out / f"tune-{n}" / "tune.jsonl").read_text().splitlines() for n in ("two", "one"))
    assert list(map(untimed_tune, map(json.loads, log))) == list(map(untimed_tune, map(json.loads, want_log)))
    chosen, want_chosen = (json.loads((out / f"tune-model-{n}" / RECOMMENDED_FILE).read_text()) for n in ("two", "one"))
    assert untimed_tune(chosen) == untimed_tune(want_chosen)
    # Resumed on two processes from process 0's log: process 1 reads it back through process 0 (it
    # does not read the file), so neither decodes nor loads the model, and the report is the same.
    resumed = ["--model", str(out / "tune-model-two"), "--out", str(out / "tune-resumed")]
    resumed += ["--log", str(out / "tune-two" / "tune.jsonl")]
    finish(start("psd_jax.tune", [*argv, *resumed], out, "tune-resumed", devices=1, processes=2), TIMEOUT_S)
    again = json.loads((out / "tune-resumed" / "tune.json").read_text())
    assert (again["meta"]["log_entries_read_back"], again["meta"]["problems_decoded"]) == (len(log), 0)
    same = lambda report: untimed_tune({**report, "meta": {}})  # noqa: E731
    assert same(again) == same(got)


def test_evaluate_recommended_on_two_processes_writes_what_one_process_writes(out):
    argv = ["--settings", "recommended", "--tasks", "heldout", "--include_path", "tests/data/tasks", "--limit", "2"]
    argv += ["--apply_chat_template", "--batch_size", "2", "--model_args", f"pretrained={MODEL},mesh=data=2"]
    one_and_two(
        "psd_jax.evaluate",
        [*argv, "--output_path", str(out / "eval-one")],
        out,
        "evaluate",
        [*argv, "--output_path", str(out / "eval-two")],
    )
    (results, efficiency), (want_results, want_efficiency) = (
        harness_files(out / "eval-two"),
        harness_files(out / "eval-one"),
    )
    assert results["results"] == want_results["results"]
    assert results["results"]["heldout"]["exact_match,psd-scoring"] > 0, "the answers are the model's, not noise"
    untimed = lambda record: {k: v for k, v in record.items() if k not in TIMING}  # noqa: E731
    record, want = efficiency["tasks"]["heldout"], want_efficiency["tasks"]["heldout"]
    assert untimed(record) == untimed(want) and record["requests"] == 2 and record["tpf"] > 1
    assert efficiency["settings"] == want_efficiency["settings"]
    recommended = read_recommended(DEFAULT_MODEL, "cpu").settings
    assert {k: efficiency["settings"][k] for k in recommended} == recommended


def test_serve_recommended_on_two_processes_answers_as_one_process_generates(out, generated):
    """Two processes of the server (process 0 answers HTTP, process 1 makes every call with it):
    two clients at once get the one process's ``generate`` answers, from the programs the warm-up
    compiled; SIGTERM to process 0 stops both, with exit code 0."""
    port = free_port()
    argv = ["--model", MODEL, "--settings", "recommended", *MESH, "--batch-sizes", "1,2"]
    argv += ["--warmup-lengths", str(PROMPT_LENGTH), "--port", str(port), "--log-level", "warning"]
    servers = start("psd_jax.serve", [*argv, "--served-model-name", "default"], out, "serve", devices=1, processes=2)
    url = f"http://127.0.0.1:{port}"
    try:
        warm = wait_until_healthy(url, servers)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(lambda q: complete(url, q), QUESTIONS))
        want = [json.loads(line) for line in generated[0].out().splitlines()]
        assert answers == [
            {"text": g["text"], "token_ids": g["output_ids"][: g["tokens"]], "model_calls": g["nfe"]} for g in want
        ]
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["compiled_programs"] == warm["compiled_programs"] == health["compiles"], health
        assert health["requests"] == len(QUESTIONS) and health["failed_batches"] == 0
        servers[0].proc.send_signal(signal.SIGTERM)
        assert [run.wait(120) for run in servers] == [0, 0], [run.log() for run in servers]
    finally:
        stop(servers)


def wait_until_healthy(url: str, servers) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        for i, run in enumerate(servers):
            assert run.proc.poll() is None, f"serving process {i} ended with {run.proc.returncode}:\n{run.log()}"
        assert time.monotonic() < deadline, f"no server after {TIMEOUT_S} s:\n{servers[0].log()}"
        try:
            reply = httpx.get(f"{url}/health", timeout=5)
            if reply.status_code == 200:
                return reply.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def complete(url: str, question: str) -> dict:
    body = {"model": "default", "prompt": question}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).json()
    choice = answer["choices"][0]
    return {"text": choice["text"], "token_ids": choice["token_ids"], "model_calls": answer["usage"]["model_calls"]}
