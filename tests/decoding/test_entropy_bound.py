"""DiffusionGemma's sampler (``psd_jax.core.entropy_bound``) against transformers' ``generate``: each
of the 12 decoding goldens replayed with upstream's recorded draws gives upstream's output, model
calls, per-row ``decoder_passes`` and every per-step trace (canvas in, argmax, accepted positions,
entropy, adaptive-stopping state, step, canvas, temperature); and the engine's own draws give a
row the same ids whatever batch it is decoded in."""

from __future__ import annotations

import numpy as np
import pytest
from paths import GOLDENS
from safetensors.numpy import load_file

from convert.diffusion_gemma import read_params
from models.diffusion_gemma import DiffusionGemma
from models.diffusion_gemma_config import load_diffusion_gemma_config
from psd_jax.core.entropy_bound import Draws, EntropyBoundSettings, decode

TINY = GOLDENS / "diffusion-gemma-tiny"
CASES = [f"{s}_{p}" for s in ("default", "eb1_s32_stop", "eb2_s8_nostop") for p in ("p0", "p1", "p2", "batch_p0p2")]
ENTROPY_ATOL = 1e-4  # float32 entropies against upstream's (float32 vs float64 differ by <= 7.6e-5)


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    cfg = load_diffusion_gemma_config(TINY)
    return DiffusionGemma.from_params(cfg, read_params(TINY, cfg))


@pytest.fixture(scope="module")
def goldens() -> dict[str, np.ndarray]:
    return load_file(GOLDENS / "diffusion_gemma_cases.safetensors")


def golden_case(goldens: dict, name: str) -> dict[str, np.ndarray]:
    prefix = f"diffusion-gemma-tiny.generate_{name}."
    return {k[len(prefix) :]: v for k, v in goldens.items() if k.startswith(prefix)}


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


def padded(draws: np.ndarray, length: int) -> np.ndarray:
    """Recorded draws, zero-filled to every step the decode may run (the rest are never read)."""
    fill = np.zeros((length - draws.shape[0], *draws.shape[1:]), draws.dtype)
    return np.concatenate([draws, fill])


@pytest.mark.parametrize("name", CASES)
def test_replayed_draws_decode_exactly_as_upstream(model, goldens, name):
    c = golden_case(goldens, name)
    settings = settings_of(c)
    canvases = settings.canvases(model.config.canvas_length)
    steps = canvases * settings.max_denoising_steps
    draws = Draws.replay(padded(c["init_canvas"], canvases), padded(c["sample"], steps), padded(c["renoise"], steps))
    out = decode(model, c["prompt"], c["attention_mask"].astype(bool), settings, draws, trace=True)
    prompt_length = c["prompt"].shape[1]
    want = c["output"][:, prompt_length:]
    assert np.array_equal(out.output_ids[:, : want.shape[1]], want)
    assert not out.output_ids[:, want.shape[1] :].any(), "canvases not run are pad"
    assert (out.nfe, out.canvases) == (int(c["nfe"]), int(c["encoder_calls"]))
    assert out.decoder_passes.tolist() == c["decoder_passes"].tolist()
    ran = out.nfe
    for field in ("canvas_in", "argmax", "cur_step", "canvas_index", "temperature"):
        assert np.array_equal(out.trace[field][:ran], c[f"trace_{field}"]), field
    for field in ("accepted", "finished"):
        assert np.array_equal(out.trace[field][:ran], c[f"trace_{field}"].astype(bool)), field
    np.testing.assert_allclose(out.trace["entropy"][:ran], c["trace_entropy"], atol=ENTROPY_ATOL)
    tokens = (want != 0).sum(-1)  # upstream's tokens per forward: generated non-pad ids per pass
    np.testing.assert_allclose(tokens / out.decoder_passes, c["tokens_per_forward"], rtol=1e-6)


def test_own_draws_give_a_row_its_ids_whatever_its_batch(model, goldens):
    """Each row draws from its own seed's key: a prompt decodes to the same ids alone and beside
    another row, a seed repeats its decode, and another seed gives another one."""
    c = golden_case(goldens, "eb1_s32_stop_p2")
    settings = settings_of(c)
    prompt, valid = c["prompt"], c["attention_mask"].astype(bool)
    alone = decode(model, prompt, valid, settings, Draws.from_seed([7]))
    pair = decode(model, np.concatenate([prompt, prompt]), np.concatenate([valid, valid]), settings,
                  Draws.from_seed([3, 7]))  # fmt: skip
    assert np.array_equal(pair.output_ids[1], alone.output_ids[0])
    assert not np.array_equal(pair.output_ids[0], pair.output_ids[1])
    again = decode(model, prompt, valid, settings, Draws.from_seed([7]))
    assert np.array_equal(again.output_ids, alone.output_ids) and again.nfe == alone.nfe
    assert 0 < alone.nfe <= settings.canvases(32) * settings.max_denoising_steps
    assert ((alone.output_ids >= 0) & (alone.output_ids < model.config.vocab_size)).all()
