"""SDAR (``SDARForCausalLM``: block diffusion on the Qwen3 layout) against the upstream goldens: the
config and key table (tiny and the real SDAR-8B-Chat), the block-causal forward (also with left
padding), and the 15 decoding cases of SDAR's evaluation decoder and ``generate.py`` token for token
with upstream's decoding calls, uncached and with the exact block cache; the ids past ``gen_length``
that upstream also returns; strict PSD and RPS on it; int8 weights.

Every case is decoded in a padded batch of its three prompts (lengths 3, 13 and 24), so each test
also checks that a row decodes in a batch as upstream's batch 1 does. Compiles dominate the time,
so each compiled decode checks as much as it can."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from paths import GOLDENS, HF_CONFIGS
from safetensors.numpy import load_file

from convert import expected_keys
from convert.safetensors_dir import SafetensorsDir
from models import SDAR, ConfigError, SDARConfig, config_from_dict, load_config, param_shapes
from models.quantize import is_projection, quantize_weight
from psd_jax import DecodeConfig, load_model
from psd_jax.core.engine import batch_keys, loop_and_mask, run_while_loop
from psd_jax.core.runtime import Program, RowValues
from psd_jax.parallel.sharding import logical_axes, spec_for
from psd_jax.prompts import left_pad

TINY = GOLDENS / "sdar-tiny"
REAL = HF_CONFIGS / "SDAR-8B-Chat"
LOGIT_ATOL = 1e-4  # float32 parity with upstream PyTorch (float32 vs float64 differ by ~1e-5)
ROWS = range(3)
# Upstream setting -> (policy, top_k): the evaluation decoder (bd3) is threshold_schedule;
# generate.py's dynamic mode is threshold_schedule scored on the top_k=1 distribution (upstream
# greedy), its sequential mode the sequential policy.
SETTINGS = {
    "bd3_g32b4s4": ("threshold_schedule", 0),
    "bd3_g32b4s4t05": ("threshold_schedule", 0),
    "bd3_g32b8s4t07": ("threshold_schedule", 0),
    "gen_seq_g32b4s2": ("sequential", 0),
    "gen_dyn_g32b4s4": ("threshold_schedule", 1),
}


@pytest.fixture(scope="module")
def cases() -> dict:
    return load_file(str(GOLDENS / "sdar_cases.safetensors"))


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY)


def case(cases: dict, setting: str, row: int, field: str):
    return cases[f"sdar-tiny.generate_{setting}_p{row}.{field}"]


def settings_of(cases: dict, setting: str, **changes) -> DecodeConfig:
    """The DecodeConfig of an upstream call (``denoising_steps`` is per block, as there)."""
    policy, top_k = SETTINGS[setting]
    field = lambda name: case(cases, setting, 0, name)  # noqa: E731
    threshold = {"threshold": float(field("threshold"))} if policy == "threshold_schedule" else {}
    return DecodeConfig(
        gen_length=int(field("gen_length")),
        block_length=int(field("block_length")),
        steps=int(field("denoising_steps")),
        policy=policy,
        top_k=top_k,
        **threshold,
        **changes,
    )


def prompts(cases: dict, setting: str) -> list[list[int]]:
    return [case(cases, setting, row, "prompt")[0].tolist() for row in ROWS]


def upstream_generated(cases: dict, setting: str, row: int) -> list[int]:
    """Upstream's generated ids: every position after the prompt up to the last block's end
    (``[MASK]`` in the blocks it never decoded)."""
    prompt, output = case(cases, setting, row, "prompt"), case(cases, setting, row, "output")
    return output[0, prompt.shape[1] :].tolist()


def assert_upstream(cases: dict, setting: str, results, mask_id: int, eos_id: int) -> None:
    """Each row's gen_length ids are upstream's, its blocks never decoded read EOS, and its NFE is
    upstream's decoding calls (``nfe_logits``)."""
    for row in ROWS:
        want = [eos_id if t == mask_id else t for t in upstream_generated(cases, setting, row)]
        got = results[row].output_ids
        assert got == want[: len(got)], (setting, row)
        assert results[row].nfe == int(case(cases, setting, row, "nfe_logits")), (setting, row)


# ------------------------------------------------------------------------------------ config
def test_config_ids_and_stop_list():
    """config.json names the mask and EOS ids; the stop list (<|im_end|>, <|endoftext|>) is
    generation_config.json's, or decode.json's beside the tiny checkpoint."""
    cfg = load_config(TINY)
    assert isinstance(cfg, SDARConfig) and cfg.family == "sdar" and cfg.block_causal
    assert (cfg.mask_id, cfg.eos_id, cfg.pad_id, cfg.eot_id, cfg.stop_ids) == (509, 502, 502, 504, (502, 504))
    assert (cfg.logit_shift, cfg.positions_from_mask, cfg.head_dim, cfg.block_size) == (0, False, 16, 4)
    for real in (load_config(REAL), load_config(HF_CONFIGS / "SDAR-4B-Chat")):
        assert (real.mask_id, real.eos_id, real.pad_id, real.stop_ids) == (151669, 151643, 151643, (151643, 151645))


def test_layers_split_by_heads_over_model():
    """Tensor parallel as the other dense families: q/k/v and the MLP's inputs split by output
    columns (heads, hidden units), o and the MLP's output by rows, norms replicated."""
    from jax.sharding import AbstractMesh, PartitionSpec

    cfg = load_config(REAL)
    mesh = AbstractMesh((1, 8), ("data", "model"))
    spec = {name: spec_for(logical_axes(cfg, name), shape, mesh) for name, shape in param_shapes(cfg).items()}
    assert spec["dense_wq"] == spec["dense_wk"] == spec["dense_w_gate"] == PartitionSpec(None, None, "model")
    assert spec["dense_wo"] == spec["dense_w_down"] == PartitionSpec(None, "model", None)
    assert spec["dense_q_norm"] == PartitionSpec(None, None) and spec["lm_head"] == PartitionSpec(None, "model")


def test_key_table_and_parameter_count_equal_the_real_checkpoint():
    """The real SDAR-8B-Chat weight index: the same tensor names as the key table, and its bytes
    (bfloat16) are the config's parameter count twice; the tiny checkpoint's names and shapes too."""
    index = json.loads((REAL / "model.safetensors.index.json").read_text())
    real = load_config(REAL)
    assert set(index["weight_map"]) == set(expected_keys(real))
    assert index["metadata"]["total_size"] == 2 * real.param_count() == 16_381_470_720
    model = nnx.eval_shape(lambda: SDAR(real, dtype=jnp.bfloat16))
    assert sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))) == real.param_count()
    tiny = load_config(TINY)
    with SafetensorsDir(TINY) as reader:
        shapes = dict(reader.shapes)
    assert {k: t.source_shape for k, t in expected_keys(tiny).items()} == shapes
    assert tiny.param_count() == sum(math.prod(s) for s in shapes.values())


@pytest.mark.parametrize(
    "change, name",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"mask_token_id": 512}, "mask_token_id"),
    ],
)
def test_unsupported_config_is_one_clear_error(change, name):
    raw = {**json.loads((TINY / "config.json").read_text()), **change}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "tiny", {"pad_token_id": 502})
    assert name in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------ forward
def test_forward_matches_upstream_also_left_padded(lm, cases):
    """The block-causal forward (blocks of 4 from position 0) within 1e-4 of upstream's; and with
    row 0 left-padded by 36 (pad keys masked, positions from its first real token) its real
    positions' logits, as upstream's explicit 4-D mask gives them."""
    assert isinstance(lm.model, SDAR) and lm.model.unrolled
    graphdef, params = nnx.split(lm.model)
    fn = jax.jit(lambda p, i, m, q: nnx.merge(graphdef, p)(i, m, q, 4))
    pre = "sdar-tiny.forward."
    assert int(cases[pre + "block_size"]) == 4
    blocks = np.arange(200) // 4
    np.testing.assert_array_equal(blocks[None, :] <= blocks[:, None], cases[pre + "visible"].astype(bool))
    logits = np.asarray(
        fn(params, jnp.asarray(cases[pre + "input_ids"]), None, jnp.asarray(cases[pre + "position_ids"]))
    )
    assert logits.dtype == np.float32 and logits.shape == (2, 200, 512)
    np.testing.assert_allclose(logits, cases[pre + "logits"], rtol=0, atol=LOGIT_ATOL)
    pre = "sdar-tiny.forward_padded."
    pad = cases[pre + "pad_length"]
    mask = (np.arange(200)[None, :] >= pad[:, None]).astype(np.int32)
    ids, positions = jnp.asarray(cases[pre + "input_ids"]), jnp.asarray(cases[pre + "position_ids"])
    logits = np.asarray(fn(params, ids, jnp.asarray(mask), positions))
    for row in (0, 1):
        np.testing.assert_allclose(logits[row, pad[row] :], cases[pre + "logits"][row, pad[row] :], atol=LOGIT_ATOL)


# ------------------------------------------------------------------------------------ decoding
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_golden_cases_uncached(lm, cases, setting):
    results = lm.generate(prompts(cases, setting), settings_of(cases, setting), prompt_bucket=None)
    assert_upstream(cases, setting, results, lm.config.mask_id, lm.config.eos_id)


@pytest.mark.parametrize("setting", ["bd3_g32b4s4t05", "gen_seq_g32b4s2", "gen_dyn_g32b4s4"])
def test_golden_cases_with_the_exact_block_cache(lm, cases, setting):
    """The block cache: upstream's tokens and decoding calls; the batch's calls are its start (a
    full forward), each block's first call a window over the previous and the current block, and
    windows of the block (none under generate.py's dynamic mode: a block's first call fills it)."""
    results = lm.generate(prompts(cases, setting), settings_of(cases, setting, cache="prefix"), prompt_bucket=32)
    assert_upstream(cases, setting, results, lm.config.mask_id, lm.config.eos_id)
    kinds = {c["kind"] for c in results[0].calls}
    assert kinds == {"refresh", "block_refresh"} | (set() if setting.startswith("gen_dyn") else {"window"})


def test_ids_past_gen_length_and_upstream_call_count(lm, cases):
    """Upstream also returns the rest of the last block past prompt + gen_length; the loop decodes
    it identically (its canvas, read before the output is trimmed). Upstream's ``nfe`` adds to the
    decoding calls a prefill (when the prompt has a whole block) and one key/value-storing call
    per decoded block; the cached decode of one prompt folds both into its decoding calls."""
    setting = "bd3_g32b8s4t07"  # blocks of 8: up to 7 ids past gen_length
    dcfg, cfg = settings_of(cases, setting), lm.config
    ids, mask = left_pad(prompts(cases, setting), cfg, dcfg.gen_length, None)
    graphdef, params = nnx.split(lm.model)

    def raw(params, ids, mask):
        model = nnx.merge(graphdef, params)
        keys, values = batch_keys(jax.random.key(0), ids.shape[0]), RowValues.of([dcfg] * ids.shape[0])
        loop, attention_mask = loop_and_mask(model, mask, cfg, Program.of(dcfg), values)
        return run_while_loop(loop, ids, attention_mask, keys, values).canvas, loop.layout.rows.gen_start

    canvas, gen_start = map(np.asarray, jax.jit(raw)(params, jnp.asarray(ids), jnp.asarray(mask)))
    past = 0
    for row in ROWS:
        want = upstream_generated(cases, setting, row)
        got = canvas[row, gen_start[row] : gen_start[row] + len(want)].tolist()
        assert got == want, row
        past += len(want) - dcfg.gen_length
        prompt = prompts(cases, setting)[row]
        region = prompt[len(prompt) // 8 * 8 :] + got  # from the first decoded block's start
        decoded_blocks = sum(cfg.mask_id not in region[i : i + 8] for i in range(0, len(region), 8))
        prefill = int(len(prompt) >= 8)
        assert (
            int(case(cases, setting, row, "nfe"))
            == int(case(cases, setting, row, "nfe_logits")) + prefill + decoded_blocks
        )
    assert past == 5 + 3  # rows of 3 and 13 prompt ids: 5 and 3 ids past gen_length
    single = lm.generate([prompts(cases, setting)[0]], dcfg.replace(cache="prefix"), prompt_bucket=None)[0]
    assert sum(c["count"] for c in single.calls) == single.nfe == int(case(cases, setting, 0, "nfe_logits"))


def test_strict_psd_and_rps_keep_their_guarantees(lm, cases):
    """Strict PSD gives the policy's tokens in at most its calls; RPS without an eligible pivot
    (one value, tau 1) is its base policy exactly."""
    setting = "bd3_g32b4s4t05"
    psd = lm.generate(prompts(cases, setting), settings_of(cases, setting, decoder="psd", depth=2, acceptance="strict"))
    for row in ROWS:
        want = [lm.config.eos_id if t == lm.config.mask_id else t for t in upstream_generated(cases, setting, row)]
        assert psd[row].output_ids == want[:32] and psd[row].nfe <= int(case(cases, setting, row, "nfe_logits"))
    rps = lm.generate(prompts(cases, setting), settings_of(cases, setting, decoder="rps", k_max=1, pivot_tau=1.0))
    assert all(r.stats["pivot_found"] == 0 for r in rps)
    assert_upstream(cases, setting, rps, lm.config.mask_id, lm.config.eos_id)


def test_int8_is_the_dequantized_weights_product(cases):
    """int8 (weight-only): q/k/v/o and the MLP stored as integers, norms, embedding and head in float;
    the logits are the float model's with those weights dequantized."""
    ids = cases["sdar-tiny.forward.input_ids"][:, :64]
    quantized = load_model(TINY, quantize="int8", unroll_layers=False)
    reference = load_model(TINY, unroll_layers=False)
    projections = list(filter(is_projection, param_shapes(reference.config)))
    assert {"dense_wq", "dense_wo", "dense_w_gate", "dense_w_down"} <= set(projections)
    for name in projections:
        weight = getattr(reference.model, name).get_value()
        reference.model.set_param(name, qwix.dequantize(quantize_weight(weight, "int8")))
    reference.graphdef, reference.params = nnx.split(reference.model)
    got, want = np.asarray(quantized.logits(ids)), np.asarray(reference.logits(ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert isinstance(quantized.model.dense_wq.get_value(), qwix.QArray)
    assert quantized.model.lm_head.get_value().dtype == np.float32


def test_server_answers_concurrent_token_id_prompts_as_generate(lm, cases):
    """``/v1/completions`` with token-id prompts (the tiny checkpoint has no tokenizer), three clients
    at once with the evaluation decoder's dynamic threshold: each answer is ``generate``'s ids for
    the prompt alone, cut at its first stop id, with its model calls."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from served import running

    from psd_jax.serve import build_app

    setting = "bd3_g32b4s4t05"
    settings = settings_of(cases, setting)
    app = build_app(lm, settings, name="sdar", batch_sizes=(1, 2, 4), max_wait_ms=50, prompt_bucket=32)
    with running(app) as url:

        def complete(prompt: list[int]) -> dict:
            body = {"model": "sdar", "prompt": prompt, "max_tokens": settings.gen_length}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(complete, prompts(cases, setting)))
    for row, answer in zip(ROWS, answers):
        (alone,) = lm.generate([prompts(cases, setting)[row]], settings, prompt_bucket=32)
        assert answer["choices"][0]["token_ids"] == alone.output_ids[: alone.tokens], row
        assert answer["usage"]["model_calls"] == alone.nfe == int(case(cases, setting, row, "nfe_logits")), row
    assert [a["choices"][0]["finish_reason"] for a in answers] == ["length", "length", "stop"]
