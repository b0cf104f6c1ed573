"""LLaDA-MoE (``LLaDAMoEModelLM``, model_type "llada" with MoE fields) against the upstream goldens:
the forward's logits (both layer layouts, through the converter), LLaDA's ``generate`` and Fast-dLLM's
threshold decoding token for token with upstream's model calls, the prefix and dual KV caches on a
padded batch, int8 weights, and the config, key table and sharding rules.

Compiles dominate the time, so each compiled decode checks as much as it can: the threshold cases
decode both golden prompts (17 and 29 tokens) in one left-padded batch, so each also checks that a
padded row decodes exactly as upstream's unpadded batch 1."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from paths import GOLDENS

import convert.__main__ as convert_cli
from convert import expected_keys
from convert.safetensors_dir import SafetensorsDir
from models import ConfigError, LLaDAMoE, LLaDAMoEConfig, ModelConfig, config_from_dict, load_config, param_shapes
from models.quantize import is_projection, quantize_weight
from psd_jax import DecodeConfig, load_model
from psd_jax.parallel.sharding import logical_axes, spec_for

TINY = GOLDENS / "lladamoe-tiny"
LOGIT_ATOL = 1e-4  # float32 parity with upstream PyTorch (float32 vs float64 differ by ~9e-6)
GENERATE = ("g32b8s32", "g32b8s16", "g32b16s8")
THRESHOLD = ("g32b8_t0.3", "g32b8_t0.5", "g32b16_t0.7")
CACHED = DecodeConfig(gen_length=32, block_length=8, policy="threshold", threshold=0.5, cache="prefix")


def tiny_config_dict(**changes) -> dict:
    return {**json.loads((TINY / "config.json").read_text()), **changes}


def field(cases: dict, case: str, name: str):
    return cases[f"lladamoe-tiny.{case}.{name}"]


# ------------------------------------------------------------------------------------ config
def test_config_is_told_apart_from_dense_llada():
    """Same model_type "llada" as dense LLaDA: the MoE architecture decides; the mask id comes from
    decode.json (the config has none), eos and pad from config.json."""
    cfg = load_config(TINY)
    assert isinstance(cfg, LLaDAMoEConfig) and cfg.family == "lladamoe"
    assert (cfg.mask_id, cfg.eos_id, cfg.pad_id) == (511, 508, 509)
    assert (cfg.logit_shift, cfg.positions_from_mask, cfg.block_causal) == (0, False, False)
    assert (cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_hidden, cfg.shared_hidden) == (16, 4, 32, 0)
    assert cfg.segments() == (("moe", 0, 2),) and cfg.head_dim == 16
    assert isinstance(load_config(GOLDENS / "llada-tiny"), ModelConfig)
    # The MoE fields alone decide too (a config without ``architectures``).
    bare = {k: v for k, v in tiny_config_dict(mask_token_id=511).items() if k != "architectures"}
    assert isinstance(config_from_dict(bare, "bare"), LLaDAMoEConfig)


def test_parameter_count_equals_the_checkpoint():
    """The config's count, the module's parameters (eval_shape) and the checkpoint's tensors agree."""
    cfg = load_config(TINY)
    with SafetensorsDir(TINY) as reader:
        stored = sum(math.prod(shape) for shape in reader.shapes.values())
    model = nnx.eval_shape(lambda: LLaDAMoE(cfg))
    built = sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert cfg.param_count() == built == stored
    assert cfg.active_param_count() == cfg.param_count() - 2 * 12 * 3 * 64 * 32  # 12 idle experts per layer


@pytest.mark.parametrize(
    "change, name",
    [
        ({"clip_qkv": 8.0}, "clip_qkv"),
        ({"qk_layernorm": False}, "qk_layernorm"),
        ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
        ({"router_num_group": 4}, "router_num_group"),
        ({"moe_layer_freq": [1]}, "moe_layer_freq"),
        ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
        ({"mask_token_id": 512}, "mask_token_id"),
    ],
)
def test_unsupported_config_is_one_clear_error(change, name):
    with pytest.raises(ConfigError) as err:
        config_from_dict(tiny_config_dict(**change), "tiny", {"mask_token_id": 511})
    assert name in str(err.value) and "\n" not in str(err.value)


def test_dense_layers_run_in_config_order():
    """``moe_layer_freq`` 0 makes a layer a dense MLP: runs of one kind in order, each source layer's
    tensors to its group's stack (dense layers' under ``mlp.{gate,up,down}_proj``)."""
    cfg = config_from_dict(
        tiny_config_dict(num_hidden_layers=4, moe_layer_freq=[0, 1, 1, 0]), "mixed", {"mask_token_id": 511}
    )
    assert cfg.segments() == (("dense", 0, 1), ("moe", 0, 2), ("dense", 1, 1))
    keys = expected_keys(cfg)
    where = lambda key: (keys[key].param, keys[key].layer, keys[key].expert, keys[key].source_shape)  # noqa: E731
    assert where("model.layers.3.mlp.down_proj.weight") == ("dense_w_down", 1, None, (64, 128))
    assert where("model.layers.2.mlp.experts.5.up_proj.weight") == ("moe_expert_up", 1, 5, (32, 64))
    assert where("model.layers.2.mlp.gate.weight") == ("moe_router", 1, None, (16, 64))
    assert "model.layers.0.mlp.gate.weight" not in keys and "model.layers.1.mlp.gate_proj.weight" not in keys
    assert len(keys) == 3 + 4 * 8 + 2 * 3 + 2 * (1 + 16 * 3)


def test_mixed_layers_are_the_same_in_both_layouts():
    """A model with dense and MoE layers interleaved (random weights): the scanned layout (runs sliced
    from the stacked groups) computes what the unrolled one does."""
    cfg = config_from_dict(
        tiny_config_dict(num_hidden_layers=4, moe_layer_freq=[0, 1, 1, 0]), "mixed", {"mask_token_id": 511}
    )
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 24)), jnp.int32)
    logits = []
    for unroll in (False, True):
        model = LLaDAMoE(cfg, rngs=nnx.Rngs(3), unroll_layers=unroll)
        graphdef, params = nnx.split(model)
        logits.append(np.asarray(jax.jit(lambda p, i, g=graphdef: nnx.merge(g, p)(i))(params, ids)))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-6)
    assert np.abs(logits[0]).max() > 0.1


def test_shared_expert_keys():
    """A shared expert (``shared_expert_intermediate_size``) is the decoder layer's ``shared_expert``
    SwiGLU on every MoE layer, stacked as ``moe_shared_*``."""
    cfg = config_from_dict(tiny_config_dict(shared_expert_intermediate_size=48), "shared", {"mask_token_id": 511})
    keys = expected_keys(cfg)
    target = keys["model.layers.1.shared_expert.gate_proj.weight"]
    assert (target.param, target.layer, target.source_shape) == ("moe_shared_gate", 1, (48, 64))
    assert param_shapes(cfg)["moe_shared_down"] == (2, 48, 64)
    assert cfg.param_count() == load_config(TINY).param_count() + 2 * 3 * 64 * 48


def test_experts_map_to_the_expert_axis():
    """Experts over ``expert`` and their hidden units over ``model``, the router replicated, the
    separate q/k/v projections split by heads over ``model``."""
    from jax.sharding import AbstractMesh, PartitionSpec

    cfg = load_config(TINY)
    mesh = AbstractMesh((1, 4, 2), ("data", "expert", "model"))
    specs = {name: spec_for(logical_axes(cfg, name), shape, mesh) for name, shape in param_shapes(cfg).items()}
    assert specs["moe_expert_gate"] == PartitionSpec(None, "expert", None, "model")
    assert specs["moe_expert_down"] == PartitionSpec(None, "expert", "model", None)
    assert all(a is None for a in specs["moe_router"]) and all(a is None for a in specs["moe_q_norm"])
    assert specs["moe_wk"] == PartitionSpec(None, None, "model")
    assert specs["moe_wo"] == PartitionSpec(None, "model", None)


# ------------------------------------------------------------------------------------ forward
def test_forward_matches_upstream(lladamoe_lm, lladamoe_cases):
    """``load_model`` builds the LLaDA-MoE module (CPU: unrolled layers); logits within 1e-4 of upstream's."""
    assert isinstance(lladamoe_lm.model, LLaDAMoE) and lladamoe_lm.model.unrolled
    logits = np.asarray(lladamoe_lm.logits(field(lladamoe_cases, "forward", "input_ids")))
    assert logits.dtype == np.float32 and logits.shape == (2, 200, 512)
    np.testing.assert_allclose(logits, field(lladamoe_cases, "forward", "logits"), rtol=0, atol=LOGIT_ATOL)


def test_converted_checkpoint_in_scanned_layout_matches_upstream(tmp_path, capsys, lladamoe_lm, lladamoe_cases):
    """``python -m convert`` writes the tiny model; restored with ``lax.scan`` layers it gives upstream's
    logits, and a dual-cache decode (its cache refreshed layer by layer in the scan) gives the unrolled
    layout's tokens."""
    out = tmp_path / "lladamoe-orbax"
    assert convert_cli.main(["--hf-dir", str(TINY), "--out", str(out), "--dtype", "float32"]) == 0
    assert "(lladamoe, " in capsys.readouterr().out
    lm = load_model(out, unroll_layers=False)
    assert isinstance(lm.model, LLaDAMoE) and not lm.model.unrolled and lm.model.moe_expert_up.shape == (2, 16, 64, 32)
    logits = np.asarray(lm.logits(field(lladamoe_cases, "forward", "input_ids")))
    np.testing.assert_allclose(logits, field(lladamoe_cases, "forward", "logits"), rtol=0, atol=LOGIT_ATOL)
    prompts = threshold_prompts(lladamoe_cases, "g32b8_t0.5")
    scanned = lm.generate(prompts, CACHED.replace(cache="dual"), prompt_bucket=None)
    unrolled = lladamoe_lm.generate(prompts, CACHED.replace(cache="dual"), prompt_bucket=None)
    assert [r.output_ids for r in scanned] == [r.output_ids for r in unrolled]


# ------------------------------------------------------------------------------------ decoding
@pytest.mark.parametrize("setting", GENERATE)
def test_llada_generate_matches_upstream(lladamoe_lm, lladamoe_cases, setting):
    """LLaDA's ``generate`` (low-confidence remasking, greedy) on upstream's batch of two: same tokens,
    one model call per step."""
    case = f"generate_{setting}"
    steps = int(field(lladamoe_cases, case, "steps"))
    settings = DecodeConfig(
        gen_length=int(field(lladamoe_cases, case, "gen_length")),
        block_length=int(field(lladamoe_cases, case, "block_length")),
        steps=steps,
        policy="fixed",
        confidence="prob",
    )
    prompt = field(lladamoe_cases, case, "prompt")
    out = lladamoe_lm.generate(prompt.tolist(), settings, prompt_bucket=None)
    np.testing.assert_array_equal(np.array([r.output_ids for r in out]), field(lladamoe_cases, case, "output")[:, 20:])
    assert [r.nfe for r in out] == [int(field(lladamoe_cases, case, "nfe"))] * 2 == [steps] * 2


def threshold_prompts(cases: dict, setting: str) -> list[list[int]]:
    return [field(cases, f"threshold_{setting}_p{row}", "prompt")[0].tolist() for row in (0, 1)]


@pytest.mark.parametrize("setting", THRESHOLD)
def test_fast_dllm_threshold_matches_upstream(lladamoe_lm, lladamoe_cases, setting):
    """Fast-dLLM threshold decoding without cache: each golden prompt's tokens and model calls,
    decoded in one batch (the 17-token prompt left-padded to 29: pad keys masked, positions absolute)."""
    first = f"threshold_{setting}_p0"
    settings = DecodeConfig(
        gen_length=int(field(lladamoe_cases, first, "gen_length")),
        block_length=int(field(lladamoe_cases, first, "block_length")),
        policy="threshold",
        threshold=float(field(lladamoe_cases, first, "threshold")),
    )
    prompts = threshold_prompts(lladamoe_cases, setting)
    out = lladamoe_lm.generate(prompts, settings, prompt_bucket=None)
    for row, (prompt, result) in enumerate(zip(prompts, out)):
        case = f"threshold_{setting}_p{row}"
        assert result.output_ids == field(lladamoe_cases, case, "output")[0, len(prompt) :].tolist(), case
        assert result.nfe == int(field(lladamoe_cases, case, "nfe")), case


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_padded_batch_rows_decode_as_alone(lladamoe_lm, lladamoe_cases, cache):
    """The block KV caches run on LLaDA-MoE: a left-padded batch's rows get the tokens each prompt
    gets unpadded (a batch of the prompt twice), and the decode leaves no mask token."""
    settings = CACHED.replace(cache=cache)
    short, long = threshold_prompts(lladamoe_cases, "g32b8_t0.5")
    padded = lladamoe_lm.generate([short, long], settings, prompt_bucket=None)
    alone = [lladamoe_lm.generate([p, p], settings, prompt_bucket=None)[0] for p in (short, long)]
    assert [r.output_ids for r in padded] == [r.output_ids for r in alone]
    mask = lladamoe_lm.config.mask_id
    assert all(len(r.output_ids) == 32 and mask not in r.output_ids for r in padded)


def test_int8_is_the_dequantized_weights_product(lladamoe_cases):
    """int8 (weight-only): q/k/v/o and the routed experts stored as integers (the experts through the
    grouped product), the router, norms, embedding and head kept in float; the logits are the float
    model's with those weights dequantized."""
    ids = field(lladamoe_cases, "forward", "input_ids")[:, :64]
    quantized = load_model(TINY, quantize="int8", unroll_layers=False)
    reference = load_model(TINY, unroll_layers=False)
    for name in filter(is_projection, param_shapes(reference.config)):
        weight = getattr(reference.model, name).get_value()
        reference.model.set_param(name, qwix.dequantize(quantize_weight(weight, "int8")))
    reference.graphdef, reference.params = nnx.split(reference.model)
    got, want = np.asarray(quantized.logits(ids)), np.asarray(reference.logits(ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for name in ("moe_wq", "moe_wk", "moe_wv", "moe_wo", "moe_expert_gate", "moe_expert_down"):
        assert isinstance(getattr(quantized.model, name).get_value(), qwix.QArray), name
    assert quantized.model.moe_router.get_value().dtype == quantized.model.lm_head.get_value().dtype == np.float32
