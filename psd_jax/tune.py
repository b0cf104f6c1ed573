"""``python -m psd_jax.tune --model DIR --data dev.jsonl``: the decoding setting with the fewest model
calls whose accuracy stays within ``--max-loss`` points of a base setting (``psd_jax.tuning``;
docs/tuning.md)."""

from __future__ import annotations

import sys

from .tuning.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
