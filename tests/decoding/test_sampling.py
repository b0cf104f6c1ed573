"""Top-p / top-k and temperature as each family's upstream sampler applies them (psd_jax.core.sampling).

The references are NumPy transcriptions of the upstream functions, applied to the goldens' logits:
Dream's ``top_p_logits``, ``top_k_logits`` and ``sample_tokens`` (``generation_utils.py``) and
LLaDA2.0's ``_top_k_logits``, ``_top_p_logits`` and ``_sample_with_temperature_topk_topp``
(``modeling_llada2_moe.py``). Upstream sorts with ``torch.sort`` and scatters the removal mask back;
the transcriptions do the same with ``np.argsort``/``np.put_along_axis``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import GOLDENS

from models import load_config
from psd_jax import DecodeConfig, DecodeConfigError
from psd_jax.core.config import check_for_model
from psd_jax.core.predict import logits_to_prediction
from psd_jax.core.runtime import Program, RowSampling, RowValues
from psd_jax.core.sampling import SAMPLERS, filtered

LOWEST = np.finfo(np.float32).min


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ----------------------------------------------------------------- upstream, transcribed


def top_p_removed(logits: np.ndarray, top_p: float) -> np.ndarray:
    """The mask both Dream's ``top_p_logits`` and LLaDA2.0's ``_top_p_logits`` build."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    cumulative = np.cumsum(softmax(np.take_along_axis(logits, order, -1)), -1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].copy()  # shift right: the token crossing top_p stays
    remove[..., 0] = False
    mask = np.zeros_like(remove)
    np.put_along_axis(mask, order, remove, -1)
    return mask


def kth_largest(logits: np.ndarray, k: int) -> np.ndarray:
    return np.sort(logits, -1)[..., -k][..., None]


def dream_top_p_logits(logits, top_p):
    return np.where(top_p_removed(logits, top_p), LOWEST, logits)


def dream_top_k_logits(logits, top_k):
    top_k = min(top_k, logits.shape[-1])
    return np.where(logits < kth_largest(logits, top_k), LOWEST, logits)


def dream_sample_tokens_probs(logits, temperature, top_p=None, top_k=None):
    """``sample_tokens``' distribution: the one the token is drawn from and scored on."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = dream_top_p_logits(logits, top_p)
    if top_k is not None:
        logits = dream_top_k_logits(logits, top_k)
    return softmax(logits)


def llada2_top_k_logits(logits, k):
    if k is None or k <= 0:
        return logits
    return np.where(logits < kth_largest(logits, k), -np.inf, logits)


def llada2_top_p_logits(logits, p):
    if p is None or p >= 1.0:
        return logits
    return np.where(top_p_removed(logits, p), -np.inf, logits)


def llada2_sample_probs(logits, temperature, top_k=0, top_p=1.0):
    """``_sample_with_temperature_topk_topp``'s distribution (the greedy branch: the raw softmax)."""
    if temperature == 0.0:
        return softmax(logits)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return softmax(llada2_top_p_logits(llada2_top_k_logits(logits, top_k), top_p))


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def dream_logits(cases) -> np.ndarray:
    """dream-tiny's forward logits [2, 100, 512] (the first 100 positions, shifted as Dream reads
    them), mask token removed, divided by 4 so that the nucleus holds several tokens."""
    raw = np.asarray(cases["dream-tiny.forward.logits"], np.float32)[:, :101]
    mcfg = load_config(GOLDENS / "dream-tiny")
    shifted = np.concatenate([raw[:, :1], raw[:, :-2]], axis=1) / 4
    shifted[..., mcfg.mask_id] = -np.inf
    return shifted


@pytest.fixture(scope="module")
def llada2_logits(llada2_cases) -> np.ndarray:
    # A copy: the goldens are one session fixture, and test_llada2 reads these logits as upstream's.
    raw = np.array(llada2_cases["llada2-tiny.forward.logits"], np.float32)
    raw[..., load_config(GOLDENS / "llada2-tiny").mask_id] = -np.inf
    return raw


def rows(n: int, temperature: float, top_p: float, top_k: int) -> RowSampling:
    return RowSampling(
        jnp.full((n,), temperature, jnp.float32), jnp.full((n,), top_p, jnp.float32), jnp.full((n,), top_k, jnp.int32)
    )


def near_top_p(logits: np.ndarray, top_p: float, top_k: int = 0) -> np.ndarray:
    """Positions [...] where a cumulative probability of the (top-k surviving) sorted tokens lies
    within float32 rounding of top_p: there the comparison may fall either way between two correct
    implementations (a cumulative sum's rounding depends on its summation order: XLA's is not
    NumPy's, nor torch's on CPU or GPU)."""
    if top_p >= 1:
        return np.zeros(logits.shape[:-1], bool)
    survivors = llada2_top_k_logits(logits, top_k) if top_k else logits
    cumulative = np.cumsum(softmax(-np.sort(-survivors, -1)), -1)
    return np.any(np.abs(cumulative - top_p) < 1e-6, -1)


def kept(logits: np.ndarray, top_p: float, top_k: int, order) -> np.ndarray:
    n = logits.shape[0]
    out = filtered(jnp.asarray(logits), jnp.full((n,), top_p), jnp.full((n,), top_k), order)
    return np.isfinite(np.asarray(out))


# ---------------------------------------------------------------------------- filters


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize(("top_p", "top_k"), [(0.9, 0), (0.99, 0), (1.0, 5), (0.9, 3), (0.95, 40)])
def test_filters_keep_what_dream_and_llada2_keep(dream_logits, temperature, top_p, top_k):
    """The kept set of Dream's order (top-p, then top-k, lowest value filled) and LLaDA2.0's (top-k,
    then top-p, -inf filled) on the tempered logits of 200 positions, token for token, except where a
    cumulative probability is within float32 rounding of top_p (``near_top_p``: under 5% of them)."""
    tempered = dream_logits / temperature
    dream = dream_top_p_logits(tempered, top_p) if top_p < 1 else tempered
    dream = dream_top_k_logits(dream, top_k) if top_k > 0 else dream
    llada2 = llada2_top_p_logits(llada2_top_k_logits(tempered, top_k), top_p)
    for order, reference, near in [
        (SAMPLERS["dream"].order, dream > LOWEST, near_top_p(tempered, top_p)),
        (SAMPLERS["llada2_moe"].order, np.isfinite(llada2), near_top_p(tempered, top_p, top_k)),
    ]:
        assert near.mean() < 0.05
        assert np.array_equal(kept(tempered, top_p, top_k, order)[~near], reference[~near])
    sizes = (dream > LOWEST).sum(-1)
    assert sizes.min() >= 1 and (top_k == 1 or sizes.max() > 1)  # the check is not vacuous


def test_the_two_orders_differ_where_upstream_does(dream_logits):
    """top-p then top-k keeps at least as much as top-k then top-p (whose top-p renormalises over
    the top-k survivors): on these logits strictly more somewhere, so the order is tested."""
    dream, llada2 = (kept(dream_logits, 0.8, 6, SAMPLERS[f].order) for f in ("dream", "llada2_moe"))
    assert np.all(dream >= llada2) and np.any(dream != llada2)


# ------------------------------------------------------------------ token and confidence


def predict(logits: np.ndarray, family_dir: str, sampling: RowSampling, seed: int = 0, **settings):
    mcfg = load_config(GOLDENS / family_dir)
    keys = jax.random.split(jax.random.PRNGKey(seed), logits.shape[0])
    return _predict(jnp.asarray(logits), keys, sampling, mcfg, DecodeConfig(**settings))


_predict = jax.jit(logits_to_prediction, static_argnums=(3, 4))


@pytest.mark.parametrize("confidence", ["prob", "margin", "entropy"])
def test_dream_greedy_top_p_scores_the_renormalised_nucleus(dream_logits, confidence):
    """Dream at temperature 0 with top_p 0.9: the argmax, and the confidence sample_tokens gives
    (probability, top-1 minus top-2, negative entropy of the renormalised nucleus)."""
    pred = predict(dream_logits, "dream-tiny", rows(2, 0.0, 0.9, 0), top_p=0.9, confidence=confidence)
    probs = dream_sample_tokens_probs(dream_logits, 0.0, top_p=0.9)
    assert np.array_equal(np.asarray(pred.token), probs.argmax(-1))
    if confidence == "prob":
        expected = probs.max(-1)
    elif confidence == "margin":
        top2 = -np.sort(-probs, -1)[..., :2]
        expected = top2[..., 0] - top2[..., 1]
    else:
        expected = np.sum(probs * np.log(probs + 1e-10), -1)
    np.testing.assert_allclose(np.asarray(pred.conf), expected, rtol=1e-5, atol=1e-6)
    unfiltered = predict(dream_logits, "dream-tiny", rows(2, 0.0, 1.0, 0), confidence=confidence)
    assert not np.allclose(np.asarray(unfiltered.conf), np.asarray(pred.conf))  # top_p changed the scores


@pytest.mark.parametrize(
    ("family", "settings"),
    [
        ("dream", dict(temperature=0.7, top_p=0.9)),
        ("dream", dict(temperature=1.3, top_k=4)),
        ("llada2_moe", dict(temperature=0.7, top_p=0.8, top_k=6)),
        ("llada", dict(temperature=0.7, top_p=0.9)),
    ],
)
def test_sampled_tokens_come_from_the_filtered_distribution(dream_logits, llada2_logits, family, settings):
    """Over 4 keys: every drawn token has nonzero probability under upstream's distribution, and its
    confidence is that probability (Dream, LLaDA2.0) or the untempered softmax's (LLaDA)."""
    directory = {"dream": "dream-tiny", "llada2_moe": "llada2-tiny", "llada": "llada-tiny"}[family]
    logits = llada2_logits if family == "llada2_moe" else dream_logits
    t, p, k = settings["temperature"], settings.get("top_p", 1.0), settings.get("top_k", 0)
    if family == "llada2_moe":
        support = llada2_sample_probs(logits, t, top_k=k, top_p=p)
    else:
        support = dream_sample_tokens_probs(logits, t, top_p=p, top_k=k or None)
    scored = support if family != "llada" else softmax(logits)
    tokens = []
    for seed in range(4):
        pred = predict(logits, directory, rows(logits.shape[0], t, p, k), seed=seed, **settings)
        token = np.asarray(pred.token)
        chosen = np.take_along_axis(support, token[..., None], -1)[..., 0]
        assert chosen.min() > 0
        expected = np.take_along_axis(scored, token[..., None], -1)[..., 0]
        np.testing.assert_allclose(np.asarray(pred.conf), expected, rtol=1e-5, atol=1e-6)
        tokens.append(token)
    assert any(not np.array_equal(tokens[0], other) for other in tokens[1:])  # it did sample


def test_rows_keep_their_own_values(dream_logits):
    """One program, three rows: greedy unfiltered, greedy top-p and sampled top-k rows each give what
    they give alone."""
    sampling = RowSampling(
        jnp.asarray([0.0, 0.0], jnp.float32), jnp.asarray([1.0, 0.8], jnp.float32), jnp.asarray([0, 0], jnp.int32)
    )
    together = predict(dream_logits, "dream-tiny", sampling, temperature=0.5, top_p=0.8, confidence="entropy")
    for row, (p, k) in enumerate([(1.0, 0), (0.8, 0)]):
        alone = predict(dream_logits[row : row + 1], "dream-tiny", rows(1, 0.0, p, k), top_p=p, confidence="entropy")
        np.testing.assert_array_equal(np.asarray(together.token)[row], np.asarray(alone.token)[0])
        np.testing.assert_allclose(np.asarray(together.conf)[row], np.asarray(alone.conf)[0], rtol=1e-6)


# --------------------------------------------------------------------------- settings


def test_top_p_and_top_k_are_runtime_values_of_one_program():
    a = DecodeConfig(temperature=0.3, top_p=0.9)
    b = DecodeConfig(temperature=0.8, top_p=0.7, top_k=12)
    assert Program.of(a) == Program.of(b) != Program.of(DecodeConfig(temperature=0.3))
    values = RowValues.of([a, b])
    assert values.top_k.dtype == np.int32 and list(values.top_k) == [0, 12]
    np.testing.assert_allclose(values.top_p, [0.9, 0.7])


@pytest.mark.parametrize(
    ("directory", "settings", "message"),
    [
        ("llada-tiny", dict(top_p=0.9), "top_p=0.9 would be ignored: at temperature 0 this family decodes the argmax"),
        ("llada2-tiny", dict(top_k=5), "top_k=5 would be ignored"),
        ("dream-tiny", dict(top_k=600), "top_k 600 exceeds the vocabulary of 512"),
    ],
)
def test_settings_a_family_would_ignore_are_refused(directory, settings, message):
    with pytest.raises(DecodeConfigError, match=message):
        check_for_model(DecodeConfig(**settings), load_config(GOLDENS / directory))
    check_for_model(DecodeConfig(top_p=0.9), load_config(GOLDENS / "dream-tiny"))  # Dream filters at greedy


@pytest.mark.parametrize(("field", "value"), [("top_p", 0.0), ("top_p", 1.5), ("top_k", -1)])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(DecodeConfigError, match=f"{field} must be"):
        DecodeConfig(**{field: value})
