"""Per-row runtime values of a decode: the settings that change no shape, as arrays.

A compiled decode is selected by the settings that set shapes or code paths (lengths, block length,
policy, decoder, cache, depth, k_max, confidence, steps, whether a row samples, is filtered by
top-p/top-k or is guided): ``program_settings``. The values the rules compare against (threshold,
factor, temperature, top_p, top_k, cfg scale, RPS's ratio, pivot_tau and lam, PSD's
accept_confidence), each row's own
generation length within the canvas, and
each row's PRNG key are arrays with one entry per row (``RowValues``, ``row_keys``), inputs of the
compiled program. So rows with different thresholds or temperatures share one batch, a new value
never compiles, and a row sharing a batch with longer requests decodes exactly its own length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import DecodeConfig
from .sampling import filters_set

# DecodeConfig fields read at run time from ``RowValues`` instead of the compiled settings.
RUNTIME_FIELDS = (
    "threshold", "factor", "temperature", "top_p", "top_k", "cfg_scale", "ratio", "pivot_tau", "lam", "accept_confidence"
)  # fmt: skip
_INT_FIELDS = ("top_k",)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecodeConfig)}
# A program that filters (some row has top_p < 1 or top_k > 0): any top_p below 1 marks it; the
# rows' own values are inputs.
_FILTERING = {"top_p": 0.5, "top_k": 0}


def program_settings(settings: DecodeConfig, gen_length: int | None = None) -> DecodeConfig:
    """The settings that select a compiled program for ``settings``: every runtime value at its
    default, except that ``temperature``, ``cfg_scale``, ``accept_confidence`` and the top-p/top-k
    filters keep whether they are on (1.0: sampling, guided; 0.5: gated; ``top_p`` 0.5: filtering;
    the code differs), and
    ``gen_length`` is the canvas's (``None``: the settings' own). ``steps`` stays: it sets the
    schedule's count table, a constant of the program."""
    changes = {name: _DEFAULTS[name] for name in RUNTIME_FIELDS}
    changes["temperature"] = 1.0 if settings.temperature > 0 else 0.0
    changes["cfg_scale"] = 1.0 if settings.cfg_scale > 0 else 0.0
    changes["accept_confidence"] = 0.5 if settings.accept_confidence > 0 else 0.0  # PSD gates its drafts
    if filters_set(settings):
        changes.update(_FILTERING)
    if gen_length is not None and gen_length != settings.gen_length:
        if gen_length % settings.block_length or gen_length < settings.gen_length:
            raise ValueError(
                f"canvas gen_length {gen_length} must be a multiple of block_length {settings.block_length} "
                f">= the row's {settings.gen_length}"
            )
        changes["gen_length"] = gen_length
        if settings.steps is not None and settings.policy in ("fixed", "dream"):
            changes["steps"] = settings.steps_per_block * (gen_length // settings.block_length)
    return dataclasses.replace(settings, **changes)


@struct.dataclass
class RowValues:
    """One value per row [B] of each runtime setting, and each row's generation in blocks."""

    threshold: jax.Array
    factor: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array  # int32 (0: off)
    cfg_scale: jax.Array
    ratio: jax.Array
    pivot_tau: jax.Array
    lam: jax.Array
    accept_confidence: jax.Array
    num_blocks: jax.Array  # int32: the row's gen_length / block_length (its last block + 1)

    @classmethod
    def of(cls, settings: Sequence[DecodeConfig]) -> RowValues:
        """Host arrays of the rows' settings (one ``DecodeConfig`` per row)."""
        fields = {
            name: np.asarray([getattr(s, name) for s in settings], np.int32 if name in _INT_FIELDS else np.float32)
            for name in RUNTIME_FIELDS
        }
        return cls(**fields, num_blocks=np.asarray([s.num_blocks for s in settings], np.int32))

    def repeat(self, times: int) -> RowValues:
        """Each row's values ``times`` times in a row ([B] -> [B * times])."""
        return jax.tree.map(lambda a: jnp.repeat(a, times, axis=0), self)

    def sampling(self, times: int = 1) -> RowSampling:
        """The values the token draw reads, each row's ``times`` times in a row (its candidates)."""
        rows = (lambda a: a) if times == 1 else (lambda a: jnp.repeat(a, times, axis=0))
        return RowSampling(rows(self.temperature), rows(self.top_p), rows(self.top_k))


@struct.dataclass
class RowSampling:
    """One value per row [M] of what the token draw reads (``sampling``, ``predict``)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array


def row_keys(seeds: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    """Raw PRNG keys [B, 2] (uint32): row ``rows[i]`` of a batch drawn with seed ``seeds[i]``. A
    row's draws depend only on its key, so ``generate(prompts, seed=s)``'s row r and a server row
    with seed s at r = 0 draw the same, whatever shares their batch."""
    if len(seeds) != len(rows):
        raise ValueError(f"{len(seeds)} seeds for {len(rows)} rows")
    keys = [np.asarray(_row_key(np.uint32(s), np.int32(r))) for s, r in zip(seeds, rows)]
    return np.stack(keys) if keys else np.zeros((0, 2), np.uint32)


@jax.jit
def _row_key(seed: jax.Array, row: jax.Array) -> jax.Array:
    # One compiled program for every batch size (a server starts and joins any number of rows):
    # traced eagerly, or compiled per batch size, every new count of rows would cost a lowering.
    return jax.random.fold_in(jax.random.PRNGKey(seed), row)


def split_rows(keys: jax.Array, n: int) -> jax.Array:
    """Each row's raw key [B, 2] split in ``n``: [n, B, 2] (the first is the row's next key)."""
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, n))(keys), 1, 0)


def candidate_keys(keys: jax.Array, k: int) -> jax.Array:
    """Raw keys [B * K, 2] of the K candidates of each row: the row's key folded with the candidate
    index, so a candidate draws the same however many of a row's candidates a call forwards."""
    folded = jax.vmap(lambda key: jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(k)))(keys)
    return folded.reshape(-1, keys.shape[-1])
