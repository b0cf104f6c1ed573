"""LLaDA2.0 (``llada2_moe``, upstream ``LLaDA2MoeModelLM``) as a Flax NNX module, for block diffusion.

Architecture (upstream ``modeling_llada2_moe.py``): pre-norm layers of attention with one fused
``query_key_value`` projection (GQA: q heads, then k, then v), a per-head RMSNorm on q and k
before RoPE, RoPE on the first ``rotary_dim`` dims of each head only (rotate-half on those dims),
and an output projection; the feed-forward is a dense SwiGLU for the first ``n_dense_layers``
layers and a mixture of experts after (``models.moe``: sigmoid router with selection bias,
group-limited top-k, shared expert always added); final RMSNorm and an untied LM head.

Numerics as upstream: RMSNorm in float32, rounded, times the weight; RoPE tables in float32,
rounded to the model dtype and applied in it (upstream casts cos/sin to the hidden dtype); router
logits and weights in float32; routed outputs combined in float32 and rounded once; the LM head
rounds to the model dtype before logits are returned as float32 (upstream's ``logits.float()``).

API that decoding uses (all logits are raw: LLaDA2.0 predicts position ``i`` at logit ``i``):

- ``model(tokens, attention_mask=None, positions=None, block_length=None, logits_from=0,
  logit_index=None) -> logits [B, N', V]``. ``attention_mask`` [B, N] masks keys (pads);
  ``positions`` default to ``arange(N)``. ``block_length=None`` is fully bidirectional (upstream
  with no mask); an int is block-causal: query ``i`` sees key ``j`` iff
  ``j // block_length <= i // block_length`` (sequence indices, as upstream ``generate``'s mask).
- ``model.prefill(same arguments) -> (logits, keys, values)``, keys/values [L, B, N, KV, hd]
  (keys after norm and RoPE). Under block-causal attention a block's keys and values depend only
  on it and earlier blocks, so those of finished blocks never change: they are an exact cache.
- ``model.window(tokens, positions, cache_k, cache_v, cache_mask, window_mask, out_length,
  block_length=None) -> logits [B, M, out_length, V]``: M windows of W positions per row
  ([B, M, W] tokens/positions) attending to the row's cached keys where ``cache_mask`` [B, N]
  is True (earlier blocks' non-pad positions; not the window's own) and to the window's own keys
  where ``window_mask`` [B, W] is True and, with ``block_length``, the key's block
  (``position // block_length``) is not after the query's. With ``positions`` the sequence
  indices (the ``arange`` default), this gives exactly the full forward's logits at the window.

Layers are two groups with weights stacked on a leading layer axis: ``dense_*`` (the dense layers)
and ``moe_*`` (the MoE layers), each run with ``lax.scan``; ``unroll_layers=True`` keeps each
layer's weights in arrays of their own and unrolls the loop (the CPU default, as ``DiffusionLM``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import LLaDA2Config
from .moe import route, routed_experts
from .transformer import (
    Layers,
    attention,
    cached_attention_grouped,
    default_positions,
    embed_rows,
    initial_value,
    logit_positions,
    matmul,
    rms_norm,
    rope_tables,
    rounded_head,
    run_segments,
    set_unrolled,
    stacked_weights,
    swiglu,
    swiglu_mlp,
    unrolled_layers,
)

GROUPS = ("dense", "moe")
ATTN_PARAMS = ("attn_norm", "wqkv", "q_norm", "k_norm", "wo", "mlp_norm")
DENSE_MLP_PARAMS = ("w_gate", "w_up", "w_down")
MOE_MLP_PARAMS = (
    "router",
    "expert_bias",
    "expert_gate",
    "expert_up",
    "expert_down",
    "shared_gate",
    "shared_up",
    "shared_down",
)
TOP_PARAMS = ("embed", "final_norm", "lm_head")
# Logical axes of each parameter (without the leading "layers" of the stacked groups), which
# ``psd_jax.parallel.sharding.LOGICAL_RULES`` maps to mesh axes: experts over ``expert`` and their hidden
# units over ``model``; attention, the dense and shared MLPs, embedding and head over ``model`` as
# for LLaDA/Dream; the router and expert_bias replicated. ``wqkv``'s fused output ("qkv") is split
# over ``model`` as one dimension: each shard holds a contiguous run of [q heads | k heads | v heads].
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "attn_norm": ("embed",),
    "wqkv": ("embed", "qkv"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "wo": ("heads", "embed"),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "router": ("embed", "router"),
    "expert_bias": ("router",),
    "expert_gate": ("experts", "embed", "expert_mlp"),
    "expert_up": ("experts", "embed", "expert_mlp"),
    "expert_down": ("experts", "expert_mlp", "embed"),
    "shared_gate": ("embed", "mlp"),
    "shared_up": ("embed", "mlp"),
    "shared_down": ("mlp", "embed"),
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}
# Kept in float32 whatever the model dtype: it only shifts the (discrete) expert choice, and
# upstream keeps it as a float32 buffer.
FLOAT32_PARAMS = ("moe_expert_bias",)


def param_shapes(cfg: LLaDA2Config) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter by name: ``embed``/``final_norm``/``lm_head`` and, per layer
    group, ``dense_<name>`` [n_dense_layers, ...] and ``moe_<name>`` [n_moe_layers, ...]."""
    d, hd, V, E = cfg.d_model, cfg.head_dim, cfg.vocab_size, cfg.n_experts
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    fm, fs = cfg.moe_hidden, cfg.n_shared_experts * cfg.moe_hidden
    attn = {
        "attn_norm": (d,),
        "wqkv": (d, qkv),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "wo": (cfg.n_heads * hd, d),
        "mlp_norm": (d,),
    }
    dense = {"w_gate": (d, cfg.mlp_hidden), "w_up": (d, cfg.mlp_hidden), "w_down": (cfg.mlp_hidden, d)}
    moe = {
        "router": (d, E),
        "expert_bias": (E,),
        "expert_gate": (E, d, fm),
        "expert_up": (E, d, fm),
        "expert_down": (E, fm, d),
        "shared_gate": (d, fs),
        "shared_up": (d, fs),
        "shared_down": (fs, d),
    }
    shapes = {"embed": (V, d), "final_norm": (d,), "lm_head": (d, V)}
    for group, n, mlp in (("dense", cfg.n_dense_layers, dense), ("moe", cfg.n_moe_layers, moe)):
        if n:
            shapes.update({f"{group}_{name}": (n, *shape) for name, shape in {**attn, **mlp}.items()})
    return shapes


def logical_axes(name: str, table: dict[str, tuple[str | None, ...]] = LOGICAL_AXES) -> tuple[str | None, ...]:
    """The logical axes of parameter ``name`` as ``param_shapes`` names it (stacked: "layers" first),
    from ``table`` (the axes by base name: this family's, or another family's of the same grouped layout)."""
    group, base = split_name(name)
    return table[base] if group is None else ("layers", *table[base])


def param_dtype(name: str, dtype: jnp.dtype) -> jnp.dtype:
    """The dtype parameter ``name`` is kept in for a model of ``dtype``."""
    return jnp.dtype(jnp.float32) if name in FLOAT32_PARAMS else jnp.dtype(dtype)


def split_name(name: str) -> tuple[str | None, str]:
    """``"moe_wqkv"`` -> ("moe", "wqkv"); top-level names -> (None, name)."""
    group, _, base = name.partition("_")
    return (group, base) if group in GROUPS and base else (None, name)


def apply_partial_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first ``sin.shape[-1]`` dims of each head of x [B, N, H, hd];
    the rest pass through. Tables are rounded to x's dtype and applied in it, as upstream."""
    r = sin.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([rot * c + rotated * s, rest], axis=-1)


def block_causal(query_blocks: jax.Array, key_blocks: jax.Array) -> jax.Array:
    """visible[..., i, j] = key j's block is not after query i's block."""
    return key_blocks[..., None, :] <= query_blocks[..., :, None]


class GroupedLayers:
    """Parameters in two stacked layer groups, ``dense_<name>`` and ``moe_<name>`` [layers of the
    group, ...] (``param_shapes``), or unrolled (``<group>_layers[i][name]``, the CPU layout): what
    LLaDA2.0, LLaDA-MoE and SDAR share. A class using it sets ``param_table`` (its family's
    ``param_shapes``) and defines ``group_names``."""

    param_table: Callable[[Any], dict[str, tuple[int, ...]]]

    def __init__(
        self,
        config: Any,
        *,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
        unroll_layers: bool = False,
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self._init_groups(type(self).param_table(config), self.stored_dtype, rngs, unroll_layers)

    def stored_dtype(self, name: str) -> jnp.dtype:
        """The dtype parameter ``name`` is kept in (the model's, unless the family says otherwise)."""
        return self.dtype

    def _init_groups(self, shapes: dict[str, tuple[int, ...]], dtype_of, rngs: nnx.Rngs, unroll: bool) -> None:
        """Every parameter of ``shapes`` initialised (``dtype_of(name)``), stacked or unrolled."""
        per_group: dict[str, dict[str, jax.Array]] = {g: {} for g in GROUPS}
        for name, shape in shapes.items():
            group, base = split_name(name)
            value = initial_value(base, shape, dtype_of(name), rngs)
            if unroll and group is not None:
                per_group[group][base] = value
            else:
                setattr(self, name, nnx.Param(value))
        # Unrolled: <group>_layers[i][base] is layer i's slice of the stacked parameter <group>_<base>.
        for group in GROUPS:
            layers = unrolled_layers(per_group[group], self.group_size(group)) if unroll else None
            setattr(self, f"{group}_layers", layers)

    @property
    def unrolled(self) -> bool:
        return self.dense_layers is not None

    def group_names(self, group: str) -> list[str]:
        raise NotImplementedError

    def group_size(self, group: str) -> int:
        return self.config.n_dense_layers if group == "dense" else self.config.n_moe_layers

    def group_weights(self, group: str) -> dict[str, jax.Array]:
        """The group's parameters stacked on the layer axis (stacked on the fly if unrolled)."""
        if self.unrolled:
            return stacked_weights(getattr(self, f"{group}_layers"), self.group_names(group))
        return {b: getattr(self, f"{group}_{b}")[...] for b in self.group_names(group)}

    def set_param(self, name: str, value: jax.Array) -> None:
        """Set a parameter from its stacked value (as ``param_shapes`` gives it), in either layout."""
        group, base = split_name(name)
        if self.unrolled and group is not None:
            set_unrolled(getattr(self, f"{group}_layers"), base, value)
        else:
            getattr(self, name).set_value(value)


class LLaDA2MoE(GroupedLayers, nnx.Module):
    """Token ids [B, N] -> raw logits [B, N, V] in float32 (see the module docstring for the API)."""

    param_table = staticmethod(param_shapes)

    def stored_dtype(self, name: str) -> jnp.dtype:
        """The router's selection bias stays float32 (``param_dtype``)."""
        return param_dtype(name, self.dtype)

    # ----------------------------------------------------------------------------- parameters
    def group_names(self, group: str) -> list[str]:
        mlp = DENSE_MLP_PARAMS if group == "dense" else MOE_MLP_PARAMS
        return list(ATTN_PARAMS) + list(mlp)

    def _run_layers(self, make_block, x: jax.Array, per_layer_inputs: tuple = ()):
        """``run_segments`` over both groups in order, each in this model's layout; ``make_block(group)``
        gives the group's layer function."""
        segments = [
            (make_block(group), self._group_layers(group), self.group_size(group))
            for group in GROUPS
            if self.group_size(group)
        ]
        return run_segments(segments, x, per_layer_inputs)

    def _group_layers(self, group: str) -> Layers:
        """The group's layers in this model's layout (``models.transformer.Layers``)."""
        return getattr(self, f"{group}_layers") if self.unrolled else self.group_weights(group)

    # -------------------------------------------------------------------------------- forward
    def __call__(
        self,
        tokens: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        block_length: int | None = None,
        logits_from: int = 0,
        logit_index: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, N - logits_from, V] (or [B, W, V] at ``logit_index`` [B, W]) in float32."""
        return self._full(tokens, attention_mask, positions, block_length, False, logits_from, logit_index)[0]

    def prefill(
        self,
        tokens: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        block_length: int | None = None,
        logits_from: int = 0,
        logit_index: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``__call__`` that also returns every layer's keys and values, [L, B, N, KV, hd] each."""
        return self._full(tokens, attention_mask, positions, block_length, True, logits_from, logit_index)

    def positions(self, attention_mask: jax.Array | None, batch: int, length: int) -> jax.Array:
        return default_positions(self.config, attention_mask, batch, length)

    def _full(self, tokens, attention_mask, positions, block_length, collect_kv: bool, logits_from, logit_index):
        cfg = self.config
        batch, length = tokens.shape
        if positions is None:
            positions = self.positions(attention_mask, batch, length)
        mask = None if attention_mask is None else attention_mask.astype(bool)[:, None, None, :]
        if block_length is not None:
            blocks = jnp.arange(length) // block_length
            visible = block_causal(blocks, blocks)[None, None]
            mask = visible if mask is None else mask & visible
        sin, cos = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
        x = embed_rows(self.embed[...], tokens, self.dtype)

        def make_block(group: str):
            def block(h: jax.Array, layer):
                (w,) = layer
                q, k, v = self._project(rms_norm(h, w["attn_norm"], cfg.norm_eps), w, sin, cos, (batch, length))
                out = attention(q, k, v, mask)
                h = h + matmul(out.reshape(batch * length, -1), w["wo"])
                return self._ffn(group, h, w, batch), ((k, v) if collect_kv else None)

            return block

        x, kv = self._run_layers(make_block, x)
        logits = self._head(logit_positions(x, batch, length, logits_from, logit_index))
        return (logits, *kv) if collect_kv else (logits, None, None)

    def window(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache_k: jax.Array,
        cache_v: jax.Array,
        cache_mask: jax.Array,
        window_mask: jax.Array,
        out_length: int,
        block_length: int | None = None,
        return_kv: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
        """Logits [B, M, out_length, V] of M windows [B, M, W] against the cache (module docstring);
        with ``return_kv`` also the windows' own keys and values [L, B, M, W, KV, hd] (a finished
        block's are final under block-causal attention, so a decoder can write them into its cache)."""
        cfg = self.config
        batch, m, width = tokens.shape
        sin, cos = rope_tables(positions.reshape(batch * m, width), cfg.rotary_dim, cfg.rope_theta)
        visible = jnp.broadcast_to(window_mask[:, None, None, :].astype(bool), (batch, m, width, width))
        if block_length is not None:
            blocks = positions // block_length
            visible = visible & block_causal(blocks, blocks)
        x = embed_rows(self.embed[...], tokens, self.dtype)

        def make_block(group: str):
            def block(h: jax.Array, layer):
                w, ck, cv = layer
                q, k, v = self._project(rms_norm(h, w["attn_norm"], cfg.norm_eps), w, sin, cos, (batch * m, width))
                split = lambda a: a.reshape(batch, m, width, *a.shape[2:])
                out = cached_attention_grouped(
                    split(q), split(k), split(v), ck, cv, cache_mask, visible, round_once=True
                )
                h = h + matmul(out.reshape(batch * m * width, -1), w["wo"])
                return self._ffn(group, h, w, batch), ((split(k), split(v)) if return_kv else None)

            return block

        x, kv = self._run_layers(make_block, x, (cache_k, cache_v))
        logits = self._head(x.reshape(batch * m, width, -1)[:, :out_length]).reshape(batch, m, out_length, -1)
        return (logits, *kv) if return_kv else logits

    # ------------------------------------------------------------------------------- pieces
    def _project(self, x, w, sin, cos, shape: tuple[int, int]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, N, H, hd], k and v [B, N, KV, hd] of rows x [B*N, D]: fused projection, q/k norm, RoPE."""
        cfg = self.config
        batch, length = shape
        qkv = matmul(x, w["wqkv"]).reshape(batch, length, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim)
        q, k, v = jnp.split(qkv, [cfg.n_heads, cfg.n_heads + cfg.n_kv_heads], axis=2)
        q = apply_partial_rope(rms_norm(q, w["q_norm"], cfg.norm_eps), sin, cos)
        k = apply_partial_rope(rms_norm(k, w["k_norm"], cfg.norm_eps), sin, cos)
        return q, k, v

    def _ffn(self, group: str, h: jax.Array, w: dict[str, jax.Array], batch: int) -> jax.Array:
        """The residual rows [T, D] (``batch`` sequences) after the layer's feed-forward (dense SwiGLU or experts)."""
        cfg = self.config
        y = rms_norm(h, w["mlp_norm"], cfg.norm_eps)
        if group == "dense":
            return h + swiglu_mlp(y, w["w_gate"], w["w_up"], w["w_down"])
        chosen, weights = route(
            y,
            w["router"],
            w["expert_bias"],
            top_k=cfg.n_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            scaling=cfg.routed_scaling_factor,
        )
        experts = (w["expert_gate"], w["expert_up"], w["expert_down"])
        routed = routed_experts(y, chosen, weights, *experts, swiglu, batch=batch)
        shared = swiglu_mlp(y, w["shared_gate"], w["shared_up"], w["shared_down"])
        return h + (routed + shared)

    def _head(self, x: jax.Array) -> jax.Array:
        return rounded_head(x, self.final_norm[...], self.lm_head[...], self.config.norm_eps)
