"""Token-for-token (and call-count) equality with the upstream PyTorch decoding goldens."""

from __future__ import annotations

import numpy as np
import pytest

from psd_jax import DecodeConfig


def assert_calls(out, nfe: int, batch: int, positions: int, logits: int) -> None:
    """The batch's call record: ``nfe`` uncached one-canvas calls over ``positions`` (the
    upstream loop's forwards), each of ``batch`` rows, with logits at ``logits`` positions (the
    block and the next, or the whole generation when that is shorter)."""
    record = {"kind": "full", "candidates": 1, "positions": positions, "batch": batch, "count": nfe, "logits": logits}
    assert out[0].calls == [record]
    assert all(r.calls == out[0].calls for r in out)


def _rows(prompt: np.ndarray, mask: np.ndarray | None) -> list[list[int]]:
    """Golden left-padded prompts -> unpadded id lists (the API re-pads them identically)."""
    if mask is None:
        return [list(map(int, row)) for row in prompt]
    return [list(map(int, row[m.astype(bool)])) for row, m in zip(prompt, mask)]


@pytest.mark.parametrize("steps", [48, 24, 12])
def test_llada_generate_batch_with_padding(lms, cases, steps):
    pre = f"llada-tiny.generate_s{steps}."
    assert int(cases[pre + "gen_length"]) == 48 and int(cases[pre + "block_length"]) == 16
    settings = DecodeConfig(gen_length=48, block_length=16, steps=steps, policy="fixed", confidence="prob")
    out = lms["llada-tiny"].generate(
        _rows(cases[pre + "prompt"], cases[pre + "attention_mask"]), settings, prompt_bucket=None
    )
    expected = cases[pre + "output"][:, 20:]
    np.testing.assert_array_equal(np.array([r.output_ids for r in out]), expected)
    assert [r.nfe for r in out] == [steps, steps]
    assert_calls(out, steps, 2, 20 + 48, 32)


@pytest.mark.parametrize("threshold", ["0.9", "0.7"])
@pytest.mark.parametrize("row", [0, 1])
def test_fast_dllm_threshold(lms, cases, threshold, row):
    pre = f"llada-tiny.threshold_{threshold}_row{row}."
    settings = DecodeConfig(gen_length=48, block_length=16, policy="threshold", threshold=float(threshold))
    (out,) = lms["llada-tiny"].generate(_rows(cases[pre + "prompt"], None), settings, prompt_bucket=None)
    np.testing.assert_array_equal(out.output_ids, cases[pre + "output"][0, 20:])
    assert out.nfe == int(cases[pre + "nfe"])
    assert_calls([out], int(cases[pre + "nfe"]), 1, 20 + 48, 32)


@pytest.mark.parametrize(
    "alg, confidence", [("maskgit_plus", "prob"), ("topk_margin", "margin"), ("entropy", "entropy")]
)
@pytest.mark.parametrize("steps", [32, 8])
def test_dream_diffusion_generate(lms, cases, alg, confidence, steps):
    pre = f"dream-tiny.generate_{alg}_s{steps}."
    settings = DecodeConfig(gen_length=32, block_length=32, steps=steps, policy="dream", confidence=confidence)
    prompts = _rows(cases[pre + "prompt"], cases[pre + "attention_mask"])
    out = lms["dream-tiny"].generate(prompts, settings, prompt_bucket=None)
    np.testing.assert_array_equal(np.array([r.output_ids for r in out]), cases[pre + "output"][:, 20:])
    assert [r.nfe for r in out] == [steps, steps]
    assert_calls(out, steps, 2, 20 + 32, 32)


def test_prompt_bucketing_keeps_llada_tokens(lms, cases):
    """Left padding to a bucket keeps RoPE's relative positions, so tokens stay the same."""
    pre = "llada-tiny.generate_s24."
    settings = DecodeConfig(gen_length=48, block_length=16, steps=24)
    out = lms["llada-tiny"].generate(
        _rows(cases[pre + "prompt"], cases[pre + "attention_mask"]), settings, prompt_bucket=32
    )
    np.testing.assert_array_equal(np.array([r.output_ids for r in out]), cases[pre + "output"][:, 20:])
