"""The optional PyTorch backend equals the JAX one: logits (goldens) and decoded tokens (JAX engine).

- ``TorchDiffusionLM`` logits equal the upstream goldens to 1e-4 (LLaDA, LLaDA-GQA, Dream; with
  left padding for LLaDA);
- plain decoding (``fixed``, ``threshold`` on llada-tiny; Dream's schedule on dream-tiny) equals
  the upstream goldens token for token with the same call counts: the goldens pin the JAX engine
  exactly (tests/decoding/test_decoding_goldens.py), so torch == goldens == JAX, without paying an XLA
  compile here;
- PSD (tokens and strict acceptance, over the ``threshold`` and ``fixed`` policies), RPS and
  LLaDA2.0's ``threshold_schedule`` policy (``steps`` per block) on llada-tiny and dream-tiny, on a
  batch of 2 prompts of different lengths (left-padded): the PyTorch decoder's tokens, per-row
  NFE, tokens before EOS, sequence forwards and decoder statistics equal
  ``psd_jax.load_model(...).generate(...)``;
- an uncached call computes logits only in the engine's logit window (the current block and the
  next), and a block-causal family (LLaDA2.0) is refused by name before any model work.

Skipped when torch is not installed (``pip install -e .[torch]``). The tiny models are run with one
torch thread: at this size OpenMP's per-op synchronisation dominates, and on a shared CPU it can
stall for seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_parity")  # before its import: its asserts explain a failure
pytestmark = pytest.mark.usefixtures("torch_one_thread")

from paths import DEFAULT_MODEL, GOLDENS, ROOT  # noqa: E402

import psd_jax  # noqa: E402
from psd_jax import DecodeConfig  # noqa: E402
from psd_jax.torch_backend import load_torch_model  # noqa: E402

from torch_parity import assert_same_generations  # noqa: E402

NAMES = ("llada-tiny", "dream-tiny")
LOGIT_ATOL = 1e-4

# Batches of 2 prompts with left padding, from the goldens' generate cases.
PROMPT_CASES = {"llada-tiny": "llada-tiny.generate_s24.", "dream-tiny": "dream-tiny.generate_maskgit_plus_s32."}
GEOMETRY = {"llada-tiny": dict(gen_length=48, block_length=16), "dream-tiny": dict(gen_length=32, block_length=16)}
# Compared with the JAX engine (one XLA compile each, which is what this file's time goes to).
SETTINGS = {
    "psd-tokens": dict(policy="threshold", threshold=0.9, decoder="psd", depth=3, accept_confidence=0.5),
    "psd-strict": dict(policy="fixed", steps="half", decoder="psd", depth=2, acceptance="strict"),
    "rps": dict(policy="threshold", threshold=0.9, decoder="rps", k_max=5),
    # steps per block (DecodeConfig.steps_per_block): 4 of the 16 positions per step unless more pass
    "threshold-schedule": dict(policy="threshold_schedule", steps=4, threshold=0.7),
}
# Plain decoding is compared with the upstream goldens, which pin the JAX engine token for token
# (tests/decoding/test_decoding_goldens.py): (checkpoint, settings, golden output/nfe keys per row).
PLAIN = {
    "llada-fixed-s24": (
        "llada-tiny",
        dict(gen_length=48, block_length=16, steps=24),
        ["llada-tiny.generate_s24."] * 2,
        20,
    ),
    "llada-threshold-0.9": (
        "llada-tiny",
        dict(gen_length=48, block_length=16, policy="threshold", threshold=0.9),
        ["llada-tiny.threshold_0.9_row0.", "llada-tiny.threshold_0.9_row1."],
        20,
    ),
    "llada-threshold-0.7": (
        "llada-tiny",
        dict(gen_length=48, block_length=16, policy="threshold", threshold=0.7),
        ["llada-tiny.threshold_0.7_row0.", "llada-tiny.threshold_0.7_row1."],
        20,
    ),
    "dream-maskgit-s32": (
        "dream-tiny",
        dict(gen_length=32, block_length=32, steps=32, policy="dream"),
        ["dream-tiny.generate_maskgit_plus_s32."] * 2,
        20,
    ),
    "dream-margin-s8": (
        "dream-tiny",
        dict(gen_length=32, block_length=32, steps=8, policy="dream", confidence="margin"),
        ["dream-tiny.generate_topk_margin_s8."] * 2,
        20,
    ),
}


@pytest.mark.parametrize("name", ["llada-tiny", "llada-tiny-gqa", "dream-tiny"])
def test_logits_match_upstream_goldens(torch_lms, cases, name):
    ids = cases[f"{name}.forward.input_ids"]
    logits = torch_lms[name].logits(ids).numpy()
    assert logits.dtype == np.float32 and logits.shape == (2, 300, 512)
    np.testing.assert_allclose(logits, cases[f"{name}.forward.logits"], rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("name", ["llada-tiny", "llada-tiny-gqa"])
def test_padded_logits_match_upstream_goldens(torch_lms, cases, name):
    ids, mask = cases[f"{name}.forward_padded.input_ids"], cases[f"{name}.forward_padded.attention_mask"]
    logits = torch_lms[name].logits(ids, mask).numpy()
    keep = mask.astype(bool)
    np.testing.assert_allclose(logits[keep], cases[f"{name}.forward_padded.logits"][keep], rtol=0, atol=LOGIT_ATOL)


def _prompts(cases, name) -> list[list[int]]:
    pre = PROMPT_CASES[name]
    rows = [list(map(int, r[m.astype(bool)])) for r, m in zip(cases[pre + "prompt"], cases[pre + "attention_mask"])]
    assert len({len(r) for r in rows}) == 2, "the batch must need padding"
    return rows


def _golden_rows(cases, keys) -> list[list[int]]:
    """Row r's prompt of golden case ``keys[r]``, without its padding."""
    rows = []
    for row, key in enumerate(keys):
        prompt, mask = cases[key + "prompt"], cases.get(key + "attention_mask")
        r = prompt[row if len(prompt) > 1 else 0]
        rows.append(list(map(int, r if mask is None else r[mask[row].astype(bool)])))
    return rows


def _golden_output(cases, key: str, row: int, prompt_length: int) -> np.ndarray:
    output = cases[key + "output"]
    return output[row if len(output) > 1 else 0, prompt_length:]


@pytest.mark.parametrize("case", list(PLAIN))
def test_plain_decoding_equals_goldens(torch_lms, cases, case):
    """Batches of 2 with left padding (threshold goldens are batch 1: both rows go as one batch,
    padded to a bucket, which keeps LLaDA's tokens)."""
    name, kwargs, keys, prompt_length = PLAIN[case]
    settings = DecodeConfig(**kwargs)
    got = torch_lms[name].generate(_golden_rows(cases, keys), settings, prompt_bucket=32)
    for row, key in enumerate(keys):
        np.testing.assert_array_equal(got[row].output_ids, _golden_output(cases, key, row, prompt_length))
        nfe = int(cases[key + "nfe"]) if key + "nfe" in cases else settings.total_steps
        assert got[row].nfe == nfe
    assert got[0].sequence_forwards == 2 * max(g.nfe for g in got)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", NAMES)
def test_torch_decoding_equals_jax(torch_lms, lms, cases, name, setting):
    geometry = GEOMETRY[name]
    kwargs = dict(SETTINGS[setting])
    if kwargs.get("steps") == "half":
        kwargs["steps"] = geometry["gen_length"] // 2
    settings = DecodeConfig(**geometry, **kwargs)
    prompts = _prompts(cases, name)
    expected = lms[name].generate(prompts, settings, prompt_bucket=8)
    got = torch_lms[name].generate(prompts, settings, prompt_bucket=8)
    assert_same_generations(got, expected)
    assert all(g.nfe > 0 and g.seconds > 0 for g in got)


@pytest.mark.parametrize("case", ["llada-fixed-s24", "llada-threshold-0.9"])
def test_strict_psd_equals_its_base_goldens(torch_lms, cases, case):
    """Strict PSD is lossless: over the base policy it gives that policy's tokens, which the
    upstream goldens pin, in no more calls (a check of the torch decoders that is not the JAX engine)."""
    name, kwargs, keys, prompt_length = PLAIN[case]
    settings = DecodeConfig(**kwargs).replace(decoder="psd", depth=3, acceptance="strict")
    got = torch_lms[name].generate(_golden_rows(cases, keys), settings, prompt_bucket=32)
    for row, key in enumerate(keys):
        np.testing.assert_array_equal(got[row].output_ids, _golden_output(cases, key, row, prompt_length))
        assert got[row].nfe <= (int(cases[key + "nfe"]) if key + "nfe" in cases else settings.total_steps)
    assert sum(sum(g.stats["accepted_depth"][1:]) for g in got) > 0, "some drafts should be accepted"


def test_uncached_calls_compute_logits_only_in_the_window(torch_lms, cases):
    """Every call of an uncached decode (the first one included) projects and normalises only the
    rows' logit window, ``rules.logit_width`` = 2 blocks of 16 positions, never the whole canvas
    (the final norm's input is what ``_head`` projects), and still equals the goldens."""
    lm = torch_lms["llada-tiny"]
    name, kwargs, keys, prompt_length = PLAIN["llada-threshold-0.9"]
    seen = []
    hook = lm.model.final_norm.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        got = lm.generate(_golden_rows(cases, keys), DecodeConfig(**kwargs), prompt_bucket=32)
    finally:
        hook.remove()
    assert len(seen) == max(g.nfe for g in got) > 1
    assert set(seen) == {(2, 32, lm.config.d_model)}
    for row, key in enumerate(keys):
        np.testing.assert_array_equal(got[row].output_ids, _golden_output(cases, key, row, prompt_length))


def test_block_causal_model_is_refused_by_name(torch_lms):
    """LLaDA2.0 (block diffusion) is not implemented in torch: refused with one InputError that
    names it, when loading the checkpoint (before its weights) and when asked to decode."""
    from psd_jax.core.errors import InputError
    from psd_jax.torch_backend import TorchLM

    from conftest import llada2_mini_config

    message = "the PyTorch backend does not implement block-causal decoding \\('llada2_moe'"
    with pytest.raises(InputError, match=message):
        load_torch_model(GOLDENS / "llada2-tiny", device="cpu")
    lm = TorchLM(torch_lms["llada-tiny"].model, None, GOLDENS / "llada-tiny")
    lm.config = llada2_mini_config()
    with pytest.raises(InputError, match=message):
        lm.generate([[1, 2, 3]], DecodeConfig(gen_length=16, block_length=8, policy="threshold_schedule"))


def test_other_families_are_refused_by_name():
    """LLaDA-MoE is decoded by the JAX engine only: one InputError naming the family, on load."""
    from psd_jax.core.errors import InputError

    with pytest.raises(InputError, match="implements the LLaDA and Dream families only, not 'lladamoe'"):
        load_torch_model(GOLDENS / "lladamoe-tiny", device="cpu")


def test_drafts_into_the_next_block_token_editing_the_trace_and_the_mask_rule_are_refused_by_name(torch_lms):
    from psd_jax.core.errors import InputError

    settings = DecodeConfig(gen_length=32, block_length=16, decoder="psd", depth=7, draft_next_block=True)
    with pytest.raises(InputError, match=r"does not implement PSD's drafts into the next block \(draft_next_block\)"):
        torch_lms["llada-tiny"].generate([[1, 2, 3]], settings)
    editing = DecodeConfig(gen_length=32, block_length=16, decoder="edit", policy="threshold_schedule")
    with pytest.raises(InputError, match=r"does not implement token editing \(decoder 'edit', LLaDA2.1's\)"):
        torch_lms["llada-tiny"].generate([[1, 2, 3]], editing)
    with pytest.raises(InputError, match=r"does not record a decode's trace \(trace\)"):
        torch_lms["llada-tiny"].generate([[1, 2, 3]], DecodeConfig(gen_length=32, block_length=16, trace=True))
    upstream_mask = DecodeConfig(gen_length=32, block_length=16, predict_mask=True)
    with pytest.raises(InputError, match=r"does not implement LLaDA generate.py's \[MASK\] rule \(predict_mask\)"):
        torch_lms["llada-tiny"].generate([[1, 2, 3]], upstream_mask)


def test_eos_early_exit_equals_jax(torch_lms, lms, cases):
    """EOS early exit: token 460 (generated in the 2nd block of both rows) is made the EOS id, so
    rows stop after that block, the rest of each row is EOS and no more calls are made for it."""
    from psd_jax import LoadedModel
    from psd_jax.torch_backend import TorchLM

    path = GOLDENS / "llada-tiny"
    jax_lm, torch_lm = (
        LoadedModel(lms["llada-tiny"].model, None, path),
        TorchLM(torch_lms["llada-tiny"].model, None, path),
    )
    jax_lm.config = jax_lm.config.replace(eos_id=460)
    torch_lm.config = torch_lm.config.replace(eos_id=460)
    settings = DecodeConfig(gen_length=48, block_length=16, policy="threshold", decoder="psd", depth=3)
    prompts = _prompts(cases, "llada-tiny")
    expected = jax_lm.generate(prompts, settings, prompt_bucket=8)
    got = torch_lm.generate(prompts, settings, prompt_bucket=8)
    assert_same_generations(got, expected)
    assert all(g.tokens < 32 and g.output_ids[32:] == [460] * 16 for g in got)


@pytest.mark.parametrize("decoder", ["psd", "rps"])
def test_shipped_default_model_torch_equals_jax(decoder):
    """The shipped model, chat prompts from its held-out set: same tokens and calls."""
    from psd_jax.scoring import load_jsonl

    jax_lm, torch_lm = psd_jax.load_model(DEFAULT_MODEL), load_torch_model(DEFAULT_MODEL, device="cpu")
    chat = bool(getattr(jax_lm.tokenizer, "chat_template", None))
    questions = [ex["question"] for ex in load_jsonl(DEFAULT_MODEL / "test.jsonl")[:2]]
    settings = DecodeConfig(gen_length=48, block_length=16, policy="threshold", decoder=decoder)
    expected = jax_lm.generate(questions, settings, chat=chat)
    got = torch_lm.generate(questions, settings, chat=chat)
    assert_same_generations(got, expected)


def test_bf16_checkpoint_loads_the_bf16_values(tmp_path):
    """A bf16 safetensors source (as real LLaDA/Dream ships) gives exactly its bf16 values."""
    import shutil

    import torch
    from safetensors.torch import load_file as load_torch_file
    from safetensors.torch import save_file as save_torch_file

    from psd_jax.torch_backend.model import load_hf_torch

    src = GOLDENS / "llada-tiny"
    dst = tmp_path / "llada-tiny-bf16"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_torch_file(str(src / "model.safetensors"))
    save_torch_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(dst / "model.safetensors"))
    f32, bf16 = load_hf_torch(src), load_hf_torch(dst)
    for (name, a), (_, b) in zip(f32.named_parameters(), bf16.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16).to(torch.float32), b), name


def test_compare_backends_reports_every_decoder_with_equal_float32_tokens(tmp_path):
    """``scripts/figures/compare_backends.py`` end to end on a toy random LLaDA: every decoder measured
    through both backends, their float32 tokens and NFE equal, the matmul precision recorded, and
    each decoder's rows printed as soon as it is done (a run cut short keeps them). Run in a
    subprocess: the script sets both libraries' global float32 matmul precision."""
    import json
    import subprocess
    import sys

    out = tmp_path / "compare.json"
    model = ["--no-default-model", "--random-llada", "--layers", "1", "--d-model", "64", "--heads", "4"]
    model += ["--vocab", "256"]
    shape = ["--gen-length", "16", "--block-length", "8", "--prompt-length", "8", "--prompt-bucket", "8"]
    args = model + shape + ["--prompts", "1", "--repeats", "1", "--no-compile", "--threads", "1", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "scripts.figures.compare_backends", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["meta"]["matmul_precision"] == "float32"
    results = report["models"][0]["results"]
    assert [r["decoder"] for r in results] == ["fixed", "threshold", "psd", "rps"]
    for r in results:
        jax_row, torch_row = r["backends"]["jax"], r["backends"]["torch"]
        assert torch_row["same_tokens_as_jax"] is True, r["decoder"]
        assert torch_row["nfe_per_prompt"] == jax_row["nfe_per_prompt"] > 0, r["decoder"]
        assert torch_row["sequence_forwards"] == jax_row["sequence_forwards"], r["decoder"]
    assert [line.split("] ")[1] for line in run.stderr.splitlines() if line.endswith(" done**")] == [
        "fixed done**",
        "threshold done**",
        "psd done**",
        "rps done**",
    ]
