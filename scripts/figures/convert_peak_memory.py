"""Peak host memory (and time) of ``python -m convert`` on a full-size random checkpoint.

Why: the converter promises "peak host memory is one stacked parameter, not the model twice";
this measures it on a checkpoint with the real LLaDA-8B key names, shapes and shard files
(from ``model.safetensors.index.json``), without downloading anything.

The generator writes each safetensors shard by hand, tensor by tensor in small chunks from a
fixed pool of random bf16 values, so it never holds more than a few MB. The converter runs in a
child process whose own peak RSS comes from ``os.wait4``; the child is made the OOM killer's
first choice and a watchdog kills it if the machine runs low on memory. The checkpoint and the
converter's output are always deleted. ``--quantize int8|int4`` converts the same checkpoint a
second time with ``--quantize`` and reports both runs.

    python -m scripts.figures.convert_peak_memory [--hf-config-dir DIR] [--n-layers N] [--golden DIR] [--json PATH]
        [--quantize int8|int4]

Its figures are in docs/memory-and-scaling.md and docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from convert.keys import expected_keys
from convert.orbax_io import SIDE_FILES
from models import config_from_dict

REPO = Path(__file__).resolve().parents[2]

DEFAULT_HF = REPO.parent / "shared" / "hf-configs" / "LLaDA-8B-Instruct"
INDEX = "model.safetensors.index.json"
CHUNK = 1 << 22  # bf16 values written per chunk (8 MB)
MIN_AVAILABLE = 1 << 30  # kill the converter when the machine has less than 1 GiB left


def bf16_pool(size: int = CHUNK, seed: int = 0) -> np.ndarray:
    """``size`` random N(0, 0.02) values as bf16 bit patterns (uint16): the cheap generator."""
    x = (0.02 * np.random.default_rng(seed).standard_normal(size)).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pool: np.ndarray, salt: int) -> int:
    """A safetensors file of bf16 tensors written chunk by chunk (header first, then data)."""
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i, (_, shape) in enumerate(tensors):
            left, shift = int(np.prod(shape)), (salt * 7919 + i * 104729) % len(pool)
            while left:
                n = min(left, len(pool) - shift)
                f.write(pool[shift : shift + n].tobytes())
                left, shift = left - n, 0
    return offset


def make_checkpoint(hf_dir: Path, out: Path, n_layers: int | None) -> dict:
    """Random checkpoint with ``hf_dir``'s config, key names, shapes and shard files."""
    config = json.loads((hf_dir / "config.json").read_text())
    if n_layers is not None:  # smoke test: fewer layers, same everything else
        config["n_layers" if "n_layers" in config else "num_hidden_layers"] = n_layers
    cfg = config_from_dict(config, str(hf_dir / "config.json"))
    keys = expected_keys(cfg)
    weight_map = {k: v for k, v in json.loads((hf_dir / INDEX).read_text())["weight_map"].items() if k in keys}
    if set(weight_map) != set(keys):
        raise SystemExit(
            f"{hf_dir / INDEX} does not list the key table's tensors: {sorted(set(keys) ^ set(weight_map))[:5]}"
        )
    out.mkdir(parents=True)
    for name in SIDE_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    pool, total = bf16_pool(), 0
    files = sorted(set(weight_map.values()))
    for salt, file in enumerate(files):
        tensors = [(k, keys[k].source_shape) for k in sorted(weight_map) if weight_map[k] == file]
        total += write_shard(out / file, tensors, pool, salt)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return {
        "params": cfg.param_count(),
        "bytes": total,
        "files": len(files),
        "tensors": len(keys),
        "layers": cfg.n_layers,
    }


def _lowest_priority() -> None:
    """In the child: be the OOM killer's first victim (a training job may share this machine)."""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")


def run_converter(hf_dir: Path, out: Path, quantize: str | None = None) -> dict:
    """``python -m convert`` in a child; its own peak RSS (wait4) and wall time."""
    cmd = [sys.executable, "-m", "convert", "--hf-dir", str(hf_dir), "--out", str(out), "--dtype", "bfloat16"]
    cmd += ["--quantize", quantize] if quantize else []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_lowest_priority
    )
    low = {"min_available": psutil.virtual_memory().available, "killed": False}

    def watchdog() -> None:
        while proc.returncode is None:
            avail = psutil.virtual_memory().available
            low["min_available"] = min(low["min_available"], avail)
            if avail < MIN_AVAILABLE:
                low["killed"] = True
                os.kill(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    threading.Thread(target=watchdog, daemon=True).start()
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    out_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
    return {
        "returncode": proc.returncode,
        "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        "seconds": round(seconds, 1),
        "output_bytes": out_bytes,
        "min_machine_available_bytes": low["min_available"],
        "killed_by_watchdog": low["killed"],
        "output_tail": output[-1500:],
    }


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hf-config-dir", type=Path, default=DEFAULT_HF, help="config.json + model.safetensors.index.json"
    )
    parser.add_argument("--n-layers", type=int, default=None, help="fewer layers (smoke test); default: the config's")
    parser.add_argument(
        "--golden", type=Path, default=None, help="also convert this small HF checkpoint, for comparison"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the temporary checkpoint goes (default: $TMPDIR)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quantize", choices=("int8", "int4"), help="also convert with --quantize")
    args = parser.parse_args()
    report: dict = {"total_ram_bytes": psutil.virtual_memory().total}
    work = Path(tempfile.mkdtemp(prefix="convert_peak_", dir=args.workdir))
    try:
        if args.golden is not None:
            report["golden"] = {"source": str(args.golden), **run_converter(args.golden, work / "golden_out")}
        start = time.perf_counter()
        report["checkpoint"] = make_checkpoint(args.hf_config_dir, work / "hf", args.n_layers)
        report["checkpoint"]["write_seconds"] = round(time.perf_counter() - start, 1)
        report["convert"] = run_converter(work / "hf", work / "out")
        shutil.rmtree(work / "out", ignore_errors=True)
        if args.quantize:
            report["convert_quantized"] = run_converter(work / "hf", work / "out", args.quantize)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ck, cv = report["checkpoint"], report["convert"]
    print(
        f"checkpoint: {ck['params']:,} params, {gib(ck['bytes'])} in {ck['files']} files, {ck['layers']} layers, written in {ck['write_seconds']} s"
    )
    print(
        f"convert: rc={cv['returncode']} peak RSS {gib(cv['peak_rss_bytes'])} ({cv['peak_rss_bytes'] / ck['bytes']:.2f}x the checkpoint), "
        f"{cv['seconds']} s, output {gib(cv['output_bytes'])}, machine RAM {gib(report['total_ram_bytes'])}, "
        f"lowest available {gib(cv['min_machine_available_bytes'])}{' KILLED (low memory)' if cv['killed_by_watchdog'] else ''}"
    )
    if "convert_quantized" in report:
        cq = report["convert_quantized"]
        print(
            f"convert --quantize {args.quantize}: rc={cq['returncode']} peak RSS {gib(cq['peak_rss_bytes'])} "
            f"({cq['peak_rss_bytes'] / ck['bytes']:.2f}x the checkpoint), {cq['seconds']} s, output {gib(cq['output_bytes'])}, "
            f"lowest available {gib(cq['min_machine_available_bytes'])}{' KILLED (low memory)' if cq['killed_by_watchdog'] else ''}"
        )
    if "golden" in report:
        g = report["golden"]
        print(f"golden {g['source']}: rc={g['returncode']} peak RSS {gib(g['peak_rss_bytes'])}, {g['seconds']} s")
    runs = [cv, *([report["convert_quantized"]] if "convert_quantized" in report else [])]
    for run in runs:
        if run["returncode"] != 0:
            print(run["output_tail"], file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(run["returncode"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
