"""The logits a token is drawn from, and the distribution its confidence is scored on, per family.

Each family's upstream sampler turns a position's logits into its token and that token's
confidence differently, and psd-jax follows each one (each family's ``Sampler``, registered with
the family in ``models.FAMILIES``; ``families.SAMPLERS`` by family):

- **LLaDA**, and **LLaDA-MoE**, whose model card decodes it with LLaDA's ``generate.py``
  (``add_gumbel_noise`` then ``get_transfer_index``): the token is
  drawn at temperature ``T`` (Gumbel-max), the confidence is scored on the untempered
  ``softmax(logits)``. Upstream has no top-p/top-k; here they filter the tempered logits the
  token is drawn from (Dream's order), and so change nothing at temperature 0.
- **Dream** (``generation_utils.sample_tokens``): ``logits / T`` (T > 0), then ``top_p_logits``,
  then ``top_k_logits``; the token is drawn from (T > 0) or is the argmax of (T = 0) the softmax of
  the result, and the confidence (``prob``, ``margin``, ``entropy``) is scored on that same
  softmax, at temperature 0 too: a top-p at T = 0 keeps the argmax but renormalises the
  distribution the confidences are read from.
- **LLaDA2.0** (``LLaDA2MoeModelLM._sample_with_temperature_topk_topp``): at T = 0 the argmax and
  the untempered softmax, no filter; at T > 0 ``logits / T``, then top-k, then top-p (the other
  order), the token drawn from the softmax of the result and scored on it.
- **SDAR** (``generate.py`` ``sample_with_temperature_topk_topp``): ``logits / T``, then top-k, then
  top-p, the token drawn from the softmax of the result and scored on it. Upstream has no
  temperature 0: its greedy is ``temperature=1, top_k=1``, which here is temperature 0 with
  ``top_k=1`` (the filters apply at greedy too), so the confidence is 1 and a threshold rule
  commits a whole block in one call, as upstream's does. Temperature 0 without filters scores the
  argmax on the full softmax, as SDAR's evaluation decoder (``block_diffusion_generate`` of its
  Hugging Face path) does.

The filters are upstream's definitions. Top-p: sort the logits descending, take the cumulative
softmax, remove the tokens whose cumulative probability exceeds ``p``, shifted right by one so
the token that crosses ``p`` stays (and the top one always does). Top-k: remove the tokens whose
logit is below the k-th largest (``k`` capped at the vocabulary). Removed tokens get ``-inf``
(upstream: ``-inf`` or the dtype's lowest value; either is probability 0 after the softmax). Both
filters keep a prefix of the sorted order, so the kept set is "logit >= the last kept logit";
**Choice:** a token tied with the last kept one is kept as well (upstream's order among equal
logits is torch.sort's, which is unspecified).

``top_p`` and ``top_k`` are per-row values (``runtime.RowValues``) like the temperature: a row
with ``top_p = 1`` and ``top_k = 0`` is unfiltered. Whether a compiled program filters at all is
a program setting (``runtime.Program``), so greedy decoding without them runs exactly
the code it ran before they existed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Each family's sampler is registered with the family (``models.FAMILIES``); ``predict`` and the
# PyTorch backend read it through this module, beside the filters that apply it.
from .families import SAMPLERS, Filter, FilterSettings, Sampler, filters_set, sampler_for

if TYPE_CHECKING:
    import jax

__all__ = ["SAMPLERS", "Filter", "FilterSettings", "Sampler", "filtered", "filters_set", "sampler_for"]


# ------------------------------------------------------------------------------------ JAX


def _count_top_p(sorted_logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Tokens top-p keeps of logits sorted descending [..., V]: 1 + those after the first whose
    preceding cumulative probability is <= p (``top_p`` broadcast over the leading dims)."""
    import jax
    import jax.numpy as jnp

    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    return 1 + jnp.sum(cumulative[..., :-1] <= top_p[..., None], axis=-1)


def _at(sorted_logits: jax.Array, count: jax.Array) -> jax.Array:
    """The ``count``-th largest logit (1-based) [...] of sorted logits [..., V]."""
    import jax.numpy as jnp

    index = jnp.clip(count - 1, 0, sorted_logits.shape[-1] - 1)
    return jnp.take_along_axis(sorted_logits, index[..., None], axis=-1)[..., 0]


def filtered(logits: jax.Array, top_p: jax.Array, top_k: jax.Array, order: tuple[Filter, Filter]) -> jax.Array:
    """``logits`` [M, N, V] with the tokens each row's top-p [M] and top-k [M] remove set to -inf,
    the two applied in ``order``; a row with top_p >= 1 and top_k <= 0 is returned unchanged."""
    import jax.numpy as jnp

    p = top_p[:, None].astype(jnp.float32)  # [M, 1]: broadcast over positions
    k = top_k[:, None].astype(jnp.int32)
    p_on, k_on = p < 1.0, k > 0
    ordered = -jnp.sort(-logits, axis=-1)  # descending
    kth = jnp.where(k_on, _at(ordered, k), -jnp.inf)
    if order == ("top_p", "top_k"):
        # top-k of the top-p survivors: the k-th largest survivor is the k-th largest logit when
        # k is within the survivors, and below the top-p cut otherwise.
        cut_p = _at(ordered, _count_top_p(ordered, p))
    else:
        # top-p of the top-k survivors: their own softmax, the rest at -inf.
        survivors = jnp.where(ordered >= kth[..., None], ordered, -jnp.inf)
        cut_p = _at(survivors, _count_top_p(survivors, p))
    cut = jnp.maximum(jnp.where(p_on, cut_p, -jnp.inf), kth)
    return jnp.where(logits >= cut[..., None], logits, -jnp.inf)
