"""``python -m psd_jax.bench``: every decoder's speed against quality on one dataset (``psd_jax.cli.bench``)."""

import sys

from .cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
