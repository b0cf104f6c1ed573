"""Transfer policies (the spatial axis) in JAX: which masked positions of the block to commit this step.

The rules themselves are ``psd_jax.core.rules`` (one definition for the JAX engine and the PyTorch
backend); this module binds them to ``jax.numpy`` and to each policy's count table, baked into the
compiled loop as a constant. Every policy is a pure, shape-static function of the confidences, the
committable positions and the step index within the block: top-k selections are ranks
(``rank < k``), never data-dependent shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .rules import step_counts
from .runtime import Program

__all__ = ["count_table", "step_counts"]


def count_table(program: Program) -> jax.Array | None:
    """The scheduled policies' per-step counts as a constant (``None`` for confidence-driven ones)."""
    counts = step_counts(program)
    return None if counts is None else jnp.asarray(counts)
