"""Load generator for ``python -m psd_jax.serve``: streamed completion requests, closed-loop
(C concurrent clients) or open-loop (Poisson arrivals at R requests/s), reporting requests/s,
output tokens/s, p50/p95 latency and time to first chunk, next to the same prompts sent one at a
time (C = 1).

    python -m scripts.tools.load_generator --url http://127.0.0.1:8000 --concurrency 1,4,16 --requests 64
    python -m scripts.tools.load_generator --serve "--policy threshold --max-batch 16" --concurrency 1,4,16 \
        --batching static,continuous --max-tokens-mix 16,32,48
    python -m scripts.tools.load_generator --serve "--policy threshold" --rate 20,40 --requests 64

``--serve ARGS`` starts the server itself (``python -m psd_jax.serve ARGS`` on a free 127.0.0.1
port), waits for it and stops it at the end; with ``--batching static,continuous`` it starts one
server per batching mode (``--batching MODE`` added to ARGS) and runs the same load against each,
one after the other, so the modes are compared in one run. ``--max-tokens-mix 16,32,48`` gives
request i the i-th length of a seeded shuffle of the list repeated (the same for every mode).
Every level first sends one unmeasured round, so measurements see no compilation. Bounded:
``--requests`` per level, a timeout per request and ``--max-seconds`` per level. Prompts are the
questions of a jsonl (default: the shipped model's held-out set), taken in order and repeated if
needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai

from psd_jax.cli.flags import ArgumentParser, positive_int

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "models" / "default" / "test.jsonl"
START_TIMEOUT_S = 600  # start-up compiles the default settings


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m scripts.tools.load_generator", description=__doc__)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    where.add_argument("--serve", metavar="ARGS", help="start python -m psd_jax.serve ARGS and measure it")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (1 is always run)")
    p.add_argument(
        "--rate",
        help="comma-separated open-loop arrival rates in requests/s (Poisson arrivals), run after the client counts",
    )
    p.add_argument(
        "--batching",
        help="with --serve: comma-separated batching modes (static, continuous), one server each, the same load",
    )
    p.add_argument("--requests", type=positive_int, default=64, help="measured requests per concurrency level")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="jsonl with a question field per line")
    p.add_argument("--max-tokens", type=positive_int, help="max_tokens of every request (default: the server's)")
    p.add_argument("--max-tokens-mix", help="comma-separated max_tokens values mixed over the requests (seeded)")
    p.add_argument("--seed", type=int, default=0, help="seed of the length mix and the arrival times")
    p.add_argument("--extra", default="{}", help='JSON object of extra body fields, e.g. \'{"decoder": "psd"}\'')
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--max-seconds", type=float, default=900.0, help="seconds per concurrency level")
    p.add_argument("--server-cpus", help="with --serve: comma-separated CPU ids the server runs on (default: all)")
    p.add_argument("--client-cpus", help="comma-separated CPU ids the load generator's clients run on (default: all)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def load_prompts(path: Path, n: int) -> list[str]:
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]
    return [questions[i % len(questions)] for i in range(n)]


def length_mix(lengths: list[int] | None, n: int, seed: int) -> list[int | None]:
    """Request i's max_tokens: a seeded shuffle of ``lengths`` repeated to ``n`` (None: the server's)."""
    if not lengths:
        return [None] * n
    mix = [lengths[i % len(lengths)] for i in range(n)]
    random.Random(seed).shuffle(mix)
    return mix


def arrival_times(rate: float, n: int, seed: int) -> list[float]:
    """Seconds from the start at which each of ``n`` open-loop requests is sent: a Poisson process."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


def one_request(api: openai.OpenAI, model: str, prompt: str, body: dict, max_tokens: int | None = None) -> dict:
    """One streamed completion: latency, time to first chunk, output tokens."""
    if max_tokens is not None:
        body = {**body, "max_tokens": max_tokens}
    start = time.perf_counter()
    first, usage = None, None
    stream = api.completions.create(
        model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}, extra_body=body
    )
    for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    return {"latency": time.perf_counter() - start, "first_chunk": first, "tokens": usage.completion_tokens}


def run_level(
    url: str, model: str, prompts: list[str], clients: int, body: dict, args, rate: float | None = None
) -> dict:
    """``clients`` threads share the requests (closed loop), or with ``rate`` every request is sent
    at its Poisson arrival time (open loop, as many threads as requests in flight); one unmeasured
    round first."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    lengths = length_mix(args.lengths, len(prompts), args.seed)
    send = lambda p, n=None: one_request(api, model, p, body, n)  # noqa: E731
    workers = clients if rate is None else len(prompts)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(send, prompts[: min(clients, len(prompts))], lengths))
        before = httpx.get(f"{url}/health", timeout=args.timeout).json()
        start = time.perf_counter()
        if rate is None:
            futures = [pool.submit(send, p, n) for p, n in zip(prompts, lengths)]
        else:
            futures = []
            for p, n, at in zip(prompts, lengths, arrival_times(rate, len(prompts), args.seed)):
                time.sleep(max(0.0, at - (time.perf_counter() - start)))
                futures.append(pool.submit(send, p, n))
        results = [f.result(timeout=max(args.max_seconds - (time.perf_counter() - start), 1)) for f in futures]
        wall = time.perf_counter() - start
    after = httpx.get(f"{url}/health", timeout=args.timeout).json()
    latency = np.array([r["latency"] for r in results])
    first = np.array([r["first_chunk"] for r in results])
    batches = after["batches"] - before["batches"]
    return {
        "concurrency": clients if rate is None else None,
        "rate": rate,
        "requests": len(results),
        "seconds": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "latency_p50": float(np.percentile(latency, 50)),
        "latency_p95": float(np.percentile(latency, 95)),
        "first_chunk_p50": float(np.percentile(first, 50)),
        "first_chunk_p95": float(np.percentile(first, 95)),
        "batches": batches,
        "mean_batch": (after["block_rows"] - before["block_rows"])
        / max(after["block_calls"] - before["block_calls"], 1),
        "block_calls": after["block_calls"] - before["block_calls"],
        "compiles": after["compiles"] - before["compiles"],
    }


def level_name(row: dict) -> str:
    return f"{row['concurrency']} clients" if row["rate"] is None else f"{row['rate']:g}/s arrivals"


def table(rows: list[dict]) -> str:
    """One line per (batching mode, level); "vs one at a time" against the mode's own 1-client level."""
    lines = [
        "| batching | load | requests/s | output tokens/s | vs one at a time | p50 latency s | p95 latency s "
        "| p50 first chunk s | p95 first chunk s | mean batch | block calls per request |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        base = next(b for b in rows if b["batching"] == r["batching"] and b["concurrency"] == 1)
        lines.append(
            f"| {r['batching']} | {level_name(r)} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} "
            f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['latency_p50']:.3f} | {r['latency_p95']:.3f} "
            f"| {r['first_chunk_p50']:.3f} | {r['first_chunk_p95']:.3f} | {r['mean_batch']:.1f} "
            f"| {r['block_calls'] / r['requests']:.2f} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def started_server(serve_args: str, cpus: set[int] | None = None):
    """``python -m psd_jax.serve`` on a free 127.0.0.1 port (on ``cpus`` only, if given), until the
    block ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "psd_jax.serve", "--port", str(port), "--log-level", "warning"]
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    process = subprocess.Popen(command + shlex.split(serve_args), preexec_fn=pin)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise SystemExit(f"error: the server exited with code {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the server did not start in {START_TIMEOUT_S} s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _numbers(text: str | None, kind) -> list:
    return [kind(t) for t in (text or "").split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        levels = sorted({1, *_numbers(args.concurrency, positive_int)})
        rates = _numbers(args.rate, float)
        args.lengths = _numbers(args.max_tokens_mix, positive_int)
        body = json.loads(args.extra)
        server_cpus = set(_numbers(args.server_cpus, int)) or None
        client_cpus = set(_numbers(args.client_cpus, int)) or None
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(f"--concurrency, --rate, --max-tokens-mix, --extra or the CPU lists: {exc}")
    if not isinstance(body, dict):
        parser.error("--extra must be a JSON object")
    if any(not r > 0 for r in rates):
        parser.error(f"--rate values must be positive, got {args.rate}")
    modes = [m.strip() for m in (args.batching or "").split(",") if m.strip()] or [None]
    if modes != [None] and args.serve is None:
        parser.error("--batching needs --serve (it starts one server per mode)")
    if server_cpus is not None and args.serve is None:
        parser.error("--server-cpus needs --serve")
    available = os.sched_getaffinity(0)
    for name, cpus in (("--server-cpus", server_cpus), ("--client-cpus", client_cpus)):
        if cpus is not None and not cpus <= available:
            parser.error(
                f"{name}: CPUs {sorted(cpus - available)} are not available (this process may use {sorted(available)})"
            )
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    prompts = load_prompts(args.prompts, args.requests)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
    rows = []
    for mode in modes:
        serve = None if args.serve is None else args.serve + ("" if mode is None else f" --batching {mode}")
        with started_server(serve, server_cpus) if serve is not None else contextlib.nullcontext(args.url) as url:
            model = httpx.get(f"{url}/v1/models", timeout=args.timeout).json()["data"][0]["id"]
            measured = [run_level(url, model, prompts, c, body, args) for c in levels]
            measured += [run_level(url, model, prompts, 1, body, args, rate) for rate in rates]
        rows += [{"batching": mode or "server's", **row} for row in measured]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"server": args.serve, "extra": body, "levels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
