"""Transfer policies (the spatial axis): which masked positions of the block to commit this step.

Each policy is a pure, shape-static function of the confidences, the committable positions and the
step index within the block. Top-k selections are expressed through ranks (``rank < k``), never
through data-dependent shapes. Ranks order by confidence descending, ties to the lower position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import DecodeConfig
from .schedules import dream_schedule, llada_schedule


def ranks(conf: jax.Array, valid: jax.Array) -> jax.Array:
    """Rank of each valid position by confidence (0 = most confident); invalid ones rank last."""
    n = conf.shape[-1]
    index = jnp.broadcast_to(jnp.arange(n), conf.shape)
    order = jnp.lexsort((index, -conf, ~valid), axis=-1)  # last key is the primary one
    return jnp.argsort(order, axis=-1).astype(jnp.int32)


def step_counts(dcfg: DecodeConfig) -> np.ndarray | None:
    """Per-step commit counts of the scheduled policies (``None`` for confidence-driven ones)."""
    if dcfg.policy in ("fixed", "threshold_schedule"):
        return llada_schedule(dcfg.block_length, dcfg.steps_per_block)
    if dcfg.policy == "dream":
        return dream_schedule(dcfg.block_length, dcfg.steps_per_block, dcfg.dream_eps)
    return None


def scheduled_count(dcfg: DecodeConfig, step: jax.Array, remaining: jax.Array) -> jax.Array:
    """How many positions the schedule commits at ``step`` (all remaining at or past the last step)."""
    counts = jnp.asarray(step_counts(dcfg))
    last = counts.shape[0] - 1
    k = counts[jnp.clip(step, 0, last)]
    return jnp.where(step >= last, remaining, k)


def commit_mask(conf: jax.Array, valid: jax.Array, step: jax.Array, dcfg: DecodeConfig) -> jax.Array:
    """The policy's commit set S for rows [B]: conf/valid [B, N], step [B]."""
    rank = ranks(conf, valid)
    remaining = valid.sum(axis=-1)
    if dcfg.policy in ("fixed", "dream"):
        k = scheduled_count(dcfg, step, remaining)
        chosen = rank < k[:, None]
    elif dcfg.policy == "threshold_schedule":
        chosen = threshold_schedule_mask(conf, valid, rank, scheduled_count(dcfg, step, remaining), dcfg.threshold)
    elif dcfg.policy == "threshold":
        # Fast-dLLM get_transfer_index: the argmax position plus every position with c >= tau.
        chosen = (rank == 0) | (conf >= dcfg.threshold)
    else:  # factor
        chosen = rank < factor_count(conf, valid, remaining, dcfg.factor)[:, None]
    return chosen & valid


def factor_count(conf: jax.Array, valid: jax.Array, remaining: jax.Array, factor: float) -> jax.Array:
    """Fast-dLLM get_transfer_index_dynamic: leading ranks k with c_(k) >= 1 - f/(k+2).

    Upstream quirk kept: when the first failing rank is the last one, everything is committed.
    """
    n = conf.shape[-1]
    sorted_conf = -jnp.sort(jnp.where(valid, -conf, jnp.inf), axis=-1)  # descending, invalid last
    k = jnp.arange(n)
    passes = (sorted_conf >= 1.0 - factor / (k + 2.0)) | (k == 0)
    leading = jnp.cumprod(passes & (k < remaining[:, None]), axis=-1).sum(axis=-1)
    return jnp.where(leading >= remaining - 1, remaining, leading)


def threshold_schedule_mask(
    conf: jax.Array, valid: jax.Array, rank: jax.Array, k: jax.Array, threshold: float
) -> jax.Array:
    """LLaDA2.0 ``generate``: the positions with c > threshold if at least k = min(k, remaining) of
    them qualify, else the k most confident ones (so a step never commits fewer than the schedule)."""
    k = jnp.minimum(k, valid.sum(axis=-1))
    sure = valid & (conf > threshold)
    return jnp.where((sure.sum(axis=-1) >= k)[:, None], sure, rank < k[:, None])
