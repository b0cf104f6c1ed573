"""The PyTorch backend's block KV cache (``cache="prefix"|"dual"``) equals the JAX engine's.

- Fast-dLLM's cached decoding goldens (``cache_cases.safetensors``, llada-tiny: prefix and dual
  cache, fixed / threshold 0.9 / threshold 0.7, the plain decoders): both golden prompts in one
  left-padded batch, each row's tokens and model calls equal Fast-dLLM's batch-1 run of that
  prompt (tests/decoding/test_cache.py pins the JAX engine to the same goldens);
- PSD, RPS and the plain policies (``threshold_schedule`` too, which counts ``steps`` per block)
  with each cache on llada-tiny, llada-tiny-gqa and dream-tiny, on batches of 2 prompts of
  different lengths (left-padded): the torch decode equals the JAX one. Together with the goldens
  every decoder meets each cache, and each checkpoint meets every decoder. RPS with the prefix and
  the dual cache on the same prompts and settings (``OWN``) is checked here only: these tokens
  are the check of the JAX engine's RPS with a cache against an independent implementation.

XLA compiles are what such a test costs (10-35 s each for a cached loop on 2 shared cores). The
cases in ``REUSED`` are decodes that tests/decoding/test_cache.py runs through the shared ``lms`` fixture's
models, with the same settings and prompt shapes, so the JAX side reuses those compiled loops
when the whole suite runs (alone, this file compiles them itself). The two ``FRESH`` cases cover
what test_cache.py does not (PSD with the prefix cache, Dream with PSD and RPS) and compare the
whole ``DecodeOutput``, iterations and batch-wide call count included.

Skipped when torch is not installed. The tiny models run with one torch thread (see
tests/backends/test_torch_backend.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_parity")  # before its import: its asserts explain a failure
pytestmark = pytest.mark.usefixtures("torch_one_thread")

import jax  # noqa: E402
from paths import GOLDENS  # noqa: E402

from psd_jax import DecodeConfig  # noqa: E402
from psd_jax.core.engine import decode  # noqa: E402
from psd_jax.core.runtime import Program, RowValues  # noqa: E402
from psd_jax.prompts import left_pad  # noqa: E402
from psd_jax.torch_backend import generate  # noqa: E402

from torch_parity import assert_same_generations  # noqa: E402

FUNCTIONS = {"prefix": "generate_with_prefix_cache", "dual": "generate_with_dual_cache"}
PROMPTS = [[474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492], [280, 242, 425, 15, 2, 138, 188]]
RPS = dict(decoder="rps", k_max=4, pivot_tau=0.5)
# id: (checkpoint, settings, prompts ("golden": cache_cases' two), prompt bucket), each a decode that
# tests/decoding/test_cache.py makes with the same settings and prompt shapes (its compiled loop is reused).
REUSED = {
    "llada-dual-psd-strict": (
        "llada-tiny",
        DecodeConfig(gen_length=48, block_length=16, cache="dual", policy="threshold", threshold=0.7).replace(
            decoder="psd", depth=3, acceptance="strict"
        ),
        "golden",
        32,
    ),
    "llada-dual-rps": (
        "llada-tiny",
        DecodeConfig(gen_length=32, block_length=16, policy="factor", cache="dual", **RPS),
        PROMPTS,
        16,
    ),
    "gqa-dual-psd": (
        "llada-tiny-gqa",
        DecodeConfig(
            gen_length=32, block_length=8, policy="threshold", threshold=0.7, decoder="psd", depth=2, cache="dual"
        ),
        PROMPTS,
        16,
    ),
    "dream-dual-threshold": (
        "dream-tiny",
        DecodeConfig(gen_length=32, block_length=8, policy="threshold", threshold=0.7, cache="dual"),
        PROMPTS,
        16,
    ),
    "dream-prefix-fixed": (
        "dream-tiny",
        DecodeConfig(gen_length=32, block_length=8, steps=16, policy="fixed", cache="prefix"),
        PROMPTS,
        16,
    ),
}
# Compared through ``generate`` as REUSED, but decoded by no other test file (their loops compile here).
GQA_RPS = DecodeConfig(gen_length=32, block_length=16, policy="threshold", threshold=0.7, **RPS)
SCHEDULE = dict(policy="threshold_schedule", steps=4, threshold=0.7)  # 4 steps per block
OWN = {
    "gqa-prefix-rps": ("llada-tiny-gqa", GQA_RPS.replace(cache="prefix"), PROMPTS, 16),
    "llada-dual-schedule": (
        "llada-tiny",
        DecodeConfig(gen_length=48, block_length=16, cache="dual", **SCHEDULE),
        "golden",
        32,
    ),
    "dream-prefix-schedule": (
        "dream-tiny",
        DecodeConfig(gen_length=32, block_length=16, cache="prefix", **SCHEDULE),
        PROMPTS,
        16,
    ),
    # Refreshes within a block and a dual window past it (docs/algorithms.md "Block KV cache").
    "gqa-dual-psd-refresh-vicinity": (
        "llada-tiny-gqa",
        DecodeConfig(
            gen_length=32,
            block_length=8,
            policy="threshold",
            threshold=0.7,
            decoder="psd",
            depth=2,
            cache="dual",
            refresh_every=2,
            vicinity=8,
        ),
        PROMPTS,
        16,
    ),
    "dream-prefix-refresh": (
        "dream-tiny",
        DecodeConfig(gen_length=32, block_length=8, steps=16, policy="fixed", cache="prefix", refresh_every=2),
        PROMPTS,
        16,
    ),
}
THRESHOLD = dict(gen_length=32, block_length=16, policy="threshold", threshold=0.7)
FRESH = {
    "dream-prefix-psd": DecodeConfig(**THRESHOLD, decoder="psd", depth=1, cache="prefix"),
    "dream-dual-rps": DecodeConfig(**THRESHOLD, decoder="rps", k_max=2, pivot_tau=0.5, cache="dual"),
}


@pytest.fixture(scope="module")
def cache_cases() -> dict:
    return load_file(str(GOLDENS / "cache_cases.safetensors"))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_torch_cache_reproduces_fast_dllm_goldens(torch_lms, cache_cases, cache):
    for thr in ("None", "0.9", "0.7"):
        pre = [f"{FUNCTIONS[cache]}.thr{thr}.p{p}." for p in (0, 1)]
        prompts = [cache_cases[k + "prompt"][0].tolist() for k in pre]
        policy = {"policy": "fixed"} if thr == "None" else {"policy": "threshold", "threshold": float(thr)}
        settings = DecodeConfig(gen_length=48, block_length=16, cache=cache, **policy)
        out = torch_lms["llada-tiny"].generate(prompts, settings, prompt_bucket=32)
        for k, prompt, row in zip(pre, prompts, out):
            assert row.output_ids == cache_cases[k + "output"][0, len(prompt) :].tolist(), (thr, k)
            assert row.nfe == int(cache_cases[k + "nfe"]), (thr, k)


@pytest.mark.parametrize("case", [*REUSED, *OWN])
def test_torch_cache_equals_jax(lms, torch_lms, cache_cases, case):
    name, settings, prompts, bucket = {**REUSED, **OWN}[case]
    if prompts == "golden":
        prompts = [cache_cases[f"generate.thrNone.p{p}.prompt"][0].tolist() for p in (0, 1)]
    expected = lms[name].generate(prompts, settings, prompt_bucket=bucket)
    got = torch_lms[name].generate(prompts, settings, prompt_bucket=bucket)
    assert_same_generations(got, expected)
    assert max(g.nfe for g in got) < settings.gen_length, "the case should commit more than one token per call"
    if settings.decoder == "rps":
        assert all(g.stats["pivot_searched"] > 0 for g in got), "the case should search pivots"


@pytest.mark.parametrize("case", list(FRESH))
def test_torch_cache_decode_output_equals_jax(lms, torch_lms, case):
    settings = FRESH[case]
    jax_lm, torch_lm = lms["dream-tiny"], torch_lms["dream-tiny"]
    ids, mask = left_pad(PROMPTS, jax_lm.config, settings.gen_length, 8)
    assert not mask.all(), "the batch must need padding"
    key = jax.random.key(0)
    values, program = RowValues.of([settings] * len(PROMPTS)), Program.of(settings)
    expected = decode(jax_lm.graphdef, jax_lm.params, ids, mask, key, values, mcfg=jax_lm.config, program=program)
    got = generate(
        torch_lm.model, torch.from_numpy(ids).long(), torch.from_numpy(mask).long(), settings, torch_lm.config
    )
    np.testing.assert_array_equal(got.canvas.numpy(), np.asarray(expected.canvas))
    np.testing.assert_array_equal(got.row_nfe.numpy(), np.asarray(expected.row_nfe))
    counts = (got.nfe, got.sequence_forwards, got.iterations)
    assert counts == tuple(int(c) for c in (expected.nfe, expected.sequence_forwards, expected.iterations))
    assert got.stats.keys() == expected.stats.keys()
    for stat, value in got.stats.items():
        np.testing.assert_array_equal(value.numpy(), np.asarray(expected.stats[stat]), err_msg=stat)
    # The decoder's search did something: drafts accepted, pivots committed.
    searched = got.stats["accepted_depth"][:, 1:] if "accepted_depth" in got.stats else got.stats["pivot_committed"]
    assert int(searched.sum()) > 0
