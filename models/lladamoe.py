"""LLaDA-MoE (upstream ``LLaDAMoEModelLM``, e.g. LLaDA-MoE-7B-A1B) as a Flax NNX module.

Architecture (upstream ``modeling_lladamoe.py``, the OLMoE layout without a causal mask): pre-norm
layers of GQA attention with separate q/k/v projections, a per-head RMSNorm on q and k (over
head_dim) after the projections and before RoPE (rotate-half on every dim), and an output projection;
the feed-forward of each layer is, as ``moe_layer_freq`` says, a mixture of experts
(``models.moe.softmax_route``: float32 softmax over all experts, top-k weights not renormalised;
SwiGLU experts through ``models.moe.routed_experts``, expert parallel on a mesh; an optional shared
expert added) or a dense SwiGLU MLP; final RMSNorm and an untied LM head. Logits are unshifted.

The model is a flat (bidirectional) family: ``LLaDAMoE`` is a ``DiffusionLM`` with the same calls
(``__call__``, ``prefill`` with ``into``, ``window``, ``positions``), so every decoder and the
prefix/dual KV caches run it unchanged. Upstream ignores ``attention_mask`` (it decodes unpadded
batches); here, as for LLaDA, pad keys are masked and positions stay absolute, so a left-padded row
decodes as it does alone (RoPE sees only relative positions).

Parameters: ``embed``/``final_norm``/``lm_head`` and two stacked layer groups as LLaDA2.0's,
``dense_<name>`` [dense layers, ...] and ``moe_<name>`` [MoE layers, ...]; the layers run in
config order as runs of one kind (``LLaDAMoEConfig.segments``), each run a ``lax.scan`` (or unrolled
with ``unroll_layers=True``, the CPU default, as ``DiffusionLM``).

Numerics as upstream: RMSNorm in float32, rounded, times the weight; RoPE tables in float32 rounded to
the model dtype and applied in it (OLMoE's ``apply_rotary_pos_emb``); router logits rounded to the
model dtype, softmax in float32; the LM head rounds to the model dtype before logits are returned as
float32. Unlike upstream's loop over experts (which adds each expert's bfloat16 output into a
bfloat16 sum), the routed outputs are combined with their float32 weights in float32 and rounded
once; in float32 the two agree to rounding (tests/modeling/test_lladamoe.py: logits within 1e-4 of upstream's).
"""

from __future__ import annotations

import jax

from . import llada2
from .config import LLaDAMoEConfig, SDARConfig
from .llada2 import GroupedLayers, apply_partial_rope
from .moe import routed_experts, softmax_route
from .transformer import (
    LAYER_PARAMS,
    DiffusionLM,
    Layers,
    matmul,
    rms_norm,
    rounded_head,
    run_segments,
    swiglu,
    swiglu_mlp,
)

ATTN_PARAMS = ("attn_norm", "wq", "wk", "wv", "q_norm", "k_norm", "wo", "mlp_norm")
DENSE_MLP_PARAMS = ("w_gate", "w_up", "w_down")
ROUTED_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")
SHARED_PARAMS = ("shared_gate", "shared_up", "shared_down")
TOP_PARAMS = ("embed", "final_norm", "lm_head")
# Logical axes by base name (``psd_jax.parallel.sharding``): LLaDA2.0's table (experts over ``expert`` and
# their hidden units over ``model``, the router replicated) with LLaDA's separate q/k/v projections.
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    **llada2.LOGICAL_AXES,
    **{name: LAYER_PARAMS[name][1:] for name in ("wq", "wk", "wv")},
}


def attention_shapes(cfg: LLaDAMoEConfig | SDARConfig) -> dict[str, tuple[int, ...]]:
    """One layer's attention parameters and its MLP norm: separate q/k/v projections and per-head
    q/k RMSNorms (LLaDA-MoE's and SDAR's layout)."""
    d, hd = cfg.d_model, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return {
        "attn_norm": (d,),
        "wq": (d, q),
        "wk": (d, kv),
        "wv": (d, kv),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "wo": (q, d),
        "mlp_norm": (d,),
    }


def dense_mlp_shapes(d: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """One dense SwiGLU layer's projections."""
    return {"w_gate": (d, hidden), "w_up": (d, hidden), "w_down": (hidden, d)}


def param_shapes(cfg: LLaDAMoEConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter by name: ``embed``/``final_norm``/``lm_head`` and, per layer group,
    ``dense_<name>`` [n_dense_layers, ...] and ``moe_<name>`` [n_moe_layers, ...] (a group without
    layers has no parameters)."""
    d, V, E = cfg.d_model, cfg.vocab_size, cfg.n_experts
    fm, fs = cfg.moe_hidden, cfg.shared_hidden
    attn, dense = attention_shapes(cfg), dense_mlp_shapes(d, cfg.mlp_hidden)
    moe = {"router": (d, E), "expert_gate": (E, d, fm), "expert_up": (E, d, fm), "expert_down": (E, fm, d)}
    if fs:
        moe.update(shared_gate=(d, fs), shared_up=(d, fs), shared_down=(fs, d))
    shapes = {"embed": (V, d), "final_norm": (d,), "lm_head": (d, V)}
    for group, n, mlp in (("dense", cfg.n_dense_layers, dense), ("moe", cfg.n_moe_layers, moe)):
        if n:
            shapes.update({f"{group}_{name}": (n, *shape) for name, shape in {**attn, **mlp}.items()})
    return shapes


def logical_axes(name: str) -> tuple[str | None, ...]:
    """The logical axes of parameter ``name`` as ``param_shapes`` names it (stacked: "layers" first)."""
    return llada2.logical_axes(name, LOGICAL_AXES)


class LLaDAMoE(GroupedLayers, DiffusionLM):
    """Token ids [B, N] -> raw logits [B, N, V] in float32, with ``DiffusionLM``'s calls (the module
    docstring); only the layer layout, the q/k norms, the feed-forward and the head differ."""

    param_table = staticmethod(param_shapes)

    # ----------------------------------------------------------------------------- parameters
    def group_names(self, group: str) -> list[str]:
        if group == "dense":
            return [*ATTN_PARAMS, *DENSE_MLP_PARAMS]
        return [*ATTN_PARAMS, *ROUTED_PARAMS, *(SHARED_PARAMS if self.config.shared_hidden else ())]

    def layer_weights(self) -> dict[str, jax.Array]:
        """Not one stack here: the layers are two groups (``group_weights``)."""
        raise NotImplementedError("LLaDA-MoE's layers are two stacked groups: use group_weights('dense' / 'moe')")

    def head_weight(self) -> jax.Array:
        return self.lm_head[...]

    # ------------------------------------------------------------------------------- pieces
    def _run_layers(self, block, carry, per_layer_inputs: tuple = ()):
        """``block`` over every layer in config order: each run of one kind (``config.segments``)
        with its group's weights. ``_mlp`` tells the kinds apart by their weights."""
        segments = [
            (block, self._segment_layers(group, first, count), count) for group, first, count in self.config.segments()
        ]
        return run_segments(segments, carry, per_layer_inputs)

    def _segment_layers(self, group: str, first: int, count: int) -> Layers:
        """Layers ``first .. first + count - 1`` of ``group`` in this model's layout (the whole
        stacked group, not a slice of it, when the run is the group: the released model's case)."""
        if self.unrolled:
            layers = getattr(self, f"{group}_layers")
            return [layers[i] for i in range(first, first + count)]
        weights = self.group_weights(group)
        if count == self.group_size(group):
            return weights
        return {name: w[first : first + count] for name, w in weights.items()}

    def _project(self, x, w, sin, cos, shape: tuple[int, int]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, N, H, hd], k and v [B, N, KV, hd] of rows x [B*N, D]: projections, per-head q/k
        RMSNorm, then RoPE on q and k."""
        cfg = self.config
        batch, length = shape
        q = matmul(x, w["wq"]).reshape(batch, length, cfg.n_heads, cfg.head_dim)
        k = matmul(x, w["wk"]).reshape(batch, length, cfg.n_kv_heads, cfg.head_dim)
        v = matmul(x, w["wv"]).reshape(batch, length, cfg.n_kv_heads, cfg.head_dim)
        q = apply_partial_rope(rms_norm(q, w["q_norm"], cfg.norm_eps), sin, cos)
        k = apply_partial_rope(rms_norm(k, w["k_norm"], cfg.norm_eps), sin, cos)
        return q, k, v

    def _mlp(self, h: jax.Array, w: dict[str, jax.Array], batch: int) -> jax.Array:
        """The residual rows [T, D] (``batch`` sequences) after the layer's feed-forward: the experts
        (plus the shared expert, if any) when the layer has a router, else the dense SwiGLU."""
        y = rms_norm(h, w["mlp_norm"], self.config.norm_eps)
        if "router" not in w:
            return h + swiglu_mlp(y, w["w_gate"], w["w_up"], w["w_down"])
        chosen, weights = softmax_route(y, w["router"], top_k=self.config.n_experts_per_tok)
        experts = (w["expert_gate"], w["expert_up"], w["expert_down"])
        out = routed_experts(y, chosen, weights, *experts, swiglu, batch=batch)
        if "shared_gate" in w:
            out = out + swiglu_mlp(y, w["shared_gate"], w["shared_up"], w["shared_down"])
        return h + out

    def _head(self, x: jax.Array) -> jax.Array:
        """Float32 logits [B, N, V] of hidden states [B, N, D]: rounded to the model dtype first, as upstream."""
        return rounded_head(x, self.final_norm[...], self.lm_head[...], self.config.norm_eps)
