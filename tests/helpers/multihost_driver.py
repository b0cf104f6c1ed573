"""The command-line front ends run as one process of several, or as one process alone, for
tests/parallel/test_multihost.py.

Usage: python tests/helpers/multihost_driver.py MODEL_DIR OUT_DIR [--serve PORT] [--coordinator ... --num-processes N --process-id I]

Runs, in this process, ``python -m psd_jax.generate`` for each setting of ``GENERATE`` (one text
prompt and one token-id prompt in one batch, JSON out) on MODEL_DIR (``word_model.with_tokenizer``),
through its ``main`` with the given multi-process flags, so the processes of a cluster share one
start-up and the programs one compile. Writes OUT_DIR/run-<process>.json: what each command printed
and its exit code (and ``generate`` of the tiny DiffusionGemma checkpoint). ``bench`` and
``evaluate`` on several processes are tests/parallel/test_front_end_commands.py's (each started as a
user starts it; they decode through the same ``generate`` as here). With ``--serve PORT`` it then
runs ``python -m psd_jax.serve`` (``SERVE`` settings; process 0 listens on PORT) until the server
stops. Before that, ``python -m psd_jax.serve`` of the tiny DiffusionGemma checkpoint on the same
processes (``DG_SERVE``'s settings, on a free port of process 0's): process 0 sends it
sharded_decode's first ``DG_SERVED`` requests, records the answers and stops it (SIGTERM); the same
processes then start the second server.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from paths import GOLDENS

from sharded_decode import (
    CACHED,
    DECODERS,
    DG_CASE,
    DG_OWN,
    DG_OWN_MESH,
    DG_PROMPT_BUCKET,
    DG_SERVE,
    DG_SERVE_ROWS,
    DG_SERVED,
    block_decode_rows,
    served_answers,
)
from word_model import PROMPTS, converted, text

# (mesh, setting of sharded_decode): rows over `data` (one process each) with heads over `model`,
# and `model` across the two processes; uncached and with the dual cache. Every decoder runs on a
# mesh in tests/helpers/sharded_decode.py: what two processes add is the split across them, one setting
# each (each setting is a compile in both processes).
GENERATE = {
    "psd+dual": "data=2,model=4",
    "fixed": "data=1,model=8",
}
CONVERTED = "fixed"  # also decoded from the converted checkpoint (heads across the two processes)
TEXT_REFERENCE = "psd+dual"  # the one setting the one-process reference also runs through generate (its text)
PROMPT_BUCKET = "16"
SERVE_MESH = "data=2,model=4"
SERVE = ["--policy", "threshold", "--threshold", "0.7", "--batch-sizes", "1,2", "--warmup-lengths", "none"]
SERVED_NAME = "word-model"
SERVE_PROMPTS = [text(PROMPTS[0]), text(PROMPTS[1]), "w5 w6 w7 w8 w9"]  # three clients: two rows and a join


def flags(settings) -> list[str]:
    out = []
    for name, value in settings.changed().items():
        flag = "--" + name.replace("_", "-")
        out += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    return out


def process_index(cluster: list[str]) -> int:
    return int(cluster[cluster.index("--process-id") + 1]) if "--process-id" in cluster else 0


def captured(main, argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return {"code": code, "stdout": out.getvalue()}


def run_front_ends(model: Path, cluster: list[str], settings_run: list[str] | None = None) -> dict:
    """``generate``'s run for each of ``settings_run`` (default all of ``GENERATE``, and
    ``CONVERTED`` again from the Orbax checkpoint)."""
    from psd_jax.cli import generate

    settings = {**DECODERS, **CACHED}
    runs = {}
    for name, mesh in GENERATE.items():
        if settings_run is not None and name not in settings_run:
            continue
        argv = ["--model", str(model), "--mesh", mesh, "--prompt-bucket", PROMPT_BUCKET, "--json"]
        argv += ["--prompt", text(PROMPTS[0]), "--prompt-ids", ",".join(map(str, PROMPTS[1]))]
        runs[f"generate {name}"] = captured(generate.main, argv + flags(settings[name]) + cluster)
        if name == CONVERTED:  # the same decode from the Orbax checkpoint (each process restores its blocks)
            argv[1] = str(converted(model))
            runs[f"generate {name} converted"] = captured(generate.main, argv + flags(settings[name]) + cluster)
    return runs


def diffusion_gemma_generate(cluster: list[str]) -> dict:
    """``python -m psd_jax.generate`` on the tiny DiffusionGemma checkpoint over ``DG_OWN_MESH``
    with ``DG_OWN``'s settings and the golden ``DG_CASE``'s prompts: its rows split across the
    processes (sharded_decode decodes the same on that mesh in one process)."""
    from diffusion_gemma_goldens import golden_case

    from psd_jax.cli import generate

    c = golden_case(DG_CASE)
    argv = ["--model", str(GOLDENS / "diffusion-gemma-tiny"), "--mesh", DG_OWN_MESH, "--json"]
    argv += ["--gen-length", str(DG_OWN["gen_length"]), "--max-denoising-steps", str(DG_OWN["max_denoising_steps"])]
    argv += ["--seed", str(DG_OWN["seed"])]
    for ids, mask in zip(c["prompt"], c["attention_mask"]):
        argv += ["--prompt-ids", ",".join(map(str, ids[mask.astype(bool)]))]
    return captured(generate.main, argv + cluster)


DG_SERVED_NAME = "diffusion-gemma-tiny"
DG_START_S = 300  # process 0's wait for its DiffusionGemma server to answer /health


def diffusion_gemma_served(cluster: list[str]) -> dict:
    """``python -m psd_jax.serve`` of the tiny DiffusionGemma checkpoint on ``DG_OWN_MESH`` across
    the processes; process 0 answers sharded_decode's first ``DG_SERVED`` requests (sent at once by a
    thread of its own), then stops on the SIGTERM that thread sends it. The exit code and what it
    printed, and on process 0 the answers' ids and calls and ``/health`` (or why there are none)."""
    import httpx

    from psd_jax.serve import cli

    argv = ["--model", str(GOLDENS / "diffusion-gemma-tiny"), "--mesh", DG_OWN_MESH, "--batch-sizes", "2"]
    argv += ["--gen-length", str(DG_SERVE["gen_length"]), "--max-denoising-steps", str(DG_SERVE["max_denoising_steps"])]
    argv += ["--prompt-bucket", str(DG_PROMPT_BUCKET), "--warmup-lengths", "none", "--max-wait-ms", "100"]
    argv += ["--served-model-name", DG_SERVED_NAME, "--log-level", "warning"]
    if process_index(cluster) != 0:
        return captured(cli.main, argv + cluster)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url, got, ended = f"http://127.0.0.1:{port}", {}, threading.Event()

    def ask() -> None:
        try:
            deadline = time.monotonic() + DG_START_S
            while not ended.is_set() and time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                got["error"] = "the server ended or did not answer /health in time"
                return
            got["answers"] = served_answers(url, DG_SERVED_NAME, DG_SERVE_ROWS[:DG_SERVED])
            got["health"] = httpx.get(f"{url}/health", timeout=60).json()
        except Exception as exc:  # recorded for the test's message
            got["error"] = repr(exc)
        finally:
            if not ended.is_set():
                os.kill(os.getpid(), signal.SIGTERM)  # the server drains and stops every process

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    try:
        record = captured(cli.main, [*argv, "--port", str(port), *cluster])
    finally:
        ended.set()
    thread.join(60)
    return {**record, **got}


def serve_argv(model: Path, port: int) -> list[str]:
    argv = ["--model", str(model), "--mesh", SERVE_MESH, "--prompt-bucket", PROMPT_BUCKET, *SERVE]
    return [*argv, "--served-model-name", SERVED_NAME, "--port", str(port), "--log-level", "warning"]


def main(model: str, out: str, *rest: str) -> None:
    import argparse

    from psd_jax import load_model
    from psd_jax.cli.flags import add_cluster_flags, cluster_from_flags
    from psd_jax.parallel import multihost
    from psd_jax.serve import cli

    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=int)
    add_cluster_flags(parser)
    args, cluster = parser.parse_args(rest), list(rest)
    if args.serve is not None:
        cluster = cluster[: cluster.index("--serve")] + cluster[cluster.index("--serve") + 2 :]
    multihost.start(cluster_from_flags(args))  # before any output is captured
    out_dir = Path(out)
    runs = run_front_ends(Path(model), cluster)
    runs["generate diffusion_gemma"] = diffusion_gemma_generate(cluster)
    if args.serve is not None:  # a DiffusionGemma server on these processes, stopped before the next one
        runs["serve diffusion_gemma"] = diffusion_gemma_served(cluster)
    # A running batch that grows, takes joined rows and shrinks, its programs split over both processes.
    runs["block_decode"] = block_decode_rows(load_model(model, mesh=SERVE_MESH))
    # Written whole under a temporary name, then renamed: a reader never sees a part of it. A server
    # answers /health only once every process follows it, so after this on every process.
    written = out_dir / f"run-{process_index(cluster)}.json"
    written.with_suffix(".part").write_text(json.dumps(runs))
    written.with_suffix(".part").rename(written)
    if args.serve is not None:
        sys.exit(cli.main(serve_argv(Path(model), args.serve) + cluster))


if __name__ == "__main__":
    main(*sys.argv[1:])
