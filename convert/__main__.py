"""``python -m convert --hf-dir DIR --out DIR [--dtype bfloat16]``: HF safetensors -> Orbax."""

from __future__ import annotations

import argparse
import sys

from models import ConfigError, load_config

from .hf import iter_params
from .orbax_io import save_params
from .safetensors_dir import CheckpointError, SafetensorsDir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert", description=__doc__)
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory for the Orbax checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    try:
        # Each parameter goes from the safetensors stream to its Orbax item and is dropped.
        cfg = load_config(args.hf_dir)
        with SafetensorsDir(args.hf_dir) as reader:
            out = save_params(iter_params(reader, cfg, args.dtype), args.dtype, args.hf_dir, args.out)
    except (CheckpointError, ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({cfg.family}, {cfg.param_count():,} parameters, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
