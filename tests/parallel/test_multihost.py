"""Every front end on two processes under jax.distributed (four simulated CPU devices each, one
mesh over all eight) gives what one process on the same eight devices gives.

One cluster runs for the module: two processes of tests/helpers/multihost_driver.py, each running
``generate`` (a text and a token-id prompt; plain, PSD and RPS; no cache and the dual cache; rows
over ``data`` and ``model`` across the processes) through its command-line entry point, then
``serve`` of DiffusionGemma (its requests sent and the server stopped by process 0 itself), then
``serve`` of the word model (process 0 answers HTTP). ``bench``, ``tune`` and ``evaluate`` on two
processes are tests/parallel/test_front_end_commands.py's (and, for DiffusionGemma,
test_diffusion_gemma_commands.py's). The one-process reference is
the same driver run in conftest's ``sharded_run`` subprocess. The last test kills process 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from paths import DEFAULT_MODEL, HELPERS, TEST_DATA
from processes import free_port

from psd_jax.cli.flags import add_cluster_flags, cluster_from_flags
from psd_jax.parallel import multihost

from conftest import OFFLINE
from multihost_driver import CONVERTED, GENERATE, SERVE_PROMPTS, SERVED_NAME, TEXT_REFERENCE
from sharded_decode import DG_OWN_MESH, DG_SERVED

DRIVER = HELPERS / "multihost_driver.py"
HEARTBEAT_S = 10  # the serving processes wait half of it for each other's confirmation
START_TIMEOUT_S = 600


class Cluster:
    def __init__(self, procs: list[subprocess.Popen], out: Path, url: str, logs: list[Path]):
        self.procs, self.out, self.url, self.logs = procs, out, url, logs

    def log(self, i: int) -> str:
        lines = self.logs[i].read_text().splitlines()
        return "\n".join(line for line in lines if not line.startswith("[Gloo]"))[-3000:]

    def run(self, i: int) -> dict:
        return json.loads((self.out / f"run-{i}.json").read_text())


@pytest.fixture(scope="module")
def cluster(word_model, sharded_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("two-processes")
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        **OFFLINE,
    )
    procs, logs = [], []
    for i in range(2):
        logs.append(out / f"log-{i}.txt")
        flags = ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)]
        command = [sys.executable, str(DRIVER), str(word_model), str(out), "--serve", str(port), *flags]
        command += ["--heartbeat-timeout", str(HEARTBEAT_S)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=logs[-1].open("w")))
    running = Cluster(procs, out, f"http://127.0.0.1:{port}", logs)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(running.url):
            for i, proc in enumerate(procs):
                assert proc.poll() is None, f"process {i} ended with {proc.returncode}:\n{running.log(i)}"
            assert time.monotonic() < deadline, f"no server after {START_TIMEOUT_S} s:\n{running.log(0)}"
            time.sleep(0.5)
        yield running
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def generated(stdout: str) -> list[list]:
    return [[g["output_ids"], g["nfe"]] for g in map(json.loads, stdout.splitlines())]


@pytest.mark.parametrize("setting", list(GENERATE))
def test_generate_equals_one_process(cluster, sharded_run, setting):
    """Text and token ids in one batch: process 0 prints the tokens and model calls of
    sharded_decode's direct decode on that mesh in one process, and (for ``TEXT_REFERENCE``)
    exactly the JSON lines one process's ``generate`` prints."""
    run = cluster.run(0)[f"generate {setting}"]
    assert run["code"] == 0
    assert generated(run["stdout"]) == sharded_run["meshes"][GENERATE[setting]][setting]
    if setting == TEXT_REFERENCE:
        reference = sharded_run["front_ends"]["runs"][f"generate {setting}"]
        untimed = lambda out: [  # noqa: E731
            {k: v for k, v in json.loads(line).items() if k not in ("seconds", "compile_seconds")}
            for line in out.splitlines()
        ]
        assert reference["code"] == 0 and untimed(run["stdout"]) == untimed(reference["stdout"])


def test_diffusion_gemma_generate_equals_one_process(cluster, sharded_run):
    """DiffusionGemma's sampler with its rows over ``data`` across the two processes and heads over
    ``model``: process 0 prints the ids, calls and decoder passes of the same decode on one device."""
    run = cluster.run(0)["generate diffusion_gemma"]
    assert run["code"] == 0
    rows = [json.loads(line) for line in run["stdout"].splitlines()]
    got = [[r["output_ids"], r["nfe"], r["decoder_passes"]] for r in rows]
    assert len(got) == 2 and got == sharded_run["diffusion_gemma"]["own_reference"]


def test_diffusion_gemma_server_on_two_processes_answers_as_generate(cluster, sharded_run):
    """``python -m psd_jax.serve`` of DiffusionGemma on data=2,model=4 across the two processes:
    concurrent requests (a row joining a running batch) each get ``generate``'s ids and calls of it
    alone on one device; the server stops on SIGTERM and both processes exit 0, and the same
    processes start the next server afterwards (the fixture's)."""
    runs = [cluster.run(i)["serve diffusion_gemma"] for i in range(2)]
    served = runs[0]
    assert [r["code"] for r in runs] == [0, 0] and "error" not in served, served
    reference = sharded_run["diffusion_gemma"]["serving"]["served_reference"][:DG_SERVED]
    assert served["answers"] == [[ids[:tokens], nfe] for ids, nfe, tokens in reference], DG_OWN_MESH
    assert served["health"]["requests"] == DG_SERVED and served["health"]["failed_batches"] == 0


def test_converted_checkpoint_restores_each_process_blocks(cluster, sharded_run):
    """The float32 Orbax conversion, restored by every process with the mesh's sharding, decodes as
    the safetensors directory does, and as one process does."""
    run = cluster.run(0)
    got = run[f"generate {CONVERTED} converted"]
    assert got["code"] == 0
    assert generated(got["stdout"]) == generated(run[f"generate {CONVERTED}"]["stdout"])
    assert generated(got["stdout"]) == sharded_run["meshes"][GENERATE[CONVERTED]][CONVERTED]


def test_only_process_zero_prints(cluster):
    runs = cluster.run(1)
    assert set(runs) == set(cluster.run(0))
    front_ends = {name: run for name, run in runs.items() if name != "block_decode"}
    assert all(r["code"] == 0 and r["stdout"] == "" for r in front_ends.values()), runs


def test_server_answers_concurrent_clients_as_one_process(cluster, sharded_run):
    """Three clients at once through process 0 (batch sizes 1 and 2: a batch starts, grows to two rows,
    and the third request joins a row when one finishes); process 1 makes every call with it."""

    def complete(prompt: str) -> dict:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 32}
        return httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=300).json()

    with ThreadPoolExecutor(len(SERVE_PROMPTS)) as pool:
        answers = list(pool.map(complete, SERVE_PROMPTS))
    got = [
        {
            "text": a["choices"][0]["text"],
            "token_ids": a["choices"][0]["token_ids"],
            "model_calls": a["usage"]["model_calls"],
        }
        for a in answers
    ]
    assert got == sharded_run["front_ends"]["served"]
    health = httpx.get(f"{cluster.url}/health", timeout=5).json()
    assert health["requests"] == len(SERVE_PROMPTS) and health["failed_batches"] == 0


def test_a_running_batch_on_two_processes_joins_and_regroups_as_one_device(cluster, sharded_run):
    """The block-by-block decode that grows from 2 to 4 rows, takes two joined rows and shrinks to
    2, on data=2,model=4 across the two processes: each row's ids and model calls are one device's
    decode of it alone."""
    assert cluster.run(0)["block_decode"] == sharded_run["front_ends"]["block_decode_reference"]


def test_losing_a_process_fails_requests_and_stops_the_server(cluster):
    """Process 1 killed: the next request gets a 503 naming it (process 0 waits half the heartbeat
    timeout for its confirmation), and process 0 exits with an error well within the heartbeat."""
    cluster.procs[1].send_signal(signal.SIGKILL)
    cluster.procs[1].wait()
    began = time.monotonic()
    response = httpx.post(f"{cluster.url}/v1/completions", json={"model": SERVED_NAME, "prompt": "w5 w6"}, timeout=60)
    assert response.status_code == 503
    assert response.json()["error"]["message"].startswith("process 1 of the 2 serving processes did not answer")
    code = cluster.procs[0].wait(timeout=HEARTBEAT_S)
    assert code == 1 and time.monotonic() - began < HEARTBEAT_S
    assert "error: process 1 of the 2 serving processes did not answer" in cluster.log(0)


def cluster_of(*argv: str):
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    return cluster_from_flags(parser.parse_args(argv))


def test_cluster_flags_are_all_three_or_none():
    assert cluster_of() is None
    assert cluster_of("--distributed").detected
    explicit = cluster_of("--coordinator", "node0:1234", "--num-processes", "2", "--process-id", "1")
    assert (explicit.coordinator, explicit.num_processes, explicit.process_id) == ("node0:1234", 2, 1)
    assert not explicit.detected and explicit.heartbeat_timeout_s == multihost.DEFAULT_HEARTBEAT_S
    refused = {
        ("--coordinator", "node0:1"): "--coordinator needs --num-processes and --process-id too",
        ("--num-processes", "2", "--process-id", "0"): "--num-processes, --process-id needs --coordinator too",
        ("--coordinator", "node0", "--num-processes", "2", "--process-id", "0"): "--coordinator must be HOST:PORT",
        ("--coordinator", "node0:70000", "--num-processes", "2", "--process-id", "0"): "a port from 1 to 65535",
        ("--coordinator", "node0:1", "--num-processes", "2", "--process-id", "2"): "--process-id must be from 0 to 1",
        ("--coordinator", "node0:1", "--num-processes", "0", "--process-id", "0"): "--num-processes must be at least 1",
        ("--distributed", "--heartbeat-timeout", "0"): "--heartbeat-timeout must be at least 1 second",
    }
    for argv, message in refused.items():
        with pytest.raises(multihost.ClusterError, match=re.escape(message)):
            cluster_of(*argv)


@pytest.mark.parametrize("front_end", ["generate", "bench", "evaluate", "serve", "tune"])
def test_front_ends_refuse_incomplete_cluster_flags_in_one_line(front_end, capsys):
    argv = ["--data", PROBLEMS] if front_end == "tune" else []  # its one required flag
    assert front_end_main(front_end)([*argv, "--coordinator", "127.0.0.1:1234"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --coordinator needs --num-processes and --process-id too: give all three or none"


class _Started(BaseException):
    """Raised by the test's ``multihost.start``: the front end stops there (no model is loaded)."""


CLUSTER = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
TASKS = str(TEST_DATA / "tasks")
PROBLEMS = str(DEFAULT_MODEL / "test.jsonl")
STARTS = {  # front end, flags: every path that reads a recommended setting or the device kind, with the cluster flags
    "generate demo": ("generate", []),
    "generate --settings": ("generate", ["--settings", "recommended", "--prompt", "What is 2 + 3?"]),
    "bench recommended": ("bench", ["--decoders", "recommended", "--limit", "2"]),
    "evaluate --settings": ("evaluate", ["--settings", "recommended", "--tasks", "heldout", "--include_path", TASKS]),
    "serve": ("serve", []),
    "serve --settings": ("serve", ["--settings", "recommended", "--threshold", "0.9"]),
    "tune --write": ("tune", ["--data", PROBLEMS, "--space", "small", "--write"]),  # recommended.json's device kind
}


def front_end_main(name: str):
    from psd_jax import evaluate
    from psd_jax.cli import bench, generate
    from psd_jax.serve import cli
    from psd_jax.tuning.cli import main as tune

    mains = {"generate": generate.main, "bench": bench.main, "evaluate": evaluate.main, "serve": cli.main}
    return {**mains, "tune": tune}[name]


def guard_device_reads(monkeypatch) -> list:
    """The cluster's start recorded (and the front end stopped there), and every read of the device
    kind or the devices before it an error: ``jax.distributed.initialize`` must come before
    anything starts JAX's backend."""
    import jax

    import psd_jax.recommended

    started: list = []

    def start(cluster):
        started.append(cluster)
        raise _Started

    def guarded(real):
        def read(*args, **kwargs):
            assert started, f"{real.__name__} was called before the cluster started"
            return real(*args, **kwargs)

        return read

    monkeypatch.setattr(multihost, "start", start)
    for module, name in [(psd_jax.recommended, "current_device_kind"), (jax, "default_backend"), (jax, "devices")]:
        monkeypatch.setattr(module, name, guarded(getattr(module, name)))
    return started


@pytest.mark.parametrize("start", list(STARTS))
def test_every_front_end_starts_the_cluster_before_it_reads_the_device(start, monkeypatch):
    """On the shipped model, whose recommended setting is chosen per device kind."""
    front_end, argv = STARTS[start]
    started = guard_device_reads(monkeypatch)
    with pytest.raises(_Started):
        front_end_main(front_end)([*argv, *CLUSTER])
    assert [(c.coordinator, c.num_processes, c.process_id) for c in started] == [("127.0.0.1:1", 2, 0)]


@pytest.mark.parametrize(
    "front_end, argv, message",
    [
        ("generate", ["--threshold", "2", "--prompt", "x"], "threshold must be in (0, 1]"),
        ("generate", ["--settings", "recommended", "--depth", "2", "--prompt", "x"], "depth"),
        ("serve", ["--settings", "recommended", "--gen-length", "4096"], "gen_length 4096"),
        ("bench", ["--decoders", "recommended", "--gen-length", "4096"], "gen_length 4096"),
        ("tune", ["--data", PROBLEMS, "--gen-length", "4096"], "gen_length 4096"),
        (
            "evaluate",
            [
                "--settings",
                "recommended",
                "--tasks",
                "heldout",
                "--include_path",
                TASKS,
                "--model_args",
                "gen_length=4096",
            ],
            "gen_length 4096",
        ),
    ],
)
def test_settings_refused_on_every_device_fail_before_the_cluster_starts(front_end, argv, message, monkeypatch, capsys):
    """A setting that holds over none of the directory's recommendations is one error line before
    any process waits for the others."""
    started = guard_device_reads(monkeypatch)
    assert front_end_main(front_end)([*argv, *CLUSTER]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert started == []


class _KeyValueStore:
    """The coordination service's key-value calls the lockstep channel makes, in memory."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    def key_value_delete(self, key: str) -> None:
        with self.changed:
            self.values.pop(key, None)


def test_process_zero_opens_its_port_only_once_every_process_follows():
    """Process 0 waits for each other process to start following its calls (the server's port, so
    its ``/health``, opens only then), and gives up with one line naming the process that never did."""
    from psd_jax.serve.lockstep import Call, Channel, NotJoined

    store = _KeyValueStore()
    leader = Channel(0, 3, timeout_s=5, client=store)
    followers = [Channel(i, 3, timeout_s=5, client=store) for i in (1, 2)]
    with pytest.raises(NotJoined, match=r"^process 1 of the 3 serving processes did not start serving within 0.2 s"):
        leader.wait_for_followers(timeout_s=0.2)
    calls = [follower.calls() for follower in followers]
    waiting = threading.Thread(target=leader.wait_for_followers, kwargs={"timeout_s": 60})
    waiting.start()
    with ThreadPoolExecutor(2) as pool:
        received = [pool.submit(next, c) for c in calls]  # each follower marks itself ready, then reads
        waiting.join(60)
        assert not waiting.is_alive()
        leader.send(Call("advance", run=1))
        assert [r.result(60).op for r in received] == ["advance", "advance"]


def test_a_closed_channel_leaves_no_keys_so_the_same_processes_serve_again():
    """A server's stop (``close``: ``EXIT``, confirmed) deletes every key its channel wrote, so a
    second server of the same processes numbers its calls from 1 again and each follower gets
    exactly its own server's calls; a closed channel sends nothing more."""
    from psd_jax.serve.lockstep import Call, Channel

    store = _KeyValueStore()
    for ops in (["advance", "stop"], ["regroup"]):  # two servers in turn
        leader, follower = Channel(0, 2, timeout_s=5, client=store), Channel(1, 2, timeout_s=5, client=store)
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(lambda f=follower: [call.op for call in f.calls()])
            leader.wait_for_followers(timeout_s=60)
            for op in ops:
                leader.send(Call(op, run=1))
            leader.close()
            assert received.result(60) == ops
        assert store.values == {}
        with pytest.raises(RuntimeError, match="closed"):
            leader.send(Call("advance", run=1))
