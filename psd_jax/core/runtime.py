"""A compiled decode's key (``Program``) and its per-row inputs (``RowValues``, ``row_keys``).

A compiled decode is selected by the settings that set shapes or code paths: lengths, block
length, policy, decoder, cache, depth, k_max, confidence, steps, and whether some row samples, is
filtered by top-p/top-k, is guided or gates PSD's drafts. Those are a ``Program``, a frozen static
argument of the jitted loop; ``DecodeConfig`` itself never enters it. The values the rules compare
against (``RUNTIME_FIELDS``: threshold, factor, temperature, top_p, top_k, cfg scale, RPS's ratio,
pivot_tau and lam, PSD's accept_confidence), each row's own generation length within the canvas,
and each row's PRNG key are arrays with one entry per row, inputs of the compiled program. So rows
with different thresholds or temperatures share one batch, a new value never compiles, and a row
sharing a batch with longer requests decodes exactly its own length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import DECODERS, BlockCounts, DecodeConfig

# The one list of the DecodeConfig fields that are per-row inputs of a compiled decode; every other
# field is one of the Program's (a test holds the two lists to DecodeConfig's fields).
RUNTIME_FIELDS = (
    "threshold", "factor", "temperature", "top_p", "top_k", "cfg_scale", "ratio", "pivot_tau", "lam", "accept_confidence",
    "editing_threshold", "max_post_steps",
)  # fmt: skip
_INT_FIELDS = ("top_k", "max_post_steps")
# The code paths the runtime values switch on (DecodeConfig properties of the same names).
FLAGS = ("samples", "filters", "guided", "gated")


@dataclasses.dataclass(frozen=True)
class Program(BlockCounts):
    """What a compiled decode is specialised on: ``DecodeConfig``'s fields less ``RUNTIME_FIELDS``,
    and which code paths the rows' values need (``FLAGS``). Hashable: the key of a compile cache and
    of a server's batch."""

    gen_length: int
    block_length: int
    steps: int | None
    policy: str
    confidence: str
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool
    predict_mask: bool  # LLaDA generate.py's [MASK] rule (``DecodeConfig.predict_mask``)
    eos_early_stop: bool
    dream_eps: float
    decoder: Literal[DECODERS]
    depth: int
    acceptance: str
    draft_rate: int | None
    draft_next_block: bool
    k_max: int
    cache: Literal["none", "prefix", "dual"]
    refresh_every: int
    vicinity: int
    minimal_topk: int
    samples: bool  # some row draws its tokens (temperature > 0); a row at 0 stays greedy
    filters: bool  # some row filters by top-p/top-k; each row's own values apply
    guided: bool  # classifier-free guidance: every row's unconditional forward is made
    gated: bool  # PSD's drafts need the verifier's confidence; each row's own threshold
    trace: bool  # the loop records when and how each position is written (``core.trace``)

    @classmethod
    def of(cls, settings: DecodeConfig, gen_length: int | None = None) -> Program:
        """The program that decodes ``settings`` on a canvas of ``gen_length`` generated positions
        (``None``: the settings' own; longer, a multiple of the block, when the row shares a batch
        with longer ones: ``fixed``/``dream`` then keep their steps per block)."""
        fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)}
        if settings.decoder == "edit":
            # The canvas holds whole blocks (each row's own length is its ``RowValues.gen_length``),
            # and the steps per block are the row's own (``BlockCounts.steps_per_block``).
            fields["gen_length"] = settings.num_blocks * settings.block_length
            fields["steps"] = settings.steps_per_block
        if gen_length is not None and gen_length != fields["gen_length"]:
            if gen_length % settings.block_length or gen_length < settings.gen_length:
                raise ValueError(
                    f"canvas gen_length {gen_length} must be a multiple of block_length {settings.block_length} "
                    f">= the row's {settings.gen_length}"
                )
            fields["gen_length"] = gen_length
            if settings.steps is not None and settings.policy in ("fixed", "dream"):
                fields["steps"] = settings.steps_per_block * (gen_length // settings.block_length)
        return cls(**fields)


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
    editing_threshold: jax.Array
    max_post_steps: jax.Array  # int32
    num_blocks: jax.Array  # int32: the row's gen_length / block_length (its last block + 1)
    gen_length: jax.Array  # int32: the row's generated positions (decoder "edit": not always whole blocks)

    @classmethod
    def of(cls, settings: Sequence[DecodeConfig]) -> RowValues:
        """Host arrays of the rows' settings (one ``DecodeConfig`` per row)."""
        fields = {
            name: np.asarray([getattr(s, name) for s in settings], np.int32 if name in _INT_FIELDS else np.float32)
            for name in RUNTIME_FIELDS
        }
        blocks = np.asarray([s.num_blocks for s in settings], np.int32)
        return cls(**fields, num_blocks=blocks, gen_length=np.asarray([s.gen_length for s in settings], np.int32))

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
