"""Block KV cache (prefix / dual, Fast-dLLM semantics): goldens, row independence, every decoder.

RPS with each cache is checked token for token against the PyTorch backend's independent
implementation in tests/backends/test_torch_cache.py (``OWN``), which replaces a run-only check here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import GOLDENS
from safetensors.numpy import load_file

from models.transformer import default_positions
from psd_jax import DecodeConfig, DecodeConfigError
from psd_jax.cli.flags import decode_fields
from psd_jax.cli.generate import build_parser
from psd_jax.core.config import cache_fields, settings_from
from psd_jax.core.engine import decode, decode_python_loop
from psd_jax.core.runtime import Program, RowValues
from psd_jax.model_dir import model_settings

FUNCTIONS = {"none": "generate", "prefix": "generate_with_prefix_cache", "dual": "generate_with_dual_cache"}
PROMPTS = [[474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492], [280, 242, 425, 15, 2, 138, 188]]


@pytest.fixture(scope="module")
def cache_cases() -> dict:
    return load_file(str(GOLDENS / "cache_cases.safetensors"))


def _policy(thr: str) -> dict:
    return {"policy": "fixed"} if thr == "None" else {"policy": "threshold", "threshold": float(thr)}


@pytest.mark.parametrize("thr", ["None", "0.9", "0.7"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_fast_dllm_cache_goldens(lms, cache_cases, cache, thr):
    """Both golden prompts (17 and 29 tokens) in one left-padded batch: each row's tokens and
    model calls equal Fast-dLLM's batch-1 run of that prompt."""
    pre = [f"{FUNCTIONS[cache]}.thr{thr}.p{p}." for p in (0, 1)]
    prompts = [cache_cases[k + "prompt"][0].tolist() for k in pre]
    settings = DecodeConfig(gen_length=48, block_length=16, cache=cache, **_policy(thr))
    out = lms["llada-tiny"].generate(prompts, settings, prompt_bucket=32)
    for k, prompt, row in zip(pre, prompts, out):
        assert row.output_ids == cache_cases[k + "output"][0, len(prompt) :].tolist()
        assert row.nfe == int(cache_cases[k + "nfe"])
    # The batch's calls by shape: with a cache one block-start refresh per block (rows move through
    # blocks together) and windows of the block (dual) or of the rest of the canvas (prefix).
    calls = {(c["kind"], c["candidates"], c["positions"]): c["count"] for c in out[0].calls}
    assert all(c["batch"] == 2 for c in out[0].calls)
    assert sum(calls.values()) >= max(r.nfe for r in out)
    assert sum(n * m * 2 for (_, m, _), n in calls.items()) == out[0].sequence_forwards
    if cache == "none":
        assert set(calls) == {("full", 1, 32 + 48)}
    else:
        assert calls.pop(("refresh", 1, 32 + 48)) == 3
        assert {(kind, m) for kind, m, _ in calls} == {("window", 1)}
        assert {w for _, _, w in calls} <= ({16} if cache == "dual" else {16, 32, 48})


@pytest.mark.parametrize(
    "name, settings",
    [
        ("dream-tiny", DecodeConfig(gen_length=32, block_length=8, policy="threshold", threshold=0.7, cache="dual")),
        ("dream-tiny", DecodeConfig(gen_length=32, block_length=8, steps=16, policy="fixed", cache="prefix")),
        (
            "llada-tiny-gqa",
            DecodeConfig(
                gen_length=32, block_length=8, policy="threshold", threshold=0.7, decoder="psd", depth=2, cache="dual"
            ),
        ),
        (
            "llada-tiny",
            DecodeConfig(
                gen_length=32, block_length=16, policy="factor", decoder="rps", k_max=4, pivot_tau=0.5, cache="dual"
            ),
        ),
    ],
    ids=["dream-dual", "dream-prefix", "gqa-psd-dual", "rps-dual"],
)
def test_padded_batch_rows_equal_alone(lms, name, settings):
    lm = lms[name]
    batch = lm.generate(PROMPTS, settings, prompt_bucket=16)
    for prompt, row in zip(PROMPTS, batch):
        (alone,) = lm.generate([prompt], settings, prompt_bucket=16)
        assert alone.output_ids == row.output_ids and alone.nfe == row.nfe and alone.stats == row.stats
        assert lm.config.mask_id not in row.output_ids


@pytest.mark.parametrize(
    "policy", [{"policy": "fixed", "steps": 24}, {"policy": "threshold", "threshold": 0.7}], ids=["fixed", "threshold"]
)
def test_psd_strict_dual_equals_plain_dual(lms, cache_cases, policy):
    """Strict acceptance keeps exactly the policy's choices, and drafts are verified by window calls
    on the same block-start cache as plain decoding's next step: the same tokens, fewer calls."""
    lm = lms["llada-tiny"]
    prompts = [cache_cases[f"generate.thrNone.p{p}.prompt"][0].tolist() for p in (0, 1)]
    plain = DecodeConfig(gen_length=48, block_length=16, cache="dual", **policy)
    psd = plain.replace(decoder="psd", depth=3, acceptance="strict")
    out_plain = lm.generate(prompts, plain, prompt_bucket=32)
    out_psd = lm.generate(prompts, psd, prompt_bucket=32)
    for a, b in zip(out_plain, out_psd):
        assert a.output_ids == b.output_ids
        assert b.nfe <= a.nfe
    assert sum(sum(r.stats["accepted_depth"][1:]) for r in out_psd) > 0, "some drafts should be accepted"


def test_cached_while_loop_equals_python_loop(lms):
    lm = lms["llada-tiny"]
    settings = DecodeConfig(
        gen_length=32, block_length=16, policy="threshold", threshold=0.7, decoder="psd", depth=2, cache="dual"
    )
    ids = np.full((2, 16), lm.config.pad_id, np.int32)
    mask = np.zeros_like(ids)
    for r, p in enumerate(PROMPTS):
        ids[r, 16 - len(p) :], mask[r, 16 - len(p) :] = p, 1
    ids, mask, key = jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0)
    values, program = RowValues.of([settings] * len(PROMPTS)), Program.of(settings)
    compiled = decode(lm.graphdef, lm.params, ids, mask, key, values, mcfg=lm.config, program=program)
    oracle = decode_python_loop(lm.model, ids, mask, key, values, mcfg=lm.config, program=program)
    np.testing.assert_array_equal(np.asarray(compiled.canvas), np.asarray(oracle.canvas))
    np.testing.assert_array_equal(np.asarray(compiled.row_nfe), np.asarray(oracle.row_nfe))
    assert int(compiled.nfe) == int(oracle.nfe) and int(compiled.sequence_forwards) == int(oracle.sequence_forwards)
    np.testing.assert_array_equal(np.asarray(compiled.calls), np.asarray(oracle.calls))
    assert int(np.asarray(compiled.calls).sum()) == int(compiled.nfe)


@pytest.mark.parametrize("cache, thr", [("prefix", "None"), ("dual", "0.7")])
def test_a_refresh_that_never_falls_due_equals_the_goldens(lms, cache_cases, cache, thr):
    """``refresh_every`` past a block's window calls (at most block_length - 1) never refreshes
    within a block: Fast-dLLM's tokens and calls, as at its off value 0."""
    pre = [f"{FUNCTIONS[cache]}.thr{thr}.p{p}." for p in (0, 1)]
    prompts = [cache_cases[k + "prompt"][0].tolist() for k in pre]
    settings = DecodeConfig(gen_length=48, block_length=16, cache=cache, refresh_every=16, **_policy(thr))
    out = lms["llada-tiny"].generate(prompts, settings, prompt_bucket=32)
    for k, prompt, row in zip(pre, prompts, out):
        assert row.output_ids == cache_cases[k + "output"][0, len(prompt) :].tolist()
        assert row.nfe == int(cache_cases[k + "nfe"])


@pytest.mark.parametrize(
    "name, policy, cache",
    [
        ("llada-tiny", {"policy": "fixed", "steps": 16}, "prefix"),
        ("llada-tiny", {"policy": "threshold", "threshold": 0.7}, "dual"),
        ("dream-tiny", {"policy": "threshold", "threshold": 0.7}, "dual"),
    ],
    ids=["llada-fixed-prefix", "llada-threshold-dual", "dream-threshold-dual"],
)
def test_a_refresh_every_window_call_decodes_as_the_uncached_loop(lms, name, policy, cache):
    """With ``refresh_every=1`` every commit reads a full forward of the current canvas, as the
    uncached loop's does: the same tokens, one refresh per iteration (its window call's predictions
    are never read), where the block starts alone would be one per block."""
    lm = lms[name]
    base = DecodeConfig(gen_length=32, block_length=8, **policy)
    uncached = lm.generate(PROMPTS, base, prompt_bucket=16)
    refreshed = lm.generate(PROMPTS, base.replace(cache=cache, refresh_every=1), prompt_bucket=16)
    for a, b in zip(uncached, refreshed):
        assert a.output_ids == b.output_ids
    calls = {c["kind"]: c["count"] for c in refreshed[0].calls if c["kind"] == "refresh"}
    assert calls["refresh"] == refreshed[0].iterations > base.num_blocks


@pytest.mark.parametrize("name", ["llada-tiny", "dream-tiny"])
def test_a_dual_window_over_the_rest_of_the_canvas_decodes_as_the_prefix_cache(lms, name):
    """``vicinity`` = gen_length - block_length: the dual window reaches the canvas end, so every
    position after the block is recomputed, as the prefix cache's window does."""
    lm = lms[name]
    prefix = DecodeConfig(gen_length=32, block_length=8, policy="threshold", threshold=0.7, cache="prefix")
    dual = lm.generate(PROMPTS, prefix.replace(cache="dual", vicinity=24), prompt_bucket=16)
    for a, b in zip(lm.generate(PROMPTS, prefix, prompt_bucket=16), dual):
        assert a.output_ids == b.output_ids and a.nfe == b.nfe
    assert {c["positions"] for c in dual[0].calls if c["kind"] == "window"} == {32}


@pytest.mark.parametrize("name", ["llada-tiny-gqa", "dream-tiny"])
@pytest.mark.parametrize("width", [8, 24])  # 24 from position 24 of 40: a prefix-style window past the end
def test_window_over_own_cache_equals_full_forward(lms, name, width):
    """With the cache of the same canvas, a window call reproduces the full forward's logits."""
    model = lms[name].model
    batch, n = 2, 40
    tokens = jax.random.randint(jax.random.key(0), (batch, n), 0, 400)
    mask = jnp.ones((batch, n), jnp.int32).at[0, :5].set(0)
    logits, keys, values = model.prefill(tokens, mask)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(tokens, mask)), atol=1e-4)
    start = jnp.array([20, 24])
    index = start[:, None] + jnp.arange(width)
    window_mask = index < n
    index = jnp.minimum(index, n - 1)
    pos = jnp.arange(n)[None]
    cache_mask = mask.astype(bool) & ~((pos >= start[:, None]) & (pos < start[:, None] + width))
    positions = jnp.take_along_axis(default_positions(model.config, mask, batch, n), index, 1)
    window_tokens = jnp.take_along_axis(tokens, index, 1)[:, None]
    win = model.window(window_tokens, positions[:, None], keys, values, cache_mask, window_mask, 8)
    expected = jnp.take_along_axis(logits, index[:, :8, None], 1)
    np.testing.assert_allclose(np.asarray(win[:, 0]), np.asarray(expected), atol=1e-4)


def test_cache_settings():
    with pytest.raises(DecodeConfigError, match="unknown cache"):
        DecodeConfig(cache="full")
    with pytest.raises(DecodeConfigError, match="classifier-free guidance"):
        DecodeConfig(cache="dual", cfg_scale=1.0)
    with pytest.raises(DecodeConfigError, match="refresh_every=2 would be ignored: .*block KV cache"):
        DecodeConfig(refresh_every=2)
    with pytest.raises(DecodeConfigError, match="vicinity=8 would be ignored: .*cache 'dual'"):
        DecodeConfig(cache="prefix", vicinity=8)
    with pytest.raises(DecodeConfigError, match="vicinity 112 .* exceeds gen_length - block_length = 96"):
        DecodeConfig(cache="dual", vicinity=112)
    with pytest.raises(DecodeConfigError, match="refresh_every .* must be >= 0"):
        DecodeConfig(cache="dual", refresh_every=-1)
    # A setting's name carries the cache with its refinements, and reads back to the same fields.
    for settings in (DecodeConfig(cache="dual", vicinity=4, refresh_every=2), DecodeConfig(cache="prefix")):
        assert DecodeConfig(**cache_fields(settings.cache_name)) == settings
    assert DecodeConfig(cache="dual", vicinity=4, refresh_every=2).cache_name == "dual+v4+r2"
    for bad in ("full", "dual+q1", "dual+v", "dual+v4+v8", "dual+v-1"):
        with pytest.raises(DecodeConfigError, match=f"unknown cache '{re.escape(bad)}'"):
            cache_fields(bad)
    # Changing the cache drops the settings only a cache uses, as a policy change drops its own.
    assert settings_from(DecodeConfig(cache="dual", vicinity=8), {"cache": "none"}) == DecodeConfig()
    assert model_settings(None, decode_fields(build_parser().parse_args(["--cache", "dual"]))).cache == "dual"
    assert model_settings(None, decode_fields(build_parser().parse_args([]))).cache == "none"
