"""The one model-calling primitive: K candidate canvases per row -> what policies need.

``predict`` flattens ``[B, K, N]`` canvases into a single ``[B*K, N]`` forward (doubled for
classifier-free guidance), applies the family's logit shift, suppresses the mask token, and turns
logits into a ``Prediction``: predicted token and its confidence per position, plus what RPS needs
(entropy, top-k probabilities) when asked. Decoders never see logits.

Only positions a decoder can commit get logits: with a ``LogitWindow`` (the engine's, of
``rules.logit_width`` from each row's block start, as the PyTorch backend's: the current block,
and for the uncached loop the next one too, whose predictions a row uses once its block
completes), else every generated position. The vocabulary projection, softmax and top-k of the
other positions would be wasted work, and their float32 logits ``[B*K, gen_length, vocab]`` the
largest buffer of a decode. The Prediction still spans the canvas: a position without logits
predicts its current token with zero confidence (no decoder reads or commits it).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from models import ModelConfig

from . import rules
from .runtime import Program, RowSampling, RowValues, candidate_keys
from .sampling import filtered, sampler_for

ENTROPY_EPS = 1e-10  # Dream's epsilon inside log for the entropy confidence


@struct.dataclass
class Prediction:
    token: jax.Array  # [..., N] int32 predicted token (argmax, or Gumbel-max sample if temperature > 0)
    conf: jax.Array  # [..., N] float32 policy confidence of `token`
    entropy: jax.Array | None = None  # [..., N] full-vocabulary entropy (RPS)
    topk_prob: jax.Array | None = None  # [..., N, k_max] (RPS)
    topk_id: jax.Array | None = None  # [..., N, k_max] (RPS)


def generated_logits(full, tokens: jax.Array, mask, prompt_length: int, shift: int):
    """Call ``full(tokens, mask, logits_from=...)`` for the logits of the generated positions only.

    Position i reads logit i - shift (Dream predicts position i at logit i - 1), so the first
    logit needed is ``prompt_length - shift``.
    Returns (logits [M, N - prompt_length, V], whatever else ``full`` returned)."""
    if prompt_length < shift:
        raise ValueError(f"a prompt of {prompt_length} tokens is too short for a logit shift of {shift}")
    out = full(tokens, mask, logits_from=prompt_length - shift)
    logits, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    return logits[:, : tokens.shape[1] - prompt_length], rest


@struct.dataclass
class LogitWindow:
    """The canvas positions [M, W] that get logits: ``width`` from each row's ``start``."""

    start: jax.Array  # [M] first position (a block start)
    width: int = struct.field(pytree_node=False)

    def positions(self) -> jax.Array:
        return rules.logit_positions(jnp, self.start, self.width)

    def logit_index(self, n: int, shift: int) -> jax.Array:
        """Logit rows the positions read (position i reads logit i - shift), inside the canvas."""
        return rules.logit_index(jnp, self.start, self.width, n, shift)

    def repeat(self, k: int) -> LogitWindow:
        return LogitWindow(jnp.repeat(self.start, k, axis=0), self.width)


def model_logits(full, tokens: jax.Array, mask, prompt_length: int, shift: int, window: LogitWindow | None):
    """Logits of the window's positions [M, W, V] (or of every generated position, without one)
    and whatever else ``full`` returned."""
    if window is None:
        return generated_logits(full, tokens, mask, prompt_length, shift)
    out = full(tokens, mask, logit_index=window.logit_index(tokens.shape[1], shift))
    return (out[0], out[1:]) if isinstance(out, tuple) else (out, ())


def on_canvas(pred: Prediction, canvas: jax.Array, prompt_length: int, window: LogitWindow | None) -> Prediction:
    """A Prediction of the window's (or the generated) positions -> of the whole canvas [M, N]."""
    if window is None:
        return with_prompt(pred, canvas[:, :prompt_length])
    m, n = canvas.shape
    positions = window.positions()
    positions = jnp.where(positions < n, positions, n)  # past the canvas end: dropped
    rows = jnp.arange(m)[:, None]

    def put(field: jax.Array, base: jax.Array) -> jax.Array:
        return base.at[rows, positions].set(field, mode="drop")

    def zeros_like_canvas(field: jax.Array) -> jax.Array:
        return jnp.zeros((m, n, *field.shape[2:]), field.dtype)

    placed = jax.tree.map(lambda f: put(f, zeros_like_canvas(f)), pred)
    return placed.replace(token=put(pred.token, canvas.astype(jnp.int32)))


def with_prompt(pred: Prediction, prompt: jax.Array) -> Prediction:
    """A Prediction of the generated positions [M, G] -> of the canvas [M, P + G]: each prompt
    position predicts its own token with zero confidence (no decoder reads or commits it)."""

    def pad(field: jax.Array) -> jax.Array:
        widths = [(0, 0), (prompt.shape[1], 0)] + [(0, 0)] * (field.ndim - 2)
        return jnp.pad(field, widths)

    padded = jax.tree.map(pad, pred)
    return padded.replace(token=jnp.concatenate([prompt.astype(jnp.int32), pred.token], axis=1))


def needs_rps_fields(program: Program) -> bool:
    return program.decoder == "rps"


def logits_to_prediction(
    logits: jax.Array, keys: jax.Array, sampling: RowSampling, mcfg: ModelConfig, program: Program
) -> Prediction:
    """Token choice and confidence from logits [M, N, V] (already shifted); ``keys`` [M, 2] and
    ``sampling`` (temperature, top-p, top-k [M]) are each row's own (``runtime``): a row's draws do
    not depend on the others. Temperature and filters follow the family's upstream sampler
    (``sampling.SAMPLERS``): which logits the token is drawn from and which softmax its confidence
    is scored on."""
    if not program.predict_mask:  # LLaDA's generate.py predicts it (``predict_mask``): a [MASK] written stays masked
        logits = logits.at[..., mcfg.mask_id].set(-jnp.inf)  # never predict [MASK]
    if program.logits_eos_inf:
        logits = logits.at[..., mcfg.eos_id].set(-jnp.inf)
    draws = jax.vmap(jax.random.split)(keys)
    sample_keys, conf_keys = draws[:, 0], draws[:, 1]
    sampler = sampler_for(mcfg.family)
    hot = sampling.temperature > 0  # [M]
    drawn = logits  # what the token is drawn from
    if program.samples:  # rows at temperature 0 stay greedy
        t = sampling.temperature[:, None, None]
        drawn = logits / jnp.where(t > 0, t, 1.0)
    if program.filters:  # each row's own top-p / top-k
        active = hot if not sampler.filters_at_greedy else jnp.ones_like(hot)
        drawn = jnp.where(active[:, None, None], filtered(drawn, sampling.top_p, sampling.top_k, sampler.order), drawn)
    if (program.samples or program.filters) and not program.predict_mask:
        # Tempering can turn the mask's -inf into NaN (-inf times a reciprocal flushed to zero), and a
        # NaN wins an argmax: [MASK] stays out of the draw whatever the temperature.
        drawn = drawn.at[..., mcfg.mask_id].set(-jnp.inf)
    token = jnp.argmax(logits, axis=-1)
    if program.samples:
        # Gumbel-max: argmax(l/T + G) samples softmax(l/T), as LLaDA's add_gumbel_noise does.
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:], jnp.float32))(sample_keys)
        token = jnp.where(hot[:, None], jnp.argmax(drawn + gumbel, axis=-1), token)
    # A committed position must hold a token: where every logit is -inf (or NaN) the argmax may be the
    # mask id (index 0), and a step that writes [MASK] commits nothing; such a row ends with EOS
    # instead of decoding forever. Under ``predict_mask`` a [MASK] is written as upstream writes it:
    # its blocks end after their steps whatever they hold (``rules.advance``).
    if not program.predict_mask:
        token = jnp.where(token == mcfg.mask_id, mcfg.eos_id, token)
    token = token.astype(jnp.int32)
    if sampler.confidence == "sampled":
        logits = drawn
    if program.confidence_eos_eot_inf and mcfg.eot_id is not None:
        # As LLaDA's generate.py: the EOT logit is removed before the confidence softmax.
        logits = logits.at[..., mcfg.eot_id].set(-jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    entropy = None
    if program.confidence == "entropy" or needs_rps_fields(program):
        entropy = -jnp.sum(probs * jnp.log(probs + ENTROPY_EPS), axis=-1)
    if program.confidence == "prob":
        conf = jnp.take_along_axis(probs, token[..., None], axis=-1)[..., 0]
    elif program.confidence == "margin":
        top2 = jax.lax.top_k(probs, 2)[0]
        conf = top2[..., 0] - top2[..., 1]
    elif program.confidence == "entropy":
        conf = -entropy
    else:  # random remasking
        conf = jax.vmap(lambda k: jax.random.uniform(k, token.shape[1:], jnp.float32))(conf_keys)
    pred = Prediction(token=token, conf=conf.astype(jnp.float32), entropy=entropy)
    if needs_rps_fields(program):
        topk_prob, topk_id = jax.lax.top_k(probs, program.k_max)
        pred = pred.replace(topk_prob=topk_prob, topk_id=topk_id.astype(jnp.int32))
    return pred


ForwardFn = Callable[
    ..., jax.Array
]  # (tokens [M, N], mask [M, N] | None, logits_from=) -> logits [M, N - logits_from, V]


def predict(
    forward: ForwardFn,
    canvases: jax.Array,
    attention_mask: jax.Array | None,
    prompt_length: int,
    keys: jax.Array,
    values: RowValues,
    mcfg: ModelConfig,
    program: Program,
    window: LogitWindow | None = None,
) -> Prediction:
    """One model call over canvases [B, K, N]; returns a Prediction with leading dims [B, K].

    ``keys`` [B, 2] and ``values`` are the rows' own (``runtime``); ``window`` (per row [B]) limits
    the logits to the positions a decoder can commit."""
    batch, k, n = canvases.shape
    flat = canvases.reshape(batch * k, n)
    mask = None if attention_mask is None else jnp.repeat(attention_mask, k, axis=0)
    window = None if window is None else window.repeat(k)
    shift = mcfg.logit_shift
    if program.guided:
        # Classifier-free guidance: the prompt replaced by [MASK] gives the unconditional branch.
        uncond = flat.at[:, :prompt_length].set(mcfg.mask_id)
        both_mask = None if mask is None else jnp.concatenate([mask, mask])
        both_window = None if window is None else LogitWindow(jnp.concatenate([window.start] * 2), window.width)
        both, _ = model_logits(forward, jnp.concatenate([flat, uncond]), both_mask, prompt_length, shift, both_window)
        cond_logits, uncond_logits = jnp.split(both, 2)
        scale = jnp.repeat(values.cfg_scale, k)[:, None, None]
        logits = uncond_logits + (scale + 1.0) * (cond_logits - uncond_logits)
    else:
        logits, _ = model_logits(forward, flat, mask, prompt_length, shift, window)
    pred = logits_to_prediction(logits, candidate_keys(keys, k), values.sampling(k), mcfg, program)
    pred = on_canvas(pred, flat, prompt_length, window)
    return jax.tree.map(lambda a: a.reshape(batch, k, *a.shape[1:]), pred)


def sequences_forwarded(batch: int, candidates, program: Program):
    """Sequences one ``predict`` call over ``candidates`` canvases per row processes (what
    ``sequence_forwards`` counts): doubled under classifier-free guidance."""
    return batch * candidates * (2 if program.guided else 1)


# ------------------------------------------------------------------------- block KV cache calls


def predict_prefill(
    prefill,
    canvas: jax.Array,
    attention_mask: jax.Array,
    prompt_length: int,
    keys: jax.Array,
    values: RowValues,
    mcfg: ModelConfig,
    program: Program,
    window: LogitWindow | None = None,
):
    """Full-canvas call [B, N] that also returns the KV cache: (Prediction [B, N], cached keys,
    cached values); ``keys`` [B, 2] are the rows' PRNG keys."""
    logits, (k, v) = model_logits(prefill, canvas, attention_mask, prompt_length, mcfg.logit_shift, window)
    pred = logits_to_prediction(logits, keys, values.sampling(), mcfg, program)
    return on_canvas(pred, canvas, prompt_length, window), k, v


def predict_window(
    window,
    tokens: jax.Array,
    positions: jax.Array,
    cache: tuple[jax.Array, jax.Array],
    cache_mask: jax.Array,
    window_mask: jax.Array,
    out_length: int,
    keys: jax.Array,
    values: RowValues,
    mcfg: ModelConfig,
    program: Program,
) -> Prediction:
    """Window call: tokens [B, M, W] against the cache -> Prediction [B, M, out_length] of the
    window's first ``out_length`` positions (unshifted: the engine places them)."""
    logits = window(tokens, positions, cache[0], cache[1], cache_mask, window_mask, out_length)
    batch, m = tokens.shape[:2]
    pred = logits_to_prediction(
        logits.reshape(batch * m, out_length, -1), candidate_keys(keys, m), values.sampling(m), mcfg, program
    )
    return jax.tree.map(lambda a: a.reshape(batch, m, *a.shape[1:]), pred)
