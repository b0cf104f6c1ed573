"""``python -m convert --hf-dir DIR --out DIR [--dtype bfloat16]``: HF safetensors -> Orbax."""

from __future__ import annotations

import argparse
import sys

from .hf import load_hf_params
from .orbax_io import save_params
from .safetensors_dir import CheckpointError
from models import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert", description=__doc__)
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory for the Orbax checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    try:
        # Host arrays straight from the stream into Orbax: no second copy as JAX buffers.
        cfg, params = load_hf_params(args.hf_dir, args.dtype, place=lambda name, host: host)
        out = save_params(params, args.dtype, args.hf_dir, args.out)
    except (CheckpointError, ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({cfg.family}, {cfg.param_count():,} parameters, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
