"""``python -m psd_jax.tune --data dev.jsonl``: the decoding setting that answers fastest on a device
(measured here or modeled for a named target) while its accuracy stays within ``--max-loss`` points
of a base setting (``psd_jax.tuning``; docs/tuning.md)."""

import sys

from .tuning.cli import main

if __name__ == "__main__":
    sys.exit(main())
