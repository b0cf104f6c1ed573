"""``$OUT/device_check.json`` and ``$OUT/device_check.md`` from the parts the steps of
``scripts/device/check.py`` wrote, with the targets beside the measurements.

``scripts/device_check.sh`` runs this after every step (``--step NAME --exit RC --seconds S``
records how the step ended), so the two files always hold every step finished so far. Needs
neither JAX nor torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.device.check import GPU, STEPS, TARGET_JAX_OVER_TORCH, TARGET_MFU, TINY, rows

EXIT_MEANING = {0: "ok", 124: "ran out of its time limit", 137: "killed at its time limit"}


def load_parts(out: Path) -> tuple[dict, dict]:
    parts = {}
    for step in STEPS:
        path = out / "parts" / f"{step}.json"
        if path.is_file():
            try:
                parts[step] = json.loads(path.read_text())
            except json.JSONDecodeError as exc:  # cannot happen (written atomically); kept readable
                parts[step] = {"step": step, "error": f"unreadable part: {exc}", "rows": []}
    status_file = out / "parts" / "status.json"
    status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    return parts, status


def record_status(out: Path, step: str, code: int, seconds: float) -> None:
    path = out / "parts" / "status.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    status = json.loads(path.read_text()) if path.is_file() else {}
    status[step] = {"exit": code, "seconds": seconds, "meaning": EXIT_MEANING.get(code, "failed")}
    path.write_text(json.dumps(status, indent=1) + "\n")


def build(out: Path) -> dict:
    parts, status = load_parts(out)
    tiny = any(p.get("tiny") for p in parts.values())
    prof = TINY if tiny else GPU
    report = {
        "profile": prof.name,
        "tiny": tiny,
        "env": parts.get("env", {}).get("info", {}),
        "status": status,
        "steps": parts,
        "decode_rows": [r["key"] for r in rows(prof)],
    }
    report["targets"] = targets(report, prof)
    return report


def by_key(part: dict | None) -> dict:
    return {r["key"]: r for r in (part or {}).get("rows", []) if "key" in r}


def forward_row(report: dict, shape: tuple[int, int]) -> dict | None:
    for r in report["steps"].get("forward", {}).get("rows", []):
        if r.get("shape") == list(shape):
            return r
    return None


def targets(report: dict, prof) -> list[dict]:
    """The two targets, each with what was measured and whether it is met (None: not measurable)."""
    out = []
    fwd = forward_row(report, prof.forward_target)
    shape = f"[{prof.forward_target[0]}, {prof.forward_target[1]}]"
    peak = report["steps"].get("forward", {}).get("peak_flops")
    name = f"forward {shape} >= {100 * TARGET_MFU:.0f}% of the H200 bfloat16 dense peak (989 TFLOP/s)"
    if fwd is None or "mfu" not in fwd:
        out.append({"target": name, "measured": "not measured", "met": None})
    elif fwd["mfu"] is None:
        measured = f"{fwd['tflops_per_second']:.2f} TFLOP/s; no peak known for this device"
        out.append({"target": name, "measured": measured, "met": None})
    else:
        measured = f"{100 * fwd['mfu']:.1f}% ({fwd['tflops_per_second']:.0f} TFLOP/s of {peak / 1e12:.0f})"
        out.append({"target": name, "measured": measured, "met": fwd["mfu"] >= TARGET_MFU})
    out.append(torch_target(report, prof))
    return out


def torch_target(report: dict, prof) -> dict:
    name = (
        f"JAX >= {TARGET_JAX_OVER_TORCH}x PyTorch eager tokens/s, every decoder, batch "
        f"{' and '.join(map(str, prof.batches))}, cache none and dual (threshold also dual with its window)"
    )
    got = by_key(report["steps"].get("torch"))
    ratios, missing = {}, []
    for row in rows(prof):
        torch_row = got.get(row["key"], {}).get("backends", {}).get("torch", {})
        if "jax_over_this" in torch_row:
            ratios[row["key"]] = torch_row["jax_over_this"]
        else:
            missing.append(row["key"])
    met = sum(r >= TARGET_JAX_OVER_TORCH for r in ratios.values())
    measured = f"{met} of {len(rows(prof))} rows"
    if ratios:
        low = min(ratios, key=ratios.get)
        measured += f"; lowest {ratios[low]:.2f}x ({low})"
    if missing:
        measured += f"; not measured: {', '.join(missing)}"
    return {"target": name, "measured": measured, "met": met == len(rows(prof)), "ratios": ratios}


# ---------------------------------------------------------------------------------- Markdown


def verdict(met) -> str:
    return {True: "met", False: "**not met**", None: "n/a"}[met]


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"# device_check: {report['profile']}", ""]
    if report["tiny"]:
        lines += ["TINY run: a toy model on the CPU; it checks the steps, its speeds mean nothing.", ""]
    lines += [
        f"Device {env.get('device_kind', '?')} ({env.get('gpu') or 'no CUDA'}); jax {env.get('jax', '?')}, "
        f"flax {env.get('flax', '?')}, torch {env.get('torch', '?')}; commit {env.get('commit') or '?'}.",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {t['target']} | {t['measured']} | {verdict(t['met'])} |" for t in report["targets"]]
    lines += ["", "| step | how it ended | seconds | rows |", "| --- | --- | ---: | ---: |"]
    for step in STEPS:
        st, part = report["status"].get(step), report["steps"].get(step)
        ended = "not run" if st is None else f"exit {st['exit']}: {st['meaning']}"
        if part and part.get("error"):
            ended += f" ({part['error'][:160]})"
        seconds = "" if st is None else f"{st['seconds']:.0f}"
        lines.append(f"| {step} | {ended} | {seconds} | {len((part or {}).get('rows', []))} |")
    lines += forward_table(report) + jax_table(report) + torch_table(report) + int8_table(report)
    return "\n".join(lines) + "\n"


def forward_table(report: dict) -> list[str]:
    part = report["steps"].get("forward", {})
    lines = [
        "",
        f"Bare forward (logits of every position), {part.get('params', 0) / 1e6:,.1f}M parameters; FLOPs = 2 x "
        "weights x tokens (the embedding table excluded) + attention; median of the timed calls.",
        "",
        "| [batch, length] | tokens | compile s | ms | TFLOP/s | MFU | FLOPs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in part.get("rows", []):
        if "skipped" in r:
            lines.append(f"| {r['shape']} | skipped: {r['skipped']} | | | | | |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['compile_seconds']:.1f} | {1e3 * r['seconds']:.2f} | "
            f"{r['tflops_per_second']:.2f} | {mfu} | {r['flops']['total']:.3g} |"
        )
    return lines


def cell(row: dict | None, name: str, fmt) -> str:
    """One backend's value in a row, or why there is none."""
    if row is None:
        return "not run"
    if not row:
        return "-"  # not a row of this step
    if "skipped" in row:
        return f"skipped ({row['skipped']})"
    if "error" in row:
        return f"failed: {row['error']}"
    b = row.get("backends", {}).get(name)
    if b is None:
        return "-"
    if "error" in b:
        return f"failed: {b['error']}"
    return fmt(b)


def rate(b: dict) -> str:
    return f"{b['tokens_per_second']:.1f}"


def ratio(b: dict) -> str:
    return f"{b['jax_over_this']:.2f}x" if "jax_over_this" in b else ""


def jax_table(report: dict) -> list[str]:
    prof = TINY if report["tiny"] else GPU
    got = by_key(report["steps"].get("jax_decode"))
    lines = [
        "",
        f"JAX decodes: gen {prof.gen_length}, block {prof.block_length}, prompts of {prof.prompt_length} random "
        "tokens; TPF = tokens per model call.",
        "",
        "| decoder | cache | batch | tokens/s | TPF | NFE/prompt | compile s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows(prof):
        r = got.get(row["key"])
        speed = cell(r, "jax", rate)
        rest = cell(r, "jax", lambda b: f"{b['tpf']:.2f} | {b['nfe_per_prompt']:.1f} | {b['compile_seconds']:.1f}")
        rest = rest if "|" in rest else " | "
        lines.append(f"| {row['decoder']} | {row['cache']} | {row['batch']} | {speed} | {rest} |")
    return lines


def torch_table(report: dict) -> list[str]:
    prof = TINY if report["tiny"] else GPU
    eager, compiled = by_key(report["steps"].get("torch")), by_key(report["steps"].get("torch_compile"))
    target = TARGET_JAX_OVER_TORCH
    lines = [
        "",
        "JAX against PyTorch on the same weights and prompts, passes interleaved; JAX / this = median of the "
        "per-pass ratios of tokens/s. torch.compile rows come from the torch_compile step"
        + (
            f" (torch.compile backend {backend!r}: dynamo's graphs run eagerly)."
            if (backend := report["steps"].get("torch_compile", {}).get("torch_compile_backend"))
            else "."
        ),
        "",
        f"| decoder | cache | batch | JAX tokens/s | torch eager tokens/s | JAX / eager | >= {target}x "
        "| same tokens | torch.compile tokens/s | JAX / torch.compile | torch.compile compile s |",
        "| --- | --- | ---: | ---: | ---: | ---: | :---: | :---: | ---: | ---: | ---: |",
    ]
    in_compile_step = {r["key"] for r in rows(prof)[: prof.compile_rows]}
    for row in rows(prof):
        e, c = eager.get(row["key"]), compiled.get(row["key"], None if row["key"] in in_compile_step else {})
        cells = [
            cell(e, "jax", rate),
            cell(e, "torch", rate),
            cell(e, "torch", ratio),
            cell(
                e,
                "torch",
                lambda b: "" if "jax_over_this" not in b else "yes" if b["jax_over_this"] >= target else "**no**",
            ),
            cell(e, "torch", lambda b: {True: "yes", False: "no"}.get(b.get("same_tokens_as_jax"), "")),
            cell(c, "torch.compile", rate),
            cell(c, "torch.compile", ratio),
            cell(c, "torch.compile", lambda b: f"{b['compile_seconds']:.1f}"),
        ]
        lines.append(f"| {row['decoder']} | {row['cache']} | {row['batch']} | " + " | ".join(cells) + " |")
    return lines


def int8_table(report: dict) -> list[str]:
    prof = TINY if report["tiny"] else GPU
    part = report["steps"].get("int8", {})
    got = by_key(part)
    sizes, dtype = part.get("weight_bytes", {}), prof.dtype
    weights = (
        f" Weights on the device: {dtype} {sizes[dtype] / 1e9:.3g} GB, int8 {sizes['int8'] / 1e9:.3g} GB."
        if sizes
        else ""
    )
    lines = [
        "",
        f"int8 weights (the layers' projections, models.quantize) against {dtype} on the same weights and prompts, "
        f"passes interleaved; int8 / {dtype} = the inverse of the median per-pass ratio.{weights}",
        "",
        f"| decoder | cache | batch | {dtype} tokens/s | int8 tokens/s | int8 / {dtype} | TPF {dtype} | TPF int8 "
        f"| NFE/prompt {dtype} | NFE/prompt int8 | int8 compile s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows(prof):
        if row["key"] not in prof.int8_rows:
            continue
        r = got.get(row["key"])
        cells = [
            cell(r, "jax", rate),
            cell(r, "jax int8", rate),
            cell(r, "jax int8", lambda b: f"{1 / b['jax_over_this']:.2f}x" if "jax_over_this" in b else ""),
            *(cell(r, name, lambda b: f"{b['tpf']:.2f}") for name in ("jax", "jax int8")),
            *(cell(r, name, lambda b: f"{b['nfe_per_prompt']:.1f}") for name in ("jax", "jax int8")),
            cell(r, "jax int8", lambda b: f"{b['compile_seconds']:.1f}"),
        ]
        lines.append(f"| {row['decoder']} | {row['cache']} | {row['batch']} | " + " | ".join(cells) + " |")
    return lines


def write(out: Path) -> dict:
    report = build(out)
    (out / "device_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "device_check.md").write_text(markdown(report))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--step", choices=STEPS, help="record how this step ended")
    p.add_argument("--exit", type=int, default=0, dest="code")
    p.add_argument("--seconds", type=float, default=0.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.step:
        record_status(out, args.step, args.code, args.seconds)
    write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
