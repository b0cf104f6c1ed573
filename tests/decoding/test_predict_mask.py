"""``predict_mask``: LLaDA ``generate.py``'s rule for [MASK], against a float64 NumPy re-implementation
of that loop on ``llada-tiny``.

Upstream's loop (LLaDA's ``generate.py``, and jax-ml/bonsai's port of it) takes the argmax over the
whole vocabulary, [MASK] included, and scores it on a softmax that includes [MASK]. A position
written with [MASK] stays masked and is a candidate again at every later step (the mask index is
``x == mask_id`` anew each step, over every position before the block's end), and a block ends after
its steps whatever it holds. With the option off (the default), [MASK]'s logit is -inf, as in every
golden (../shared/goldens/README.md, "One rule the decoders must follow").
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from paths import GOLDENS
from safetensors.numpy import load_file, save_file

from models import load_config
from psd_jax import DecodeConfig, DecodeConfigError, load_model
from psd_jax.core.config import check_for_model

LLADA_TINY = GOLDENS / "llada-tiny"
MASK, EOS = 500, 501
# Random prompts where the rule changes the tokens at gen 64: row 0 ends with [MASK]s left, row 1
# differs only through the confidences (the softmax then includes [MASK]).
PROMPTS = np.random.default_rng(10).choice([t for t in range(512) if t not in (MASK, EOS)], size=(2, 24))


class Llada:
    """LLaDA's forward (``modeling_llada.py``, llama blocks, no padding) in float64 NumPy."""

    def __init__(self, path):
        self.cfg = json.loads((path / "config.json").read_text())
        # Linear weights as x @ w (transposed once); the embedding and the norms as they are.
        self.w = {
            k: v.astype(np.float64) if v.ndim == 1 or k.endswith("wte.weight") else v.astype(np.float64).T.copy()
            for k, v in load_file(path / "model.safetensors").items()
        }

    def _norm(self, x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.cfg["rms_norm_eps"]) * self.w[name]

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        c, w = self.cfg, self.w
        batch, n = ids.shape
        head_dim = c["d_model"] // c["n_heads"]
        half = head_dim // 2
        angles = np.arange(n)[:, None] / c["rope_theta"] ** (np.arange(half) * 2 / head_dim)[None, :]
        sin, cos = (np.concatenate([f(angles)] * 2, -1) for f in (np.sin, np.cos))

        def heads_of(x, rotate):  # [B, H, T, hd], RoPE by rotate_half
            x = x.reshape(batch, n, -1, head_dim).transpose(0, 2, 1, 3)
            return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin if rotate else x

        h = w["model.transformer.wte.weight"][ids]
        for layer in range(c["n_layers"]):
            p = f"model.transformer.blocks.{layer}."
            x = self._norm(h, p + "attn_norm.weight")
            q, k, v = (heads_of(x @ w[p + f"{m}_proj.weight"], m != "v") for m in "qkv")
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
            att = np.exp(scores - scores.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            h = h + (att @ v).transpose(0, 2, 1, 3).reshape(batch, n, -1) @ w[p + "attn_out.weight"]
            x = self._norm(h, p + "ff_norm.weight")
            gate, up = x @ w[p + "ff_proj.weight"], x @ w[p + "up_proj.weight"]
            h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ff_out.weight"]
        return self._norm(h, "model.transformer.ln_f.weight") @ w["model.transformer.ff_out.weight"]


def upstream_generate(forward, prompt, steps, gen_length, block_length, mask_id, suppress_mask=False):
    """LLaDA ``generate.py``'s loop (low_confidence, temperature 0, no guidance, no padding), with
    ``suppress_mask`` the goldens' -inf on [MASK]'s logit. Ties would go to the lower position
    (``torch.topk``'s order is unspecified; none occur here)."""
    batch, length = prompt.shape
    x = np.full((batch, length + gen_length), mask_id, np.int64)
    x[:, :length] = prompt
    blocks = gen_length // block_length
    per_block = steps // blocks
    for block in range(blocks):
        end = length + (block + 1) * block_length
        masked = (x[:, end - block_length : end] == mask_id).sum(1)
        counts = masked[:, None] // per_block + (np.arange(per_block)[None, :] < (masked % per_block)[:, None])
        for i in range(per_block):
            mask_index = x == mask_id
            logits = forward(x)
            if suppress_mask:
                logits[..., mask_id] = -np.inf
            x0 = logits.argmax(-1)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            x0_p = np.take_along_axis(p, x0[..., None], -1)[..., 0] / p.sum(-1)
            x0_p[:, end:] = -np.inf
            x0 = np.where(mask_index, x0, x)
            confidence = np.where(mask_index, x0_p, -np.inf)
            for row in range(batch):
                chosen = np.argsort(-confidence[row], kind="stable")[: counts[row, i]]
                x[row, chosen] = x0[row, chosen]
    return x[:, length:]


@pytest.fixture(scope="module")
def reference():
    return Llada(LLADA_TINY)


@pytest.fixture(autouse=True)
def _one_blas_thread():
    """The reference's matrices are tiny: BLAS threads beside the suite's workers cost it 10x."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # not installed: slower, the same values
        yield
        return
    with threadpool_limits(1, "blas"):
        yield


def _decode(lm, prompts, settings):
    out = lm.generate(prompts.tolist(), settings, prompt_bucket=None)
    return np.array([r.output_ids for r in out]), [r.nfe for r in out]


def test_predict_mask_is_llada_generate_token_for_token(lms, reference):
    """On: generate.py's tokens, [MASK]s left included, in ``steps`` calls (LLaDA's block length 32);
    off: the goldens' rule, as before the option."""
    settings = DecodeConfig(gen_length=64, block_length=32, eos_early_stop=False)
    expected = upstream_generate(reference, PROMPTS, 64, 64, 32, MASK)
    tokens, nfe = _decode(lms["llada-tiny"], PROMPTS, settings.replace(predict_mask=True))
    np.testing.assert_array_equal(tokens, expected)
    assert nfe == [64, 64]

    off, _ = _decode(lms["llada-tiny"], PROMPTS, settings)
    np.testing.assert_array_equal(off, upstream_generate(reference, PROMPTS, 64, 64, 32, MASK, suppress_mask=True))
    # Row 0 ends with [MASK]s (a step wrote one, and every later step chose it again); row 1 has none
    # and still differs, through its confidences: their softmax includes [MASK].
    assert (expected[0] == MASK).sum() == 11 and not (expected[1] == MASK).any()
    assert (off != expected).any(axis=1).all()


@pytest.fixture(scope="module")
def mask_prone(tmp_path_factory):
    """llada-tiny with [MASK]'s LM-head row made token 460's plus 5% of its own: [MASK] is then the
    argmax wherever 460 was, by at least 0.29 in logit over this file's decodes (so float32 and
    float64 agree; the k-th and (k+1)-th confidences differ by at least 5.8e-4)."""
    out = tmp_path_factory.mktemp("llada-tiny-mask-prone")
    tensors = load_file(LLADA_TINY / "model.safetensors")
    head = tensors["model.transformer.ff_out.weight"]
    head[MASK] = head[460] + 0.05 * head[MASK]
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(LLADA_TINY / "config.json", out / "config.json")
    return out


def test_masks_left_in_earlier_blocks_stay_candidates_and_every_block_ends(mask_prone):
    """A model that predicts [MASK] often: steps write it, blocks end with masks left, later blocks'
    steps rank those again (as generate.py does) and fill some, and the loop still ends after
    ``steps`` calls, with generate.py's tokens."""
    settings = DecodeConfig(gen_length=64, block_length=16, steps=32, predict_mask=True, eos_early_stop=False)
    expected = upstream_generate(Llada(mask_prone), PROMPTS, 32, 64, 16, MASK)
    tokens, nfe = _decode(load_model(mask_prone), PROMPTS, settings)
    np.testing.assert_array_equal(tokens, expected)
    assert nfe == [32, 32]
    assert ((expected == MASK).sum(axis=1) > 20).all()


def test_predict_mask_is_refused_where_it_cannot_run():
    """By name: a loop whose blocks end by their masks, a block-causal family, DiffusionGemma (no mask)."""
    for other in (dict(policy="threshold"), dict(decoder="psd"), dict(cache="dual"), dict(policy="dream", steps=16)):
        with pytest.raises(DecodeConfigError, match="predict_mask .* runs with policy 'fixed', decoder 'plain'"):
            DecodeConfig(gen_length=32, block_length=16, predict_mask=True, **other)
    settings = DecodeConfig(gen_length=32, block_length=16, predict_mask=True)
    with pytest.raises(DecodeConfigError, match="predict_mask .* not supported for the block-causal llada2_moe"):
        check_for_model(settings, load_config(GOLDENS / "llada2-tiny"))
    with pytest.raises(DecodeConfigError, match="predict_mask=True: not used by DiffusionGemma"):
        check_for_model(settings.replace(block_length=32), load_config(GOLDENS / "diffusion-gemma-tiny"))
    check_for_model(settings, load_config(LLADA_TINY))
