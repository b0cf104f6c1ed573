"""The canvas of a block-causal model (LLaDA2.0; docs/algorithms.md "LLaDA2.0: block diffusion").

Blocks are aligned from each row's own position 0, so rows of different prompt lengths start their
blocks at different offsets. ``BlockLayout`` left-pads each row by whole blocks so that the batch
shares one block structure; ``initial_canvas`` places the prompts, ``output_canvas`` reads the
canvas back in the ``[prompt | gen_length]`` layout every caller of the engine reads. The loop asks
``layouts.BlockCausalLayout`` for them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import ModelConfig

from .runtime import Program


def canvas_length(prompt_length: int, program: Program, block_causal: bool) -> int:
    """Positions of a decode's canvas for prompts left-padded to ``prompt_length``: the prompt and
    gen_length; block-causal, the first decoded block's start (``BlockLayout.start``), then
    gen_length and one block more (the most a row needs: its first decoded block also holds its
    prompt's tail)."""
    if not block_causal:
        return prompt_length + program.gen_length
    return prompt_length // program.block_length * program.block_length + program.gen_length + program.block_length


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
    """Block-causal canvas rows (docs/algorithms.md "LLaDA2.0"). Blocks are aligned from each row's
    position 0, so row r's prompt of ``lengths[r]`` tokens is left-padded by whole blocks until its
    first decoded block (the one holding the prompt's last ``lengths[r] % B`` tokens, never
    committed as they are not masks) starts at the loop's ``prompt_length`` in every row: the
    batch shares one block structure, and block-causal attention by canvas index is unchanged."""

    lengths: jax.Array  # [B] prompt tokens per row
    padded_length: int  # P: the prompts' (left-padded) length as given
    block_length: int

    @property
    def start(self) -> int:
        """Canvas index of the first decoded block (the loop's ``prompt_length``)."""
        return self.padded_length // self.block_length * self.block_length

    @property
    def tail(self) -> jax.Array:
        return self.lengths % self.block_length

    @property
    def pad(self) -> jax.Array:
        """[B] canvas index of each row's position 0 (a multiple of the block length)."""
        return self.start - (self.lengths - self.tail)

    @property
    def gen_start(self) -> jax.Array:
        """[B] canvas index of each row's first generated position."""
        return self.start + self.tail

    def total_length(self, program: Program) -> int:
        """Canvas positions (``canvas_length``)."""
        return canvas_length(self.padded_length, program, block_causal=True)

    def last_block(self, gen_length: int | jax.Array) -> jax.Array:
        """[B] each row's last block: upstream decodes ceil((tail + gen_length) / B) blocks
        (``gen_length``: the rows' own, one or [B])."""
        return (self.tail + gen_length - 1) // self.block_length

    def prompt_index(self) -> jax.Array:
        """[B, P]: the canvas index of each left-padded prompt position (clipped where padding)."""
        p = self.padded_length
        return jnp.maximum(jnp.arange(p)[None, :] - (p - self.lengths)[:, None], 0) + self.pad[:, None]


def initial_canvas(prompt_ids: jax.Array, layout: BlockLayout, mcfg: ModelConfig, program: Program) -> jax.Array:
    """Canvas [B, N] = prompt + masks, each row placed by its ``BlockLayout``."""
    p = prompt_ids.shape[1]
    lengths = layout.lengths[:, None]
    pos = jnp.arange(layout.total_length(program))[None, :] - layout.pad[:, None]
    src = jnp.clip(p - lengths + pos, 0, p - 1)
    tokens = jnp.take_along_axis(prompt_ids.astype(jnp.int32), src, axis=1)
    fill = jnp.where(pos < 0, mcfg.pad_id, mcfg.mask_id)
    return jnp.where((pos >= 0) & (pos < lengths), tokens, fill)


def output_canvas(
    canvas: jax.Array, layout: BlockLayout, mcfg: ModelConfig, program: Program, cut_after_eos: bool = True
) -> jax.Array:
    """The canvas as every caller reads it, [B, P + gen_length]: the left-padded prompt, then the
    gen_length generated ids, rebuilt from each row's layout; with ``cut_after_eos`` every id after
    the first EOS is EOS (LLaDA2.0's upstream returns the sequence cut there), and in any case a
    position no block decoded (a row that stopped early: upstream leaves ``[MASK]``) is EOS."""
    eos_id = mcfg.eos_id
    index = layout.gen_start[:, None] + jnp.arange(program.gen_length)[None, :]
    generated = jnp.take_along_axis(canvas, index, axis=1)
    generated = jnp.where(generated == mcfg.mask_id, eos_id, generated)
    if cut_after_eos:
        is_eos = generated == eos_id
        generated = jnp.where(jnp.cumsum(is_eos, axis=1) - is_eos > 0, eos_id, generated)
    p = layout.padded_length
    prompt = jnp.take_along_axis(canvas, layout.prompt_index(), axis=1)
    prompt = jnp.where(jnp.arange(p)[None, :] >= (p - layout.lengths)[:, None], prompt, mcfg.pad_id)
    return jnp.concatenate([prompt, generated], axis=1)


def output_trace(trace, layout: BlockLayout, program: Program):
    """A decode's trace (``core.trace.Trace``, [B, N] arrays) laid out as ``output_canvas`` lays out
    the canvas, [B, P + gen_length]: each row's generated positions from its own layout after the
    padded prompt's (never written: 0)."""
    index = layout.gen_start[:, None] + jnp.arange(program.gen_length)[None, :]
    p = layout.padded_length

    def one(a: jax.Array) -> jax.Array:
        generated = jnp.take_along_axis(a, index, axis=1)
        return jnp.concatenate([jnp.zeros((a.shape[0], p), a.dtype), generated], axis=1)

    return jax.tree.map(one, trace)
