"""The bidirectional transformer shared by LLaDA and Dream, as a Flax NNX module.

Both families are a Llama-style pre-norm block (RMSNorm, RoPE attention with GQA, SiLU-gated
MLP) without a causal mask; Dream adds q/k/v biases. Layer weights are stacked on a leading
layer axis and run with ``lax.scan``, so compile time does not grow with depth and every layer's
weights can be sharded by one rule. ``unroll_layers=True`` keeps each layer's weights in arrays of
their own and runs the layers as an unrolled loop instead (the CPU default, ``default_unroll_layers``).

Numerics follow upstream: RMSNorm normalises in float32, casts back, then multiplies the weight;
RoPE (rotate-half) is applied in float32 with upstream's float32 inverse frequencies
(``rope_inv_freq``); the MLP's SiLU is evaluated in float32 and rounded once; logits are the LM
head's values in the model dtype, returned as float32 (upstream's ``lm_head(h).float()``).

The functions here are the backend-neutral forms. Where XLA:CPU compiles one of them slowly, the
function dispatches to its CPU form in ``models.cpu_kernels`` under ``if on_cpu():`` (the reasons
and measurements: docs/xla-vs-pytorch.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import cpu_kernels
from .config import ModelConfig
from .quantize import is_quantized, quantized_matmul

# Parameter names and the logical axes of each (used by the converter and for sharding).
LAYER_PARAMS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "heads", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
}
BIAS_PARAMS: dict[str, tuple[str, ...]] = {
    "bq": ("layers", "heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
}
TOP_PARAMS: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter of the model, by name (the single source of truth)."""
    L, d, F, V = cfg.n_layers, cfg.d_model, cfg.mlp_hidden, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {
        "embed": (V, d),
        "final_norm": (d,),
        "attn_norm": (L, d),
        "wq": (L, d, q),
        "wk": (L, d, kv),
        "wv": (L, d, kv),
        "wo": (L, q, d),
        "mlp_norm": (L, d),
        "w_gate": (L, d, F),
        "w_up": (L, d, F),
        "w_down": (L, F, d),
    }
    if cfg.qkv_bias:
        shapes.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, V)
    return shapes


def logical_axes(name: str) -> tuple[str, ...]:
    """The logical axis names of parameter ``name`` (``psd_jax.parallel.sharding`` maps them to mesh axes)."""
    return {**LAYER_PARAMS, **BIAS_PARAMS, **TOP_PARAMS}[name]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


_COMPILE_TARGET: list[str] = []  # innermost ``compiling_for`` platform, when one is active


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace for ``platform`` ("cpu", "tpu", "gpu") instead of the default backend: ahead-of-time
    compilation for an accelerator from a CPU host (``jax.experimental.topologies``) must trace the
    accelerator's kernel forms and layer layout, not this host's."""
    _COMPILE_TARGET.append(platform)
    try:
        yield
    finally:
        _COMPILE_TARGET.pop()


def on_cpu() -> bool:
    """Whether this trace targets XLA:CPU, where ``models.cpu_kernels`` replaces the slow forms."""
    return (_COMPILE_TARGET[-1] if _COMPILE_TARGET else jax.default_backend()) == "cpu"


def on_tpu() -> bool:
    """Whether this trace targets TPU (``models.moe.routed_experts`` keeps ``ragged_dot`` there)."""
    return (_COMPILE_TARGET[-1] if _COMPILE_TARGET else jax.default_backend()) == "tpu"


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """RoPE inverse frequencies [head_dim // 2] in float32, computed on the host as upstream torch does:
    ``1 / theta ** (arange(0, head_dim, 2) / head_dim)`` in float32 steps. The power is taken in float64
    and rounded once: that is torch's scalar ``powf`` on these exponents (numpy's float32 power is not).

    torch's vectorised CPU pow (Sleef, within an ulp) can differ from this by one ulp in a few
    entries; XLA's in-graph pow differs in far more, which is why the table is made on the host."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    power = np.power(np.float64(np.float32(theta)), exponent.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / power


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """sin/cos tables [B, N, head_dim] in float32 for integer positions [B, N]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(head_dim, theta))
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if on_cpu():
        return cpu_kernels.materialized(sin), cpu_kernels.materialized(cos)
    return sin, cos


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, N, H, hd], computed in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` with the SiLU evaluated in float32 and rounded once, as torch's bfloat16
    kernel does on every device (upstream numerics, for every backend). A bfloat16 ``jax.nn.silu``
    rounds after each of its four ops (and on XLA:CPU is also slower, docs/xla-vs-pytorch.md)."""
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up


def swiglu_mlp(y: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The SwiGLU feed-forward of rows y [T, D]: ``down(swiglu(gate(y), up(y)))`` (every family's dense
    MLP, and the shared experts)."""
    return matmul(swiglu(matmul(y, w_gate), matmul(y, w_up)), w_down)


def default_positions(cfg: ModelConfig, attention_mask: jax.Array | None, batch: int, length: int) -> jax.Array:
    """LLaDA: absolute positions even when padded. Dream: cumsum(mask) - 1 (pad positions -> 1)."""
    if cfg.positions_from_mask and attention_mask is not None:
        mask = attention_mask.astype(jnp.int32)
        return jnp.where(mask > 0, jnp.cumsum(mask, axis=-1) - 1, 1)
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` in ``x``'s dtype: exact products accumulated in float32, rounded once (GPU/TPU
    bfloat16 GEMMs accumulate in float32)."""
    if is_quantized(w):
        return quantized_matmul(x, w)
    if on_cpu():
        return cpu_kernels.matmul(x, w)
    return x @ w


def rounded_head(x: jax.Array, final_norm: jax.Array, lm_head: jax.Array, eps: float) -> jax.Array:
    """Float32 logits [B, N, V] of hidden states [B, N, D] (final RMSNorm, LM head), rounded to the
    model dtype first, as upstream Hugging Face code returns ``lm_head(h).float()``."""
    batch, length, d = x.shape
    x = rms_norm(x.reshape(batch * length, d), final_norm, eps)
    return matmul(x, lm_head).astype(jnp.float32).reshape(batch, length, -1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None) -> jax.Array:
    """Softmax attention of q [B, N, H, hd] over k, v [B, N, KV, hd] (head h reads kv head
    h // (H / KV)); key_mask [B, 1, 1, N] or None. Scores and softmax in float32; the library
    function (fused kernels on GPU/TPU)."""
    if on_cpu():
        return cpu_kernels.attention_per_head(q, k, v, key_mask)
    return jax.nn.dot_product_attention(q, k, v, mask=key_mask)


def default_unroll_layers() -> bool:
    """The layer layout for the current backend: ``lax.scan`` (compile time independent of depth),
    except on CPU (``cpu_kernels.UNROLL_LAYERS``)."""
    if on_cpu():
        return cpu_kernels.UNROLL_LAYERS
    return False


def initial_value(name: str, shape: tuple[int, ...], dtype: jnp.dtype, rngs: nnx.Rngs) -> jax.Array:
    """A fresh parameter ``name`` (a model built without a checkpoint): norm weights 1, biases 0, other
    weights N(0, 0.02^2). Both families' modules draw from ``rngs`` in their parameter order."""
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name in BIAS_PARAMS or name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


# A layer stack in either layout: stacked [L, ...] arrays by name (run with ``lax.scan``), or the
# unrolled layout, an ``nnx.List`` (or a list of some of its entries) whose entry i holds layer i's
# parameters by name.
Layers = dict[str, jax.Array] | nnx.List | list


def unrolled_layers(stacked: dict[str, jax.Array], n_layers: int) -> nnx.List:
    """The unrolled layout of ``stacked`` [L, ...] values: entry i holds layer i's slices, each in a
    ``Param`` of its own (XLA:CPU reads those in place; ``cpu_kernels.UNROLL_LAYERS``)."""
    return nnx.List([nnx.Dict({name: nnx.Param(v[i]) for name, v in stacked.items()}) for i in range(n_layers)])


def stacked_weights(layers: nnx.List, names: list[str]) -> dict[str, jax.Array]:
    """Unrolled layers' parameters ``names`` stacked on the layer axis [L, ...] (a copy)."""
    return {name: jnp.stack([layer[name][...] for layer in layers]) for name in names}


def set_unrolled(layers: nnx.List, name: str, value: jax.Array) -> None:
    """Set unrolled layers' parameter ``name`` from its stacked value [L, ...]."""
    for i, layer in enumerate(layers):
        layer[name].set_value(value[i])


def run_layers(block, carry, layers: Layers, per_layer_inputs: tuple = ()):
    """``carry, ys = block(carry, (weights, *inputs))`` for each layer in turn; ys stacked on the layer axis.

    ``layers`` in either layout (``Layers``): stacked weights run with ``lax.scan``, so compile time does
    not grow with depth; unrolled ones as a Python loop that reads each layer's weights in place.
    ``per_layer_inputs`` are [L, ...] arrays (a KV cache, layer indices) sliced per layer like the
    weights; the carry holds what every layer updates (the residual stream, a cache written in place).
    """
    if isinstance(layers, dict):
        return jax.lax.scan(block, carry, (layers, *per_layer_inputs))
    ys = []
    for i, layer in enumerate(layers):
        weights = {name: param[...] for name, param in layer.items()}
        carry, y = block(carry, (weights, *(a[i] for a in per_layer_inputs)))
        ys.append(y)
    return carry, jax.tree.map(lambda *parts: jnp.stack(parts), *ys)


def run_segments(segments: list[tuple], carry, per_layer_inputs: tuple = ()):
    """``run_layers`` over consecutive runs of layers, in order: ``segments`` are ``(block, layers,
    count)``, each run's own layer function and weights (families whose layers are of two kinds keep
    a stacked group per kind). Per-layer inputs [L, ...] are split between the runs; outputs are
    concatenated back to [L, ...] (None when the blocks return none)."""
    outs, start = [], 0
    for block, layers, count in segments:
        inputs = tuple(a[start : start + count] for a in per_layer_inputs)
        carry, ys = run_layers(block, carry, layers, inputs)
        outs.append(ys)
        start += count
    ys = None if outs[0] is None else jax.tree.map(lambda *parts: jnp.concatenate(parts), *outs)
    return carry, ys


def embed_rows(embed: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The residual stream's first rows [B*N, D] (token embeddings in the model dtype). Kept as rows:
    every projection is then a 2-D matmul, whose backward transposes XLA:CPU emits about 3x faster
    than those of [B, N, D] dots."""
    return jnp.take(embed, tokens.reshape(-1), axis=0).astype(dtype)


def logit_positions(x: jax.Array, batch: int, length: int, logits_from: int, logit_index) -> jax.Array:
    """Hidden states [B, N', D] of the positions whose logits a forward returns, from rows x [B*N, D]:
    positions ``logits_from`` on, or those ``logit_index`` [B, W] names."""
    h = x.reshape(batch, length, -1)
    return h[:, logits_from:] if logit_index is None else jnp.take_along_axis(h, logit_index[..., None], axis=1)


class DiffusionLM(nnx.Module):
    """Token ids [B, N] -> raw (unshifted) logits [B, N, V] in float32 (optionally of a suffix)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
        unroll_layers: bool = False,
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        per_layer = {}
        for name, shape in param_shapes(config).items():
            value = initial_value(name, shape, self.dtype, rngs)
            if unroll_layers and name not in TOP_PARAMS:
                per_layer[name] = value
            else:
                setattr(self, name, nnx.Param(value))
        # Unrolled: layers[i][name] is layer i's slice of the stacked parameter ``name``.
        self.layers = unrolled_layers(per_layer, config.n_layers) if unroll_layers else None

    @property
    def unrolled(self) -> bool:
        return self.layers is not None

    def layer_param_names(self) -> list[str]:
        return list(LAYER_PARAMS) + (list(BIAS_PARAMS) if self.config.qkv_bias else [])

    def layer_weights(self) -> dict[str, jax.Array]:
        """Every layer parameter stacked on the layer axis [L, ...] (stacked on the fly if unrolled)."""
        if self.unrolled:
            return stacked_weights(self.layers, self.layer_param_names())
        return {name: getattr(self, name)[...] for name in self.layer_param_names()}

    def set_param(self, name: str, value: jax.Array) -> None:
        """Set a parameter from its stacked value (as ``param_shapes`` gives it), in either layout."""
        if self.unrolled and name not in TOP_PARAMS:
            set_unrolled(self.layers, name, value)
        else:
            getattr(self, name).set_value(value)

    def _run_layers(self, block, carry, per_layer_inputs: tuple = ()):
        """``run_layers`` over this model's layers, in its layout."""
        return run_layers(block, carry, self.layers if self.unrolled else self.layer_weights(), per_layer_inputs)

    def head_weight(self) -> jax.Array:
        return self.embed[...].T if self.config.tie_embeddings else self.lm_head[...]

    def __call__(
        self,
        tokens: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        logits_from: int = 0,
        logit_index: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, N - logits_from, V] of positions ``logits_from`` on, or [B, W, V] of the positions
        ``logit_index`` [B, W] names: a decoder reads only the positions it can commit, and the
        vocabulary projection of the others (a long prompt, the blocks after the current one) is
        wasted work and memory."""
        return self._full(tokens, attention_mask, positions, False, logits_from, logit_index)[0]

    def prefill(
        self,
        tokens: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        logits_from: int = 0,
        logit_index: jax.Array | None = None,
        into: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``__call__`` that also returns every layer's keys and values (keys after RoPE).

        Returns (logits [B, N - logits_from, V], keys [L, B, N, KV, hd], values [L, B, N, KV, hd]):
        the block KV cache that ``window`` attends to. With ``into = (keys, values, rows [B])`` each
        layer's fresh keys/values replace that layer's rows ``rows`` of the given cache as the layer
        runs, and the updated cache is returned: a refresh then holds one cache, not a fresh copy
        beside the old one (at LLaDA-8B's batch 32 / 1152 tokens each copy is 18 GiB).
        """
        return self._full(tokens, attention_mask, positions, True, logits_from, logit_index, into)

    def positions(self, attention_mask: jax.Array | None, batch: int, length: int) -> jax.Array:
        """Position ids [B, N] of a forward without explicit positions (``default_positions``)."""
        return default_positions(self.config, attention_mask, batch, length)

    def _full(self, tokens, attention_mask, positions, collect_kv: bool, logits_from: int, logit_index, into=None):
        cfg = self.config
        batch, length = tokens.shape
        if positions is None:
            positions = self.positions(attention_mask, batch, length)
        # Keys at pad positions are masked for every query; queries are never masked.
        key_mask = None if attention_mask is None else attention_mask.astype(bool)[:, None, None, :]
        sin, cos = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        x = embed_rows(self.embed[...], tokens, self.dtype)

        def layer_out(h: jax.Array, w: dict[str, jax.Array]):
            q, k, v = self._project(rms_norm(h, w["attn_norm"], cfg.norm_eps), w, sin, cos, (batch, length))
            out = attention(q, k, v, key_mask)
            h = h + matmul(out.reshape(batch * length, cfg.n_heads * cfg.head_dim), w["wo"])
            return self._mlp(h, w, batch), k, v

        if into is None:

            def block(h: jax.Array, layer: tuple[dict[str, jax.Array]]):
                h, k, v = layer_out(h, layer[0])
                return h, ((k, v) if collect_kv else None)

            x, kv = self._run_layers(block, x)
        else:
            cache_k, cache_v, rows = into
            pick = rows[:, None, None, None]

            def block(carry, layer):
                (h, ck, cv), (w, i) = carry, layer
                h, k, v = layer_out(h, w)
                put = lambda c, new: jax.lax.dynamic_update_index_in_dim(c, jnp.where(pick, new, c[i]), i, 0)
                return (h, put(ck, k), put(cv, v)), None

            (x, *kv), _ = self._run_layers(block, (x, cache_k, cache_v), (np.arange(cfg.n_layers),))
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
    ) -> jax.Array:
        """Run M windows of W query positions per row against the row's cached keys/values.

        tokens/positions [B, M, W]; cache_k/cache_v [L, B, N, KV, hd] (from ``prefill``);
        cache_mask [B, N]: cached keys to attend (False at pads and at the window's own positions,
        whose fresh keys/values replace the cached ones); window_mask [B, W]: window keys to attend.
        Returns the logits of the first ``out_length`` window positions, [B, M, out_length, V].
        """
        cfg = self.config
        batch, m, width = tokens.shape
        flat_pos = positions.reshape(batch * m, width)
        sin, cos = rope_tables(flat_pos, cfg.head_dim, cfg.rope_theta)
        x = embed_rows(self.embed[...], tokens, self.dtype)

        def block(h: jax.Array, layer):
            w, ck, cv = layer
            q, k, v = self._project(rms_norm(h, w["attn_norm"], cfg.norm_eps), w, sin, cos, (batch * m, width))
            split = lambda a: a.reshape(batch, m, width, *a.shape[2:])
            out = cached_attention(split(q), split(k), split(v), ck, cv, cache_mask, window_mask)
            h = h + matmul(out.reshape(batch * m * width, cfg.n_heads * cfg.head_dim), w["wo"])
            return self._mlp(h, w, batch), None

        x, _ = self._run_layers(block, x, (cache_k, cache_v))
        logits = self._head(x.reshape(batch * m, width, -1)[:, :out_length])
        return logits.reshape(batch, m, out_length, -1)

    def _head(self, x: jax.Array) -> jax.Array:
        return rounded_head(x, self.final_norm[...], self.head_weight(), self.config.norm_eps)

    def _mlp(self, h: jax.Array, w: dict[str, jax.Array], batch: int) -> jax.Array:
        """The residual rows [B*N, D] after the layer's SwiGLU feed-forward. ``batch``: how many
        sequences the rows are (unused here; a mixture of experts splits rows over a mesh by it)."""
        y = rms_norm(h, w["mlp_norm"], self.config.norm_eps)
        return h + swiglu_mlp(y, w["w_gate"], w["w_up"], w["w_down"])

    def _project(self, x, w, sin, cos, shape: tuple[int, int]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, N, H, hd], k and v [B, N, KV, hd] of rows x [B*N, D]; RoPE applied to q and k."""
        cfg = self.config
        batch, length = shape
        q, k, v = matmul(x, w["wq"]), matmul(x, w["wk"]), matmul(x, w["wv"])
        if cfg.qkv_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        q = apply_rope(q.reshape(batch, length, cfg.n_heads, cfg.head_dim), sin, cos)
        k = apply_rope(k.reshape(batch, length, cfg.n_kv_heads, cfg.head_dim), sin, cos)
        v = v.reshape(batch, length, cfg.n_kv_heads, cfg.head_dim)
        return q, k, v


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    cache_mask: jax.Array,
    window_mask: jax.Array,
) -> jax.Array:
    """Attention of window queries over [cached keys (masked by cache_mask) ; the window's own keys].

    q [B, M, W, H, hd]; k, v [B, M, W, KV, hd]; cache_k, cache_v [B, N, KV, hd]; cache_mask
    [B, N]; window_mask: the window keys to attend, [B, W] for every query or [B, M, W, W] query by
    key (``cpu_kernels.cache_window_probs``). The M windows of a row share its cache (the GPU/TPU
    form never copies it; the CPU form copies one kv head's at a time for a few windows). Returns
    [B, M, W, H, hd]. Softmax in float32; head h uses kv head h // (H / KV) (as GQA).
    """
    if on_cpu():
        return cpu_kernels.cached_attention_per_head(q, k, v, cache_k, cache_v, cache_mask, window_mask)
    return cached_attention_grouped(q, k, v, cache_k, cache_v, cache_mask, window_mask)


def cached_attention_grouped(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    cache_mask: jax.Array,
    window_mask: jax.Array,
    round_once: bool = False,
) -> jax.Array:
    """``cached_attention`` as head-batched products over [KV, H / KV] groups (the GPU/TPU form).

    ``round_once`` sums the cache's and the window's value products in float32 and rounds once (as
    upstream LLaDA2.0 does, whose ``models.llada2`` window uses this form on every backend); otherwise
    each is rounded to the value dtype before they are added."""
    batch, m, width, heads, hd = q.shape
    kv_heads = k.shape[3]
    n = cache_k.shape[1]
    qg = q.reshape(batch, m, width, kv_heads, heads // kv_heads, hd)
    scale = 1.0 / (hd**0.5)
    s_cache = jnp.einsum("bmwkgd,bnkd->bmkgwn", qg, cache_k, preferred_element_type=jnp.float32) * scale
    s_win = jnp.einsum("bmwkgd,bmukd->bmkgwu", qg, k, preferred_element_type=jnp.float32) * scale
    probs = cpu_kernels.cache_window_probs(s_cache, s_win, cache_mask, window_mask, v.dtype)
    accumulate = jnp.float32 if round_once else None
    out = jnp.einsum("bmkgwn,bnkd->bmwkgd", probs[..., :n], cache_v, preferred_element_type=accumulate)
    out += jnp.einsum("bmkgwu,bmukd->bmwkgd", probs[..., n:], v, preferred_element_type=accumulate)
    return out.astype(v.dtype).reshape(batch, m, width, heads, hd)
