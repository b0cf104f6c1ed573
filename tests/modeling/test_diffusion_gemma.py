"""DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) against the upstream goldens:
the encoder's hidden states and cache and the denoiser's logits with and without
self-conditioning, on a left-padded batch and alone, through the converter; the full-size config's
key table and parameter counts; a checkpoint that is not the config's refused by name."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from diffusion_gemma_goldens import TINY, golden_case, tiny_model
from flax import nnx
from paths import HF_CONFIGS
from safetensors.numpy import load_file

from convert.diffusion_gemma import expected_keys, from_mapping, read_params
from convert.safetensors_dir import CheckpointError
from models import ConfigError, load_config
from models.diffusion_gemma import DiffusionGemma, active_param_count, is_quantized_name, param_count
from models.diffusion_gemma_config import DiffusionGemmaConfig

FULL = HF_CONFIGS / "DiffusionGemma-26B-A4B"
LOGIT_ATOL = 1e-4  # float32 against upstream's float32 (float32 vs float64 logits differ by <= 3.2e-5)
STATE_ATOL = 1e-5  # hidden states and cache (float32 vs float64: <= 1.7e-6)


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    return tiny_model()


# The two modes compiled whole (op by op, a call of the tiny model takes seconds of dispatch).
encode = nnx.jit(lambda model, ids, positions, valid: model.encode(ids, positions, valid))
denoise = nnx.jit(  # sc: upstream's self-conditioning logits, which the model takes as their softmax
    lambda model, canvas, at, cache, sc=None: model.denoise(canvas, at, cache, None if sc is None else softmax(sc))
)

denoise_rows = nnx.jit(lambda model, canvas, at, cache, probs, on: model.denoise(canvas, at, cache, probs, sc_on=on))


def softmax(sc_logits: jax.Array) -> jax.Array:
    """What ``denoise`` conditions on: upstream's self-conditioning logits' float32 softmax."""
    return jax.nn.softmax(sc_logits.astype(jnp.float32), axis=-1)


@pytest.mark.parametrize("name", ["forward_batch", "forward_single"])
def test_encoder_cache_and_denoiser_logits_equal_upstream(model, name):
    """One encoder call on the (left-padded) prompts, then the denoiser's first step (no
    self-conditioning) and a later one (with a step's processed logits) on the same cache. The
    sliding layers' cache is compared over upstream's last window - 1 positions, which are all the
    denoiser's masks let a sliding layer see."""
    c = golden_case(name)
    ids, valid = jnp.asarray(c["input_ids"]), jnp.asarray(c["attention_mask"]).astype(bool)
    positions = jnp.broadcast_to(jnp.asarray(c["position_ids"]), ids.shape)
    hidden, cache = encode(model, ids, positions, valid)
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(hidden)[real], c["encoder_last_hidden_state"][real], atol=STATE_ATOL)
    for layer in range(model.config.n_layers):
        for ours, field in ((cache.keys[layer], "keys"), (cache.values[layer], "values")):
            want = c[f"kv{layer}_{field}"]  # [B, KV, kept positions, hd]
            kept = want.shape[2]
            got = np.asarray(ours).transpose(0, 2, 1, 3)[:, :, -kept:]
            mask = np.broadcast_to(real[:, None, -kept:, None], want.shape)
            np.testing.assert_allclose(got[mask], want[mask], atol=STATE_ATOL, err_msg=f"layer {layer} {field}")
    assert [c[f"kv{i}_keys"].shape[2] for i in range(3)] == [15, 15, ids.shape[1]]  # window - 1; every position
    canvas = jnp.asarray(c["canvas"])
    at = jnp.broadcast_to(jnp.asarray(c["decoder_position_ids"]), canvas.shape)
    np.testing.assert_allclose(np.asarray(denoise(model, canvas, at, cache)), c["logits_nosc"], atol=LOGIT_ATOL)
    sc = jnp.asarray(c["self_conditioning_logits"])
    np.testing.assert_allclose(np.asarray(denoise(model, canvas, at, cache, sc)), c["logits_sc"], atol=LOGIT_ATOL)
    # Per row (the sampler's form): rows off are as without self-conditioning, also when none is on.
    rows = canvas.shape[0]
    for on in {(False,) * rows, (True,) + (False,) * (rows - 1), (True,) * rows}:
        got = np.asarray(denoise_rows(model, canvas, at, cache, softmax(sc), jnp.asarray(on)))
        for row, row_on in enumerate(on):
            want = c["logits_sc" if row_on else "logits_nosc"][row]
            np.testing.assert_allclose(got[row], want, atol=LOGIT_ATOL, err_msg=f"rows on {on}, row {row}")


def test_full_size_key_table_and_parameter_counts_equal_upstream():
    """The 26B-A4B config: every text tensor ``save_pretrained`` writes, by name and shape, is the
    converter's table; the parameter counts are upstream's (tied weights once, self-conditioning in)."""
    cfg = load_config(FULL)
    names = json.loads((FULL / "weight_names.json").read_text())
    written = {
        w["name"]: tuple(w["shape"])
        for w in names
        if "tied_to" not in w
        and not w["name"].startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision."))
    }
    assert expected_keys(cfg) == written
    counts = json.loads((FULL / "param_count.json").read_text())
    assert param_count(cfg) == counts["parameters_text"] == 25_250_986_752
    assert active_param_count(cfg) == counts["active_text_parameters_per_token"]
    assert (cfg.layer_types.count("full_attention"), cfg.sliding_window, cfg.canvas_length) == (5, 1024, 256)
    assert cfg.eos_ids == (1, 106)


def test_full_size_model_builds_and_runs_abstractly():
    """The 26B-A4B module in bfloat16 without allocating it (``eval_shape``): 50.5 GB of weights
    (the text parameters and 60 layer scales), and an encoder call on a 64-token prompt then a
    self-conditioned denoiser call on a 256-position canvas give float32 logits over the vocabulary."""
    cfg = load_config(FULL)
    model = nnx.eval_shape(lambda: DiffusionGemma(cfg, dtype=jnp.bfloat16))
    weights = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(math.prod(w.shape) * w.dtype.itemsize for w in weights) == 2 * param_count(cfg) + 2 * 60

    def call(m: DiffusionGemma) -> jax.Array:
        prompt, canvas = 64, cfg.canvas_length
        _, cache = m.encode(jnp.zeros((1, prompt), jnp.int32), jnp.arange(prompt)[None], jnp.ones((1, prompt), bool))
        at = prompt + jnp.arange(canvas)[None]
        sc = jnp.zeros((1, canvas, cfg.vocab_size), jnp.bfloat16)
        return m.denoise(jnp.zeros((1, canvas), jnp.int32), at, cache, softmax(sc), sc_on=jnp.ones((1,), bool))

    out = nnx.eval_shape(call, model)
    assert (out.shape, out.dtype) == ((1, 256, 262_144), jnp.float32)


def test_a_checkpoint_not_of_the_config_is_refused_by_name():
    cfg = load_config(TINY)
    tensors = load_file(TINY / "model.safetensors")
    name = "model.decoder.layers.1.mlp.up_proj.weight"
    with pytest.raises(CheckpointError, match=rf"the checkpoint has no {name}"):
        from_mapping({k: v for k, v in tensors.items() if k != name}, cfg)
    with pytest.raises(
        CheckpointError,
        match=r"model.decoder.layers.0.experts.gate_up_proj has shape \(8, 40, 64\); this config needs \(8, 48, 64\)",
    ):
        from_mapping({**tensors, "model.decoder.layers.0.experts.gate_up_proj": np.zeros((8, 40, 64), np.float32)}, cfg)
    tied = "model.encoder.language_model.norm.weight"
    with pytest.raises(CheckpointError, match=rf"{tied} differs from model.decoder.norm.weight"):
        from_mapping({**tensors, tied: tensors["model.decoder.norm.weight"] + 1}, cfg)
    untied = {
        **tensors,
        tied: tensors["model.decoder.norm.weight"],
        "lm_head.weight": tensors["model.decoder.embed_tokens.weight"],
    }
    ours = from_mapping(untied, cfg)  # the tied copies written out are accepted when equal
    assert np.array_equal(ours["final_norm"], tensors["model.decoder.norm.weight"])
    with pytest.raises(CheckpointError, match="does not know: model.decoder.layers.3.input_layernorm.weight"):
        from_mapping({**tensors, "model.decoder.layers.3.input_layernorm.weight": np.ones(64, np.float32)}, cfg)
    assert not any(k.startswith("model.encoder.vision_tower.") for k in expected_keys(cfg))


def test_config_errors_name_the_field():
    raw = json.loads((TINY / "config.json").read_text())
    with pytest.raises(ConfigError, match="text_config.layer_types has 2 entries for num_hidden_layers 3"):
        DiffusionGemmaConfig.from_dict(
            {**raw, "text_config": {**raw["text_config"], "layer_types": ["sliding_attention"] * 2}}
        )
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not divisible by num_key_value_heads 3"):
        DiffusionGemmaConfig.from_dict({**raw, "text_config": {**raw["text_config"], "num_key_value_heads": 3}})
    with pytest.raises(ConfigError, match="canvas_length is missing"):
        DiffusionGemmaConfig.from_dict({k: v for k, v in raw.items() if k != "canvas_length"})


def _forward(model: DiffusionGemma, c: dict) -> np.ndarray:
    """Golden ``c``'s encoder call and self-conditioned denoiser step: the logits."""
    ids, valid = jnp.asarray(c["input_ids"]), jnp.asarray(c["attention_mask"]).astype(bool)
    _, cache = encode(model, ids, jnp.broadcast_to(jnp.asarray(c["position_ids"]), ids.shape), valid)
    canvas = jnp.asarray(c["canvas"])
    at = jnp.broadcast_to(jnp.asarray(c["decoder_position_ids"]), canvas.shape)
    return np.asarray(denoise(model, canvas, at, cache, jnp.asarray(c["self_conditioning_logits"])))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_logits_equal_the_dequantized_weights_product_and_int8_stays_near_float32(quantize):
    """Projections and experts stored as qwix integers (the routed experts through the grouped
    product, dense ones through ``qwix.dot_general``) compute exactly the float model whose weights
    are their dequantized values. int8 stays near float32: at 90% of the positions within
    tests/modeling/test_quantize.py's bound (6% of the largest logit), top-1 agreeing at 95%; the
    rest are positions whose routed experts change (the tiny checkpoint's random router is near
    uniform: with only the dense projections quantized the largest error is the same)."""
    cfg = load_config(TINY)
    params = read_params(TINY, cfg)
    quantized = DiffusionGemma.from_params(cfg, params, quantize=quantize)
    names = [name for name in params if is_quantized_name(name)]
    assert len(names) == 3 * 9 - 1 and all(isinstance(getattr(quantized, n)[...], qwix.QArray) for n in names)
    dequantized = {
        n: np.asarray(qwix.dequantize(getattr(quantized, n)[...])) if n in names else v for n, v in params.items()
    }
    c = golden_case("forward_batch")
    got = _forward(quantized, c)
    np.testing.assert_allclose(got, _forward(DiffusionGemma.from_params(cfg, dequantized), c), rtol=1e-5, atol=1e-4)
    if quantize == "int8":
        want = c["logits_sc"]
        err = np.abs(got - want).max(-1) / np.abs(want).max()
        assert 0 < np.percentile(err, 90) <= 0.06, np.sort(err.ravel())
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
