"""The server under load on an accelerator: LLaDA-8B's shape behind the OpenAI-compatible server.

The model is ``scripts/device_check``'s (random bfloat16 weights made on the device, the layers a
``lax.scan``), served in this process by ``psd_jax.serve.build_app`` under uvicorn on a free
127.0.0.1 port, and loaded by ``scripts/tools/load_generator``'s closed loop (streamed requests, one
unmeasured round per level, then ``--requests`` measured ones) with token-id prompts of random ids
and ``max_tokens`` mixed over 64/128/256. Rows, most important first:

- threshold 0.9 with the dual cache, continuous then static batching, at 32, 8 and 1 clients
  (compiled batch sizes 1, 8 and 32; the first block of rows compiles every program the others use);
- PSD over it (depth 3) the same way, as time allows.

Each row reports requests/s, output tokens/s, p50/p95 latency and first chunk, the mean rows per
block call and the ratio to one client at a time of the same mode. Rows are written to
``OUT/serve_check.json`` and ``OUT/serve_check.md`` as they finish; a row that would start after
``--deadline`` seconds is recorded as skipped. ``TINY=1`` runs the toy shape on the CPU (gen 32,
block 16, fewer requests), which is what the test suite checks.

    python -m scripts.device.serve_check --out /tmp/dc --deadline 150
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from scripts.device import check as device_check
from scripts.tools import load_generator

SIZES = (1, 8, 32)
CLIENTS = (32, 8, 1)
MIX = (64, 128, 256)  # max_tokens of the requests (the TINY profile: 16 and 32)
SETTINGS = {
    "threshold-0.9/dual": {"policy": "threshold", "threshold": 0.9, "cache": "dual"},
    "psd-threshold-0.9-d3/dual": {"policy": "threshold", "threshold": 0.9, "cache": "dual", "decoder": "psd"},
}
BATCHING = ("continuous", "static")


def write(out: Path, rows: list[dict], meta: dict) -> None:
    (out / "serve_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "| settings | batching | clients | requests/s | output tokens/s | vs 1 client | p50 / p95 latency s "
        "| p50 / p95 first chunk s | mean rows per block call |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['settings']} | {r['batching']} | {r['clients']} | {r.get('skipped', r.get('error'))} |")
            continue
        one = next(
            (
                b
                for b in rows
                if b.get("tokens_per_s")
                and b["settings"] == r["settings"]
                and b["batching"] == r["batching"]
                and b["clients"] == 1
            ),
            None,
        )
        ratio = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one else "–"
        lines.append(
            f"| {r['settings']} | {r['batching']} | {r['clients']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {ratio} | {r['latency_p50']:.2f} / {r['latency_p95']:.2f} "
            f"| {r['first_chunk_p50']:.2f} / {r['first_chunk_p95']:.2f} | {r['mean_batch']:.1f} |"
        )
    (out / "serve_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.device.serve_check", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--deadline", type=float, default=1e9, help="seconds: start no row after this")
    p.add_argument("--requests", type=int, help="measured requests per row (default: 64 on the GPU, 8 TINY)")
    args = p.parse_args(argv)
    began = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    from psd_jax import DecodeConfig
    from psd_jax.serve import build_app
    from psd_jax.serve.server import serving_in_thread

    prof = device_check.profile()
    tiny = prof is device_check.TINY
    lm = device_check.jax_model(prof)
    mix = [16, 32] if tiny else list(MIX)
    sizes = (1, 2) if tiny else SIZES
    requests = args.requests or (8 if tiny else 64)
    prompts = device_check.prompts(lm.config, requests, prof.prompt_length)
    options = SimpleNamespace(lengths=mix, seed=0, timeout=300.0, max_seconds=600.0)
    meta = {"profile": prof.name, "sizes": sizes, "max_tokens_mix": mix, "requests": requests}
    rows: list[dict] = []
    for name, fields in SETTINGS.items():
        defaults = DecodeConfig(gen_length=max(mix), block_length=prof.block_length, **fields)
        for mode in BATCHING:
            clients = (2, 1) if tiny else CLIENTS
            selected = [{"settings": name, "batching": mode, "clients": c} for c in clients]
            if time.time() - began > args.deadline:
                rows += [{**r, "skipped": "step deadline"} for r in selected]
                write(args.out, rows, meta)
                continue
            app = build_app(
                lm,
                defaults,
                name="llada-8b-random",
                batch_sizes=sizes,
                prompt_bucket=prof.prompt_length,
                warmup_lengths=(prof.prompt_length,),
                batching=mode,
                max_wait_ms=5.0,
            )
            try:
                with serving_in_thread(app, start_timeout_s=600) as url:
                    for row in selected:
                        if time.time() - began > args.deadline:
                            rows.append({**row, "skipped": "step deadline"})
                            continue
                        measured = load_generator.run_level(
                            url, "llada-8b-random", prompts, row["clients"], {}, options
                        )
                        rows.append({**row, **measured})
                        write(args.out, rows, meta)
            except Exception as exc:  # a failing configuration records its error; the next one runs
                rows.append(
                    {"settings": name, "batching": mode, "clients": None, "error": device_check.error_text(exc)}
                )
            write(args.out, rows, meta)
    print((args.out / "serve_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
