"""``python -m psd_jax.generate``: decode prompts with a diffusion LM and print answers and stats (``psd_jax.cli.generate``)."""

import sys

from .cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
