"""Load generator for ``python -m psd_jax.serve``: C concurrent clients send a fixed number of
streamed completion requests and it reports requests/s, output tokens/s, p50/p95 latency and time
to first chunk, next to the same prompts sent one at a time (C = 1).

    python -m scripts.load_generator --url http://127.0.0.1:8000 --concurrency 1,4,16 --requests 64
    python -m scripts.load_generator --serve "--policy threshold --max-batch 16" --concurrency 1,4,16

``--serve ARGS`` starts the server itself (``python -m psd_jax.serve ARGS`` on a free 127.0.0.1
port), waits for it and stops it at the end. Every level first sends one unmeasured round of C
requests, so measurements see no compilation. Bounded: ``--requests`` per level, a timeout per
request and ``--max-seconds`` per level. Prompts are the questions of a jsonl (default: the
shipped model's held-out set), taken in order and repeated if needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

from psd_jax.flags import ArgumentParser, positive_int

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "models" / "default" / "test.jsonl"
START_TIMEOUT_S = 600  # start-up compiles the default settings


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m scripts.load_generator", description=__doc__)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    where.add_argument("--serve", metavar="ARGS", help="start python -m psd_jax.serve ARGS and measure it")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (1 is always run)")
    p.add_argument("--requests", type=positive_int, default=64, help="measured requests per concurrency level")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="jsonl with a question field per line")
    p.add_argument("--max-tokens", type=positive_int, help="max_tokens of every request (default: the server's)")
    p.add_argument("--extra", default="{}", help='JSON object of extra body fields, e.g. \'{"decoder": "psd"}\'')
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--max-seconds", type=float, default=900.0, help="seconds per concurrency level")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def load_prompts(path: Path, n: int) -> list[str]:
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]
    return [questions[i % len(questions)] for i in range(n)]


def one_request(api: openai.OpenAI, model: str, prompt: str, body: dict) -> dict:
    """One streamed completion: latency, time to first chunk, output tokens."""
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


def run_level(url: str, model: str, prompts: list[str], clients: int, body: dict, args) -> dict:
    """``clients`` threads share the requests; one unmeasured round first."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    send = lambda p: one_request(api, model, p, body)  # noqa: E731
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(send, prompts[:clients]))
        before = httpx.get(f"{url}/health", timeout=args.timeout).json()
        start = time.perf_counter()
        futures = [pool.submit(send, p) for p in prompts]
        results = [f.result(timeout=max(args.max_seconds - (time.perf_counter() - start), 1)) for f in futures]
        wall = time.perf_counter() - start
    after = httpx.get(f"{url}/health", timeout=args.timeout).json()
    latency = np.array([r["latency"] for r in results])
    first = np.array([r["first_chunk"] for r in results])
    batches = after["batches"] - before["batches"]
    return {
        "concurrency": clients,
        "requests": len(results),
        "seconds": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "latency_p50": float(np.percentile(latency, 50)),
        "latency_p95": float(np.percentile(latency, 95)),
        "first_chunk_p50": float(np.percentile(first, 50)),
        "first_chunk_p95": float(np.percentile(first, 95)),
        "batches": batches,
        "mean_batch": (after["rows"] - before["rows"]) / max(batches, 1),
        "compiles": after["compiles"] - before["compiles"],
    }


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| clients | requests/s | output tokens/s | vs one at a time | p50 latency s | p95 latency s "
        "| p50 first chunk s | p95 first chunk s | mean batch |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} "
            f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['latency_p50']:.3f} | {r['latency_p95']:.3f} "
            f"| {r['first_chunk_p50']:.3f} | {r['first_chunk_p95']:.3f} | {r['mean_batch']:.1f} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def started_server(serve_args: str):
    """``python -m psd_jax.serve`` on a free 127.0.0.1 port, until the block ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "psd_jax.serve", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command + shlex.split(serve_args))
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        levels = sorted({1, *(positive_int(c) for c in args.concurrency.split(",") if c.strip())})
        body = json.loads(args.extra)
    except (argparse.ArgumentTypeError, json.JSONDecodeError) as exc:
        parser.error(f"--concurrency or --extra: {exc}")
    if not isinstance(body, dict):
        parser.error("--extra must be a JSON object")
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    prompts = load_prompts(args.prompts, args.requests)
    with started_server(args.serve) if args.serve is not None else contextlib.nullcontext(args.url) as url:
        model = httpx.get(f"{url}/v1/models", timeout=args.timeout).json()["data"][0]["id"]
        rows = [run_level(url, model, prompts, c, body, args) for c in levels]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"server": args.serve, "extra": body, "levels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
