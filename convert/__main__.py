"""``python -m convert --hf-dir DIR --out DIR [--dtype bfloat16] [--quantize int8|int4]``: HF safetensors -> Orbax.

``--out`` must not exist yet or be an empty directory (which is replaced); it may not be
``--hf-dir`` or contain it. The checkpoint is written into a hidden sibling of ``--out`` and renamed
to ``--out`` once complete, so a failed or interrupted run leaves no ``--out`` and can simply be
rerun. Each parameter goes from the safetensors stream to its Orbax item and is dropped (one
parameter in host memory at a time). ``--quantize`` writes the layers' projections as their
integers and scales (``models.quantize``, each quantized on the host as it streams past), and the
checkpoint then loads quantized without quantizing again.

Exit status: 0 written; 2 bad input, found before any parameter is written (a flag, an unreadable
or invalid ``--hf-dir``, an ``--out`` that exists, is not empty, or cannot be created); 1 the write
failed part-way (disk full, an I/O error), the partial output removed. Each error is one line.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from models import ConfigError, load_config
from models.config import DTYPE_NAMES
from models.quantize import QUANTIZE, is_projection, quantized_on_host

from .args import EXIT_BAD_INPUT, ArgumentParser
from .hf import iter_params
from .orbax_io import OutputDirError, check_out_dir, save_params
from .safetensors_dir import CheckpointError, SafetensorsDir

EXIT_WRITE_FAILED = 1


def check_paths(hf_dir: str, out_dir: str) -> tuple[Path, Path]:
    """``(hf_dir, out_dir)`` resolved, checked before anything is read: a missing ``--hf-dir`` is a
    ``CheckpointError``, an ``--out`` that may not be written an ``OutputDirError``. ``--out`` inside ``--hf-dir`` is allowed: the converter only
    adds a directory there and reads the source's files by name."""
    source = Path(hf_dir).resolve()
    if not source.exists():
        raise CheckpointError(f"--hf-dir {source}: no such directory")
    if not source.is_dir():
        raise CheckpointError(f"--hf-dir {source}: not a directory")
    out = Path(out_dir).resolve()
    if out == source:
        raise OutputDirError(f"--out {out} is the --hf-dir; choose a separate output directory")
    if source.is_relative_to(out):
        raise OutputDirError(f"--out {out} contains the --hf-dir {source}; choose a separate output directory")
    try:
        return source, check_out_dir(out)
    except OutputDirError as exc:
        raise OutputDirError(f"--out {exc}") from exc


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _os_reason(exc: OSError) -> str:
    """``reason (file)``: the OS's words for the error, then the file it names, if any."""
    return (exc.strerror or str(exc)) + (f" ({exc.filename})" if exc.filename else "")


@contextlib.contextmanager
def _orbax_errors_unlogged():
    """Orbax's background threads log a failed write as several ERROR tracebacks (each with
    TensorStore's kilobytes-long spec) before the save raises; the converter reports the failure
    itself in one line, so those logs are held back while it writes."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        absl.setLevel(level)


def quantized(params: Iterator[tuple[str, np.ndarray]], quantize: str) -> Iterator[tuple[str, object]]:
    """``params`` with each projection quantized on the host as it passes (one at a time)."""
    for name, value in params:
        yield name, quantized_on_host(value, quantize) if is_projection(name) else value
        del value


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory for the Orbax checkpoint (new or empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    parser.add_argument(
        "--quantize", choices=QUANTIZE, help="store the projections quantized (weight-only, models.quantize)"
    )
    args = parser.parse_args(argv)
    try:
        hf_dir, out = check_paths(args.hf_dir, args.out)
        cfg = load_config(hf_dir)
        reader = SafetensorsDir(hf_dir)  # every header checked here
    except (OutputDirError, CheckpointError, ConfigError) as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:
        return _fail(f"cannot read --hf-dir {args.hf_dir}: {_os_reason(exc)}", EXIT_BAD_INPUT)
    with reader, _orbax_errors_unlogged():
        try:
            params = iter_params(reader, cfg, args.dtype)  # the key set and shapes are checked here
            if args.quantize:
                params = quantized(params, args.quantize)
            save_params(params, args.dtype, hf_dir, out, args.quantize)
        except OutputDirError as exc:
            return _fail(f"--out {exc}", EXIT_BAD_INPUT)
        except (CheckpointError, ConfigError) as exc:
            return _fail(str(exc), EXIT_BAD_INPUT)
        except OSError as exc:
            return _fail(f"writing {out} failed: {exc.strerror or exc}; nothing was kept", EXIT_WRITE_FAILED)
    stored = f", projections {args.quantize}" if args.quantize else ""
    print(f"wrote {out} ({cfg.family}, {cfg.param_count():,} parameters, {args.dtype}{stored})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
