"""DiffusionGemma (upstream ``DiffusionGemmaForBlockDiffusion``, transformers ``models/diffusion_gemma``)
as a Flax NNX module: one text stack run in two modes on the same weights.

- **Encoder** (``encode``): causal over the prompt, later over each finished canvas, attending to
  what was encoded before; it writes the key/value cache and returns the final-norm hidden states
  (the encoder has no logits).
- **Denoiser** (``denoise``): the canvas attends bidirectionally to the cached prefix and the whole
  canvas; it reads the cache and never writes it, and returns soft-capped logits.

A layer (Gemma 4's): ``h = x + post_attention_norm(attn(input_norm(x)))``; a dense GeLU-gated MLP
and a routed mixture of experts side by side on ``h`` (the router reads the un-normed ``h``: a
scale-free RMSNorm times ``router_scale`` and ``d_model**-0.5``, float32 softmax over every expert,
top-k renormalised to sum 1, times the expert's ``expert_scale``); ``out = (h + post_ff_norm(dense
+ moe)) * layer_scalar``, the scalar the one weight the two modes do not share. Attention: q/k
RMSNorms per head, RoPE after them, values RMS-normed without a weight, score scale 1 (no
1/sqrt(d)), GQA. Sliding layers (``head_dim``, ``n_kv_heads``, RoPE on every dim) see keys
``q - window < k <= q`` when encoding and the last ``window - 1`` cached positions when denoising
(no window inside the canvas); full layers (``global_head_dim``, ``n_global_kv_heads``,
"proportional" RoPE on the first ``global_partial_rotary`` of the dims' frequencies, the rest
unrotated) see every cached position, and their value is the raw key projection (no ``wv``).

The denoiser's input is self-conditioned on the previous step's processed logits:
``rmsnorm(embed(canvas) + mlp(pre_norm(softmax(sc) @ embed * sqrt(D))))`` with a scale-free outer
norm (a row without logits feeds zeros, so its input is ``rmsnorm(embed(canvas))``). Logits are
the tied head's, cast to float32, then ``softcap * tanh(x / softcap)``.

The cache (``Cache``: keys, values, the positions they were encoded at, and which are real) keeps
every encoded position of a full layer and, as upstream does, only the last ``window - 1`` of a
sliding layer (``Cache.for_decode``, ``Cache.with_canvas``): the ones its masks let through.
Positions are absolute (``arange`` over the left-padded row): padding does not shift them, and pad
keys are masked everywhere.

Parameters: top-level ``embed``, ``final_norm`` and the self-conditioning MLP (``sc_*``); then each
layer's own arrays, ``layer<i>_<name>`` (``layer_types`` says which names a layer has). Not stacked
on a layer axis: the layers are unrolled (the kinds interleave), and a layer's slice of a stacked
expert array feeds the grouped product as a copy, which XLA schedules for every layer at once
(the 26B model's temporaries grew by the size of its experts; docs/diffusion-gemma.md). Float32 numerics as upstream: norms in float32, RoPE tables in float32,
router softmax in float32, logits in float32.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .diffusion_gemma_config import GROUPS, DiffusionGemmaConfig
from .moe import routed_experts
from .quantize import host_device, is_quantized, place_quantized, quantize_weight, quantized_matmul

ATTENTION = ("input_norm", "wq", "wk", "wv", "q_norm", "k_norm", "wo", "post_attention_norm")
DENSE = ("pre_ff_norm", "w_gate", "w_up", "w_down", "post_ff_norm_1")
ROUTED = ("router", "router_scale", "expert_scale", "pre_ff_norm_2", "expert_gate_up", "expert_down", "post_ff_norm_2")
LAYER = (*ATTENTION, *DENSE, *ROUTED, "post_ff_norm", "encoder_scalar", "denoiser_scalar")
SELF_CONDITIONING = ("sc_pre_norm", "sc_gate", "sc_up", "sc_down")


def layer_shapes(cfg: DiffusionGemmaConfig, group: str) -> dict[str, tuple[int, ...]]:
    """One layer's parameters in ``group`` ("sliding": with ``wv``; "full": value = key projection)."""
    d, f, e, fm = cfg.d_model, cfg.mlp_hidden, cfg.n_experts, cfg.moe_hidden
    kv, hd = cfg.kv_shape(group)
    shapes = {
        "input_norm": (d,),
        "wq": (d, cfg.n_heads * hd),
        "wk": (d, kv * hd),
        "wv": (d, kv * hd),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "wo": (cfg.n_heads * hd, d),
        "post_attention_norm": (d,),
        "pre_ff_norm": (d,),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
        "post_ff_norm_1": (d,),
        "router": (d, e),
        "router_scale": (d,),
        "expert_scale": (e,),
        "pre_ff_norm_2": (d,),
        "expert_gate_up": (e, d, 2 * fm),  # unit j's gate at column 2j, its up at 2j + 1
        "expert_down": (e, fm, d),
        "post_ff_norm_2": (d,),
        "post_ff_norm": (d,),
        "encoder_scalar": (),
        "denoiser_scalar": (),
    }
    if group == "full":
        del shapes["wv"]
    return shapes


def param_shapes(cfg: DiffusionGemmaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter by name: the top level, then layer i's ``layer<i>_<name>``."""
    d, f = cfg.d_model, cfg.mlp_hidden
    shapes = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "sc_pre_norm": (d,),
        "sc_gate": (d, f),
        "sc_up": (d, f),
        "sc_down": (f, d),
    }
    for i, kind in enumerate(cfg.layer_types):
        shapes.update({f"layer{i}_{name}": s for name, s in layer_shapes(cfg, GROUPS[kind]).items()})
    return shapes


# Logical axes by base name (``psd_jax.parallel.sharding.LOGICAL_RULES`` maps them to mesh axes):
# heads, MLP units and the vocabulary over ``model``, the experts over ``expert``; norms, the
# router and the layer scalars replicated. A layer's ``layer<i>_<name>`` has its base name's axes.
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "sc_pre_norm": ("embed",),
    "sc_gate": ("embed", "mlp"),
    "sc_up": ("embed", "mlp"),
    "sc_down": ("mlp", "embed"),
    "input_norm": ("embed",),
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "wo": ("heads", "embed"),
    "post_attention_norm": ("embed",),
    "pre_ff_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "post_ff_norm_1": ("embed",),
    "router": ("embed", "router"),
    "router_scale": ("embed",),
    "expert_scale": ("router",),
    "pre_ff_norm_2": ("embed",),
    "expert_gate_up": ("experts", "embed", "expert_mlp"),
    "expert_down": ("experts", "expert_mlp", "embed"),
    "post_ff_norm_2": ("embed",),
    "post_ff_norm": ("embed",),
    "encoder_scalar": (),
    "denoiser_scalar": (),
}


LAYER_NAME = re.compile(r"layer(\d+)_(\w+)")


def logical_axes(name: str) -> tuple[str | None, ...]:
    """The logical axes of parameter ``name`` as ``param_shapes`` names it."""
    per_layer = LAYER_NAME.fullmatch(name)
    return LOGICAL_AXES[per_layer.group(2) if per_layer else name]


def param_count(cfg: DiffusionGemmaConfig) -> int:
    """Text parameters as upstream counts them once (the tied LM head and encoder weights not
    again, the ``layer_scalar`` buffers not at all), self-conditioning included."""
    return sum(math.prod(s) for name, s in param_shapes(cfg).items() if not name.endswith("_scalar"))


def active_param_count(cfg: DiffusionGemmaConfig) -> int:
    """Parameters one token reads: every text parameter but the routed experts it does not choose."""
    routed = 3 * cfg.d_model * cfg.moe_hidden * cfg.n_layers
    return param_count(cfg) - routed * (cfg.n_experts - cfg.n_experts_per_tok)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    """What the encoder wrote, per layer: keys and values [B, L_i, KV, hd] (after k-norm and RoPE;
    values v-normed), the position each slot was encoded at and whether it holds a real token
    [B, L_i]. ``encode`` returns the slots of what it encoded (every layer's alike); a decode
    carries ``for_decode``'s layout, into which ``with_canvas`` writes each finished canvas."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    positions: tuple[jax.Array, ...]
    valid: tuple[jax.Array, ...]

    def for_decode(self, cfg: DiffusionGemmaConfig, slots: int) -> Cache:
        """This cache (an ``encode`` of the prompt) laid out for a decode: a full layer's slots,
        then ``slots`` empty ones for the canvases (``with_canvas`` writes them); a sliding layer's
        last ``window - 1`` slots, all its denoiser sees, as upstream keeps them (a shift register
        that each canvas moves on: its memory does not grow with the context; fewer slots when the
        whole decode has fewer positions)."""
        out: dict[str, list[jax.Array]] = {"keys": [], "values": [], "positions": [], "valid": []}
        for i, kind in enumerate(cfg.layer_types):
            k, v, pos, ok = self.keys[i], self.values[i], self.positions[i], self.valid[i]
            batch, length = ok.shape
            if GROUPS[kind] == "sliding":  # no more than the whole decode's positions either
                ring = min(cfg.sliding_window - 1, length + slots)
                k, v, pos, ok = (_last(x, fill, ring) for x, fill in ((k, 0), (v, 0), (pos, -1), (ok, False)))
            else:
                grow = lambda x, tail: jnp.concatenate([x, tail.astype(x.dtype)], axis=1)  # noqa: E731
                k = grow(k, jnp.zeros((batch, slots, *k.shape[2:])))
                v = grow(v, jnp.zeros((batch, slots, *v.shape[2:])))
                pos = grow(pos, jnp.broadcast_to(length + jnp.arange(slots, dtype=jnp.int32), (batch, slots)))
                ok = grow(ok, jnp.zeros((batch, slots), bool))
            for name, value in zip(out, (k, v, pos, ok)):
                out[name].append(value)
        return Cache(**{name: tuple(values) for name, values in out.items()})

    def with_canvas(self, cfg: DiffusionGemmaConfig, new: Cache, offset) -> Cache:
        """``new`` (an ``encode`` of a finished canvas) written in: into a full layer's canvas slots
        from ``offset`` (one for every row, or each row's own [B]); into a sliding layer's last
        ``window - 1``, its oldest slots out."""
        out: dict[str, list[jax.Array]] = {"keys": [], "values": [], "positions": [], "valid": []}
        for i, kind in enumerate(cfg.layer_types):
            parts = (self.keys[i], self.values[i], self.positions[i], self.valid[i])
            fresh = (new.keys[i], new.values[i], new.positions[i], new.valid[i])
            if GROUPS[kind] == "sliding":
                done = [jnp.concatenate([old, add], axis=1)[:, -old.shape[1] :] for old, add in zip(parts, fresh)]
            else:  # the canvas slots' positions are laid out by ``for_decode``
                keys, values, positions, valid = parts
                done = [write_rows(keys, fresh[0], offset), write_rows(values, fresh[1], offset), positions,
                        write_rows(valid, fresh[3], offset)]  # fmt: skip
            for name, value in zip(out, done):
                out[name].append(value)
        return Cache(**{name: tuple(values) for name, values in out.items()})


def _last(x: jax.Array, fill, n: int) -> jax.Array:
    """The last ``n`` slots of x [B, L, ...] along axis 1, ``fill`` before them where L < n."""
    pad = jnp.full((x.shape[0], n, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([pad, x], axis=1)[:, -n:]


def write_rows(array: jax.Array, new: jax.Array, offset) -> jax.Array:
    """``new`` [B, n, ...] into ``array`` [B, L, ...] from position ``offset`` of axis 1: one
    offset for every row, or each row's own [B]."""
    if jnp.ndim(offset) == 0:
        return jax.lax.dynamic_update_slice_in_dim(array, new.astype(array.dtype), offset, 1)
    update = lambda a, n, o: jax.lax.dynamic_update_slice_in_dim(a, n.astype(a.dtype), o, 0)  # noqa: E731
    return jax.vmap(update)(array, new, offset)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Upstream's ``DiffusionGemmaRMSNorm``: ``x * (mean(x^2) + eps)^-0.5`` in float32, times the
    weight (not 1 + weight) when it has one, in x's dtype."""
    x32 = x.astype(jnp.float32)
    out = x32 * jax.lax.pow(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.astype(jnp.float32)
    return out.astype(x.dtype)


def gelu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``gelu_pytorch_tanh(gate) * up``."""
    return jax.nn.gelu(gate, approximate=True) * up


def inv_freq(cfg: DiffusionGemmaConfig, group: str) -> np.ndarray:
    """RoPE inverse frequencies [hd / 2] in float32: every dim's for sliding layers; for full layers
    ("proportional") the first ``partial * hd / 2`` of ``theta^(-2i / hd)``, zeros after them."""
    _, hd = cfg.kv_shape(group)
    theta, partial = (cfg.rope_theta, 1.0) if group == "sliding" else (cfg.global_rope_theta, cfg.global_partial_rotary)
    rotated = int(partial * hd // 2)
    freqs = np.zeros(hd // 2, np.float32)
    freqs[:rotated] = 1.0 / (theta ** (np.arange(0, 2 * rotated, 2, dtype=np.float32) / hd))
    return freqs


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """Rotate-half RoPE of x [B, N, heads, hd] at ``positions`` [B, N] (pairs i, i + hd/2)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(freqs)
    emb = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Scale-1 softmax attention of q [B, N, H, hd] over k, v [B, M, KV, hd] under ``mask`` [B, N, M]
    (float32 scores); a query with no visible key (a pad row) gets zeros."""
    batch, n, heads, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(batch, n, kv, heads // kv, hd)
    scores = jnp.einsum("bnkgd,bmkd->bkgnm", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1, where=mask[:, None, None])
    weights = jnp.where(mask[:, None, None], weights, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgnm,bmkd->bnkgd", weights, v)
    return out.reshape(batch, n, heads * hd)


# Stored as qwix integers and scales under ``quantize`` (``from_params``): each layer's attention
# and dense projections and its routed experts. The embedding (also the tied head), the norms, the
# router and the self-conditioning MLP stay in the model dtype, as for the other families.
QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "expert_gate_up", "expert_down")


def is_quantized_name(name: str) -> bool:
    """Whether parameter ``name`` (``param_shapes``') is stored quantized under ``quantize``."""
    layer = LAYER_NAME.fullmatch(name)
    return layer is not None and layer.group(2) in QUANTIZED


def _mm(x: jax.Array, w) -> jax.Array:
    """``x @ w``, through qwix for a quantized ``w`` (float32 accumulation, in ``x``'s dtype)."""
    return quantized_matmul(x, w) if is_quantized(w) else x @ w


class DiffusionGemma(nnx.Module):
    """Parameters by ``param_shapes`` name, and the two modes (module docstring)."""

    param_table = staticmethod(param_shapes)

    def __init__(self, config: DiffusionGemmaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config, self.dtype = config, jnp.dtype(dtype)
        rngs = rngs or nnx.Rngs(0)
        for name, shape in param_shapes(config).items():
            if name.endswith(("norm", "_scale", "_scalar")):
                value = jnp.ones(shape, self.dtype)
            else:
                value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(self.dtype)
            setattr(self, name, nnx.Param(value))

    @classmethod
    def from_params(
        cls,
        config: DiffusionGemmaConfig,
        params: dict,
        *,
        dtype=jnp.float32,
        shardings: dict | None = None,
        quantize: str | None = None,
    ) -> DiffusionGemma:
        """The module holding ``params`` (``param_shapes`` names; e.g. ``convert.diffusion_gemma.read_params``),
        each placed straight into its shards when ``shardings`` (by name) is given; ``quantize``
        ("int8", "int4"): the layers' projections and experts (``QUANTIZED``) stored as qwix
        integers and scales, quantized on the host (``models.quantize``)."""
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype))
        missing = set(param_shapes(config)) - set(params)
        if missing:
            raise ValueError(f"parameters missing: {', '.join(sorted(missing))}")
        for name, value in params.items():
            target = None if shardings is None else shardings[name]
            if quantize is not None and is_quantized_name(name):
                host = jax.device_put(np.asarray(value).astype(dtype), host_device())
                getattr(model, name).set_value(place_quantized(quantize_weight(host, quantize), target))
            elif target is None:
                getattr(model, name).set_value(jnp.asarray(value, dtype))
            else:
                getattr(model, name).set_value(jax.device_put(np.asarray(value).astype(dtype), target))
        return model

    # ------------------------------------------------------------------------------- the modes
    def encode(self, ids: jax.Array, positions: jax.Array, valid: jax.Array, cache: Cache | None = None):
        """Causal encoding of ``ids`` [B, N] at ``positions`` [B, N] (``valid``: real tokens) after
        ``cache`` (what was encoded before, or None): final-norm hidden states [B, N, D] and the
        cache of these N slots alone (``Cache.for_decode`` and ``Cache.with_canvas`` keep them)."""
        cfg = self.config
        x = self._embed(ids)
        new_k, new_v = [], []
        for i in range(cfg.n_layers):
            group, w = self._layer(i)
            keys_pos, keys_valid = positions, valid
            if cache is not None:
                keys_pos = jnp.concatenate([cache.positions[i], positions], axis=1)
                keys_valid = jnp.concatenate([cache.valid[i], valid], axis=1)
            distance = positions[:, :, None] - keys_pos[:, None, :]
            mask = keys_valid[:, None, :] & (distance >= 0)
            if group == "sliding":
                mask = mask & (distance < cfg.sliding_window)
            past = None if cache is None else (cache.keys[i], cache.values[i])
            x, (k, v) = self._block(x, w, group, positions, mask, past, w["encoder_scalar"])
            new_k.append(k)
            new_v.append(v)
        hidden = rms_norm(x, self.final_norm[...], cfg.norm_eps)
        n = cfg.n_layers
        return hidden, Cache(tuple(new_k), tuple(new_v), (positions,) * n, (valid,) * n)

    def denoise(
        self,
        canvas: jax.Array,
        positions: jax.Array,
        cache: Cache,
        sc_probs: jax.Array | None = None,
        sc_on: jax.Array | None = None,
    ) -> jax.Array:
        """Float32 soft-capped logits [B, C, V] of ``canvas`` [B, C] at ``positions`` [B, C], attending
        to ``cache`` and the whole canvas; ``sc_probs`` [B, C, V] the softmax, in float32, of the
        previous step's processed logits (upstream's ``self_conditioning_logits``; the sampler has
        it already, from the step's entropy and draws; None: the first step of a canvas, no
        self-conditioning), ``sc_on`` [B] the rows they condition (the others as without them:
        upstream's ``self_conditioning_mask``)."""
        cfg = self.config
        x = self._sc_input(canvas, sc_probs, sc_on)
        batch, length = canvas.shape
        canvas_mask = jnp.ones((batch, length, length), bool)
        window_start = positions[:, :1] - (cfg.sliding_window - 1)  # a sliding layer's oldest cached position
        for i in range(cfg.n_layers):
            group, w = self._layer(i)
            cached = cache.valid[i]
            if group == "sliding":
                cached = cached & (cache.positions[i] >= window_start)
            mask = jnp.concatenate(
                [jnp.broadcast_to(cached[:, None, :], (batch, length, cached.shape[1])), canvas_mask], 2
            )
            x, _ = self._block(x, w, group, positions, mask, (cache.keys[i], cache.values[i]), w["denoiser_scalar"])
        return self._logits(rms_norm(x, self.final_norm[...], cfg.norm_eps))

    # ------------------------------------------------------------------------------- pieces
    def _layer(self, index: int) -> tuple[str, dict[str, jax.Array]]:
        """Layer ``index``'s group and weights."""
        group = GROUPS[self.config.layer_types[index]]
        return group, {name: getattr(self, f"layer{index}_{name}")[...] for name in layer_shapes(self.config, group)}

    def _embed(self, ids: jax.Array) -> jax.Array:
        scale = jnp.asarray(self.config.embed_scale, jnp.float32).astype(self.dtype)
        return self.embed[...][ids] * scale

    def _sc_input(self, canvas: jax.Array, sc_probs: jax.Array | None, sc_on: jax.Array | None) -> jax.Array:
        cfg = self.config
        e = self._embed(canvas)
        if sc_probs is None:
            soft = jnp.zeros_like(e)
        else:
            probs = sc_probs.astype(self.dtype)
            scale = jnp.asarray(cfg.embed_scale, jnp.float32).astype(self.dtype)

            def product() -> jax.Array:
                return jnp.einsum("bcv,vd->bcd", probs, self.embed[...]) * scale

            if sc_on is None:
                soft = product()
            else:
                # Skipped where no row conditions (a canvas's first step in the sampler's loop): the
                # product with the embedding is as costly as the head.
                soft = jax.lax.cond(jnp.any(sc_on), product, lambda: jnp.zeros_like(e))
                soft = jnp.where(sc_on[:, None, None], soft, 0.0)
        n = rms_norm(soft, self.sc_pre_norm[...], cfg.norm_eps)
        signal = gelu_glu(n @ self.sc_gate[...], n @ self.sc_up[...]) @ self.sc_down[...]
        return rms_norm(e + signal, None, cfg.norm_eps)

    def _block(self, x, w, group, positions, mask, past, scalar):
        """One layer on x [B, N, D]; ``past`` the cached (keys, values) this layer attends before its
        own, or None. Returns the layer's output and its own (keys, values)."""
        cfg = self.config
        batch, n, d = x.shape
        kv, hd = cfg.kv_shape(group)
        freqs = inv_freq(cfg, group)
        y = rms_norm(x, w["input_norm"], cfg.norm_eps)
        q = _mm(y, w["wq"]).reshape(batch, n, cfg.n_heads, hd)
        raw_k = _mm(y, w["wk"]).reshape(batch, n, kv, hd)
        raw_v = _mm(y, w["wv"]).reshape(batch, n, kv, hd) if "wv" in w else raw_k
        q = apply_rope(rms_norm(q, w["q_norm"], cfg.norm_eps), positions, freqs)
        k = apply_rope(rms_norm(raw_k, w["k_norm"], cfg.norm_eps), positions, freqs)
        v = rms_norm(raw_v, None, cfg.norm_eps)
        keys, values = (k, v) if past is None else (jnp.concatenate([past[0], k], 1), jnp.concatenate([past[1], v], 1))
        attn = _mm(attend(q, keys, values, mask), w["wo"])
        h = x + rms_norm(attn, w["post_attention_norm"], cfg.norm_eps)
        rows = h.reshape(batch * n, d)
        dense_in = rms_norm(rows, w["pre_ff_norm"], cfg.norm_eps)
        dense = _mm(gelu_glu(_mm(dense_in, w["w_gate"]), _mm(dense_in, w["w_up"])), w["w_down"])
        dense = rms_norm(dense, w["post_ff_norm_1"], cfg.norm_eps)
        chosen, weights = self._route(rows, w)
        experts_in = rms_norm(rows, w["pre_ff_norm_2"], cfg.norm_eps)
        moe = routed_experts(experts_in, chosen, weights, w["expert_gate_up"], None, w["expert_down"], gelu_glu,
                             batch=batch)  # fmt: skip
        moe = rms_norm(moe, w["post_ff_norm_2"], cfg.norm_eps)
        out = (rows + rms_norm(dense + moe, w["post_ff_norm"], cfg.norm_eps)) * scalar
        return out.reshape(batch, n, d), (k, v)

    def _route(self, rows: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Chosen experts [T, k] and their weights [T, k] (float32) for rows [T, D] (un-normed)."""
        cfg = self.config
        scaled = rms_norm(rows, None, cfg.norm_eps) * w["router_scale"] * jnp.asarray(cfg.d_model**-0.5, rows.dtype)
        scores = jnp.dot(scaled, w["router"], preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
        top, chosen = jax.lax.top_k(probs, cfg.n_experts_per_tok)
        top = top / top.sum(axis=-1, keepdims=True)
        return chosen.astype(jnp.int32), top * w["expert_scale"].astype(jnp.float32)[chosen]

    def _logits(self, hidden: jax.Array) -> jax.Array:
        logits = jnp.einsum("bnd,vd->bnv", hidden, self.embed[...]).astype(jnp.float32)
        cap = self.config.final_softcap
        return cap * jnp.tanh(logits / cap) if cap else logits
