"""DiffusionGemma's sampler (``psd_jax.core.entropy_bound``) against transformers' ``generate``: each
of the 12 decoding goldens replayed with upstream's recorded draws gives upstream's output, model
calls, per-row ``decoder_passes`` and every per-step trace (canvas in, argmax, accepted positions,
entropy, adaptive-stopping state, step, canvas, temperature); and the engine's own draws give a
row the same ids whatever batch it is decoded in."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffusion_gemma_goldens import golden_case, tiny_model
from flax import nnx

from models.diffusion_gemma import DiffusionGemma
from psd_jax.core.config import DecodeConfigError
from psd_jax.core.entropy_bound import (
    Draws,
    EntropyBoundSettings,
    categorical,
    decode,
    first_argmax,
    probabilities_and_entropy,
)
from psd_jax.core.errors import InputError

CASES = [f"{s}_{p}" for s in ("default", "eb1_s32_stop", "eb2_s8_nostop") for p in ("p0", "p1", "p2", "batch_p0p2")]
ENTROPY_ATOL = 1e-4  # float32 entropies against upstream's (float32 vs float64 differ by <= 7.6e-5)


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    return tiny_model()


def generate_case(name: str) -> dict[str, np.ndarray]:
    return golden_case(f"generate_{name}")


def settings_of(c: dict) -> EntropyBoundSettings:
    stability, confidence = int(c["stability_threshold"]), float(c["confidence_threshold"])
    return EntropyBoundSettings(
        gen_length=int(c["max_new_tokens"]),
        max_denoising_steps=int(c["max_denoising_steps"]),
        entropy_bound=float(c["entropy_bound"]),
        t_min=float(c["t_min"]),
        t_max=float(c["t_max"]),
        stability_threshold=None if stability < 0 else stability,  # -1: off
        confidence_threshold=None if confidence < 0 else confidence,
    )


@pytest.mark.parametrize("name", CASES)
def test_replayed_draws_decode_exactly_as_upstream(model, name):
    c = generate_case(name)
    settings = settings_of(c)
    draws = Draws.replay(c["init_canvas"], c["sample"], c["renoise"])  # only what upstream drew
    out = decode(model, c["prompt"], c["attention_mask"].astype(bool), settings, draws, trace=True)
    prompt_length = c["prompt"].shape[1]
    want = c["output"][:, prompt_length:]
    assert np.array_equal(out.output_ids[:, : want.shape[1]], want)
    assert not out.output_ids[:, want.shape[1] :].any(), "canvases not run are pad"
    assert (out.nfe, out.canvases) == (int(c["nfe"]), int(c["encoder_calls"]))
    assert out.decoder_passes.tolist() == c["decoder_passes"].tolist()
    if len(want) == 1:
        assert out.row_nfe.tolist() == [out.nfe]  # upstream's nfe at batch 1
    ran = out.nfe
    for field in ("canvas_in", "argmax", "cur_step", "canvas_index", "temperature"):
        assert np.array_equal(out.trace[field][:ran], c[f"trace_{field}"]), field
    for field in ("accepted", "finished"):
        assert np.array_equal(out.trace[field][:ran], c[f"trace_{field}"].astype(bool)), field
    np.testing.assert_allclose(out.trace["entropy"][:ran], c["trace_entropy"], atol=ENTROPY_ATOL)
    tokens = (want != 0).sum(-1)  # upstream's tokens per forward: generated non-pad ids per pass
    np.testing.assert_allclose(tokens / out.decoder_passes, c["tokens_per_forward"], rtol=1e-6)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"gen_length": 0}, "gen_length must be a positive integer, got 0"),
        ({"max_denoising_steps": True}, "max_denoising_steps must be a positive integer, got True"),
        ({"entropy_bound": float("nan")}, "entropy_bound must be a finite number, got nan"),
        ({"entropy_bound": -0.5}, "entropy_bound must be >= 0, got -0.5"),
        ({"t_min": 0.9, "t_max": 0.8}, "0 < t_min <= t_max, got t_min=0.9, t_max=0.8"),
        ({"t_min": 0.0}, "0 < t_min <= t_max"),
        ({"stability_threshold": None}, "needs both stability_threshold and confidence_threshold"),
        ({"stability_threshold": -1}, "stability_threshold must be an integer >= 0, got -1"),
        ({"confidence_threshold": float("inf")}, "confidence_threshold must be a finite number, got inf"),
    ],
)
def test_settings_upstream_could_not_run_are_refused_by_name(fields, message):
    with pytest.raises(DecodeConfigError, match=re.escape(message)):
        EntropyBoundSettings(**fields)


def test_prompts_outside_the_vocabulary_or_the_context_are_refused(model):
    settings, draws = EntropyBoundSettings(gen_length=32), Draws.from_seed([0])
    with pytest.raises(InputError, match=r"prompt ids must be in \[0, 512\)"):
        decode(model, np.array([[2, 512]]), np.ones((1, 2), bool), settings, draws)
    with pytest.raises(InputError, match="a prompt_valid mask of that shape"):
        decode(model, np.array([[2, 5]]), np.ones((1, 3), bool), settings, draws)
    long = dataclasses.replace(model.config, max_length=40)
    short = DiffusionGemma.from_params(long, {k: v[...] for k, v in nnx.state(model, nnx.Param).items()})
    with pytest.raises(InputError, match="exceed the model's context of 40"):
        decode(short, np.array([[2, 5, 6, 7, 8, 9, 10, 11, 12]]), np.ones((1, 9), bool), settings, draws)


def test_replayed_draws_that_run_out_or_do_not_fit_are_refused(model):
    """A decode that leaves the recorded run (here: more steps a canvas than were recorded) would
    read draws nobody recorded: refused, as are draws of another batch or canvas shape."""
    c = generate_case("eb1_s32_stop_p0")
    prompt, valid = c["prompt"], c["attention_mask"].astype(bool)
    draws = Draws.replay(c["init_canvas"], c["sample"], c["renoise"])
    other = dataclasses.replace(settings_of(c), stability_threshold=None, confidence_threshold=None)
    longer = dataclasses.replace(other, max_denoising_steps=40)  # 40 steps a canvas; 32 were recorded
    with pytest.raises(InputError, match=r"steps; the recorded draws hold 1 and 32: it left the recorded run"):
        decode(model, prompt, valid, longer, draws)
    with pytest.raises(InputError, match=r"'init_canvas' must be \[n, batch 2, canvas 32\], got \(1, 1, 32\)"):
        decode(model, np.concatenate([prompt, prompt]), np.concatenate([valid, valid]), other, draws)


def test_the_engines_draws_follow_the_probabilities_and_never_pick_an_impossible_id():
    """``categorical`` (inverse CDF over blocks): 200,000 draws from a known distribution over a
    vocabulary that is not a whole number of blocks land within 5 standard deviations of every
    id's expected count; ids of probability 0 (inside blocks and whole blocks) are never drawn,
    not even at the very top of [0, 1), nor where a row's mass is all in one id."""
    vocab = 300  # 3 blocks of 128, the last one padded
    p = np.zeros(vocab, np.float32)
    p[[0, 5, 127, 128, 131, 299]] = [0.1, 0.2, 0.05, 0.3, 0.15, 0.2]
    n = 200_000
    u = jax.random.uniform(jax.random.key(7), (n,))
    ids = np.asarray(jax.jit(categorical)(u, jnp.broadcast_to(jnp.asarray(p), (n, vocab))))
    counts = np.bincount(ids, minlength=vocab)
    assert set(np.flatnonzero(counts)) == set(np.flatnonzero(p))
    expected = n * p / p.sum()
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected * (1 - p)) + 1e-9)
    top = jnp.asarray([0.0, 0.5, np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
    q = np.zeros((3, vocab), np.float32)
    q[:, 200] = 1.0  # one possible id, in the last block
    q[1, 3] = 1e-30  # a tiny mass first
    np.testing.assert_array_equal(np.asarray(categorical(top, jnp.asarray(q))), [200, 200, 200])
    tail = np.zeros((1, vocab), np.float32)
    tail[0, [10, 130]] = [0.5, 0.5]  # rounding can leave no cumulative sum above the top draw
    assert int(categorical(jnp.asarray([0.99999994], jnp.float32), jnp.asarray(tail))[0]) == 130


def test_the_steps_argmax_and_entropy_are_numpys():
    """The step's own reductions: ``first_argmax`` is ``argmax`` exactly (the first of tied maxima,
    the first NaN, a row of -inf), and ``probabilities_and_entropy`` gives the softmax and its
    entropy within float32 rounding of a float64 computation."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (6, 5, 300)).astype(np.float32)  # many ties
    x[0, 0] = -np.inf
    x[1, 2, [7, 40]] = np.nan
    x[2, 1, 299] = 9.0
    x[3, 4, 0] = np.inf
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[0, 0] == 0 and got[1, 2] == 7 and got[2, 1] == 299
    z = rng.normal(0, 4, (3, 7, 1000)).astype(np.float32)
    p, h = jax.jit(probabilities_and_entropy)(jnp.asarray(z))
    z64 = z.astype(np.float64)
    logp = z64 - np.log(np.exp(z64 - z64.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z64.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(p), np.exp(logp), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(h), -(np.exp(logp) * logp).sum(-1), rtol=1e-5)
