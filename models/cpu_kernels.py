"""XLA:CPU forms of ``models.transformer``'s kernels, used there when ``jax.default_backend() == "cpu"``.

Each computes what the backend-neutral form it replaces computes (up to float32 summation order)
and exists only because XLA:CPU compiles that form into slow code. The measurements behind each
are in docs/xla-vs-pytorch.md. ``cache_window_probs``, the masking and softmax that the CPU and the
GPU/TPU cache-attention forms share, lives here because ``models.transformer`` imports this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# XLA:CPU copies a layer's weights out of stacked arrays at every ``lax.scan`` step (about a third
# of a forward of a 58M-parameter model); weights in arrays of their own are read in place.
UNROLL_LAYERS = True


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w``; bfloat16 as a float32-out dot rounded once, which YNNPACK's bfloat16 GEMM serves
    (XLA:CPU rewrites a bfloat16-out dot as a float32 one on upcast operands, about 4x slower)."""
    if x.dtype == jnp.bfloat16:
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x @ w


def attention_per_head(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None) -> jax.Array:
    """``transformer.attention`` as one pair of [B, N, hd] products per head (XLA:CPU runs the
    [B, H]-batched products and head-major transposes of ``jax.nn.dot_product_attention`` slowly)."""
    heads, kv_heads, hd = q.shape[2], k.shape[2], q.shape[3]
    group = heads // kv_heads
    low = -0.7 * jnp.finfo(jnp.float32).max  # as jax.nn.dot_product_attention masks
    outs = []
    for h in range(heads):
        kh, vh = k[:, :, h // group], v[:, :, h // group]
        scores = jnp.einsum("bqd,bkd->bqk", q[:, :, h], kh, preferred_element_type=jnp.float32) / (hd**0.5)
        if key_mask is not None:
            scores = jnp.where(key_mask[:, 0], scores, low)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bqk,bkd->bqd", probs, vh, preferred_element_type=jnp.float32).astype(v.dtype))
    return jnp.stack(outs, axis=2)


# Up to this many windows per row, each head's cached keys are joined with each window's own: one
# product per head instead of a strided copy of the head's cache slice (1.13x a bfloat16 window call
# of LLaDA's shape at one window, 1.03x at 4); more windows would each copy the cache (0.94x at 11).
JOINED_WINDOWS_MAX = 4


def cached_attention_per_head(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    cache_mask: jax.Array,
    window_mask: jax.Array,
    join: bool | None = None,
) -> jax.Array:
    """``transformer.cached_attention`` as products per head, values returned in float32 and rounded
    once (``attention_per_head``'s and ``matmul``'s reasons).

    The cache is made head-major once per call, so a head's cached keys are one contiguous operand
    (XLA:CPU otherwise copies each head's strided slice, and first the layer's slice of the stacked
    cache). With at most ``JOINED_WINDOWS_MAX`` windows per row they are joined with each window's
    own keys, [cached ; window], for one score and one value product per head; with more, the cached
    and the window keys get a product each, so the windows share the row's cache uncopied. ``join``
    forces one form (``scripts/figures/cpu_cache_attention.py`` times both)."""
    batch, m, width, heads, hd = q.shape
    kv_heads, n = k.shape[3], cache_k.shape[1]
    group = heads // kv_heads
    cache_k, cache_v = cache_k.transpose(0, 2, 1, 3), cache_v.transpose(0, 2, 1, 3)  # [B, KV, N, hd]
    joined = lambda cache, fresh: jnp.concatenate([jnp.broadcast_to(cache[:, None], (batch, m, n, hd)), fresh], axis=2)
    dot = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    join = m <= JOINED_WINDOWS_MAX if join is None else join
    outs = []
    for h in range(heads):
        qh, g = q[:, :, :, h], h // group
        if join:
            keys, values = joined(cache_k[:, g], k[:, :, :, g]), joined(cache_v[:, g], v[:, :, :, g])
            scores = dot("bmwd,bmnd->bmwn", qh, keys) / (hd**0.5)
            probs = cache_window_probs(scores[..., :n], scores[..., n:], cache_mask, window_mask, v.dtype)
            out = dot("bmwn,bmnd->bmwd", probs, values)
        else:
            s_cache, s_win = dot("bmwd,bnd->bmwn", qh, cache_k[:, g]), dot("bmwd,bmud->bmwu", qh, k[:, :, :, g])
            probs = cache_window_probs(s_cache / (hd**0.5), s_win / (hd**0.5), cache_mask, window_mask, v.dtype)
            out = dot("bmwn,bnd->bmwd", probs[..., :n], cache_v[:, g])
            out += dot("bmwu,bmud->bmwd", probs[..., n:], v[:, :, :, g])
        outs.append(out.astype(v.dtype))
    return jnp.stack(outs, axis=3)


def cache_window_probs(
    s_cache: jax.Array, s_win: jax.Array, cache_mask: jax.Array, window_mask: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    """Attention probabilities over [cached keys ; window keys], rounded to ``dtype``, from float32
    scores s_cache [B, M, *heads, W, N] and s_win [B, M, *heads, W, W] (any head axes between; the
    grouped form has two, the per-head form none). A key is hidden (its score set to float32's lowest)
    where cache_mask [B, N] is False, or where window_mask is: [B, W] hides a window key from every
    query, [B, M, W, W] (query by key) per query, as block-causal attention needs. The one masking rule
    of every cache-attention form (``transformer.cached_attention_grouped``, ``cached_attention_per_head``)."""
    low = jnp.finfo(jnp.float32).min
    heads = tuple(range(2, s_win.ndim - 2))
    s_cache = jnp.where(jnp.expand_dims(cache_mask, (1, *heads, s_cache.ndim - 2)), s_cache, low)
    visible = window_mask[:, None, None, :] if window_mask.ndim == 2 else window_mask  # [B, 1, 1, W] or [B, M, W, W]
    s_win = jnp.where(jnp.expand_dims(visible, heads), s_win, low)
    return jax.nn.softmax(jnp.concatenate([s_cache, s_win], axis=-1), axis=-1).astype(dtype)


def materialized(table: jax.Array) -> jax.Array:
    """``table`` [B, N, ...] itself, read through an identity gather along N so that XLA computes it
    once per forward: it fuses cheap sin/cos into every consumer (each head's q and k RoPE, about 9%
    of a bfloat16 forward) but does not duplicate an expensive gather (an optimization barrier is
    removed before fusion, so it does not do this)."""
    index = jnp.broadcast_to(jnp.arange(table.shape[1])[None, :, None], table.shape[:2] + (1,))
    return jnp.take_along_axis(table, index, axis=1)
