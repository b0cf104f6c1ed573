"""The command-line parser every front end of the project uses: errors are one line and exit 2.

It lives in the lowest package that has a command line, so that ``python -m convert`` does not load
the decoding library; ``psd_jax.cli.flags`` builds its flags on it.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_BAD_INPUT = 2


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
