"""The error every front end reports as bad input: a prompt or request that cannot be decoded.

It lives below every other module so that the model-facing checks (``lengths``, ``tokenizer``) and
the API raise the same class; ``psd_jax`` exports it with the package's other errors.
"""

from __future__ import annotations


class InputError(ValueError):
    """A prompt or request that cannot be decoded, with the reason."""
