"""LLaDA2.0 (llada2_moe): upstream parity of the forward, the routing rule, the expert compute and
its cost, the exact prefix cache, the key table and parameter count of the real model, config errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from paths import GOLDENS, HF_CONFIGS

from convert import expected_keys
from convert.hf import iter_params
from convert.orbax_io import load_checkpoint, save_params
from convert.safetensors_dir import SafetensorsDir
from models import ConfigError, LLaDA2MoE, config_from_dict, load_config
from models.llada2 import block_causal
from models.moe import ragged_matmul, route, routed_experts, slot_rows
from models.transformer import swiglu

from conftest import llada2_mini_config

TINY = GOLDENS / "llada2-tiny"
MINI = HF_CONFIGS / "LLaDA2.0-mini"
LOGIT_ATOL = 1e-4  # float32 parity with upstream PyTorch (float32 vs float64 differ by ~1.2e-5)
# Cached = uncached up to float32 rounding: XLA:CPU's reduction order depends on the row count (the
# first RMSNorm of 16 rows and of 48 rows already differ by 4 ulp), which reaches ~1e-6 relative
# (1.05e-5 at a logit of 10) after the LM head.
CACHE_RTOL, CACHE_ATOL = 2e-6, 1e-5


@pytest.fixture(scope="module")
def forward(llada2_lm):
    """The tiny model's jitted forward: (ids, mask, positions, block_length) -> logits (numpy)."""
    graphdef, params = nnx.split(llada2_lm.model)
    fn = jax.jit(lambda p, i, m, q, bl: nnx.merge(graphdef, p)(i, m, q, bl), static_argnums=4)

    def call(ids, mask=None, positions=None, block_length=None):
        return np.asarray(fn(params, jnp.asarray(ids, jnp.int32), mask, positions, block_length))

    return call


# ------------------------------------------------------------------------------------ forward
def test_block_causal_forward_matches_upstream(llada2_lm, llada2_cases, forward):
    pre = "llada2-tiny.forward."
    block_length = int(llada2_cases[pre + "block_length"])
    blocks = np.arange(48) // block_length
    np.testing.assert_array_equal(np.asarray(block_causal(blocks, blocks)), llada2_cases[pre + "visible"].astype(bool))
    positions = jnp.asarray(llada2_cases[pre + "position_ids"], jnp.int32)
    logits = forward(llada2_cases[pre + "input_ids"], None, positions, block_length)
    assert logits.dtype == np.float32 and logits.shape == (2, 48, 512)
    np.testing.assert_allclose(logits, llada2_cases[pre + "logits"], rtol=0, atol=LOGIT_ATOL)


def test_bidirectional_forward_matches_upstream(llada2_lm, llada2_cases):
    """``load_model`` builds the LLaDA2.0 module; with no mask the forward is fully bidirectional."""
    assert isinstance(llada2_lm.model, LLaDA2MoE)
    cfg = llada2_lm.config
    assert (cfg.mask_id, cfg.eos_id, cfg.pad_id, cfg.logit_shift) == (511, 508, 509, 0)
    logits = np.asarray(llada2_lm.logits(llada2_cases["llada2-tiny.forward_full.input_ids"]))
    np.testing.assert_allclose(logits, llada2_cases["llada2-tiny.forward_full.logits"], rtol=0, atol=LOGIT_ATOL)


@pytest.fixture(scope="module")
def scanned(tmp_path_factory):
    """The tiny model converted to an Orbax checkpoint and restored in the lax.scan layout."""
    out = tmp_path_factory.mktemp("llada2-orbax")
    cfg = load_config(TINY)
    with SafetensorsDir(TINY) as reader:
        save_params(iter_params(reader, cfg, jnp.float32), jnp.float32, TINY, out)
    return load_checkpoint(out, jnp.float32, unroll_layers=False)


PREFIX, BLOCK = 16, 16


@pytest.fixture(scope="module")
def full_and_cached(scanned):
    """(ids [2, 48], mask) -> (block-causal logits [2, 48, V], the same positions 16.. from a
    prefill of the first block and one window over the next two blocks), compiled once."""
    graphdef, params = nnx.split(scanned)

    @jax.jit
    def both(params, ids, mask):
        m = nnx.merge(graphdef, params)
        full = m(ids, mask, None, BLOCK)
        _, ck, cv = m.prefill(ids[:, :PREFIX], mask[:, :PREFIX], None, BLOCK)
        width = ids.shape[1] - PREFIX
        pos = jnp.broadcast_to(jnp.arange(PREFIX, ids.shape[1], dtype=jnp.int32), (2, 1, width))
        cache_mask, window_mask = mask[:, :PREFIX] > 0, mask[:, PREFIX:] > 0
        window = m.window(ids[:, None, PREFIX:], pos, ck, cv, cache_mask, window_mask, width, BLOCK)
        return full, window[:, 0]

    return lambda ids, mask: tuple(map(np.asarray, both(params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))))


def test_scanned_layers_from_orbax_checkpoint_match_upstream(scanned, full_and_cached, llada2_cases):
    assert not scanned.unrolled and scanned.moe_wqkv.shape[0] == 2
    ids = llada2_cases["llada2-tiny.forward.input_ids"]
    full, window = full_and_cached(ids, np.ones(ids.shape, np.int32))
    np.testing.assert_allclose(full, llada2_cases["llada2-tiny.forward.logits"], rtol=0, atol=LOGIT_ATOL)
    np.testing.assert_allclose(window, llada2_cases["llada2-tiny.forward.logits"][:, PREFIX:], rtol=0, atol=LOGIT_ATOL)


# ------------------------------------------------------------------------------------ caching
def test_cached_window_equals_uncached_forward(llada2_lm, full_and_cached):
    """prefill of the first block + a window over the next two = the block-causal forward there
    (so the window is block-causal inside), with left padding in one row."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 508, (2, 48)).astype(np.int32)
    mask = np.ones((2, 48), np.int32)
    mask[1, :5] = 0
    ids[mask == 0] = llada2_lm.config.pad_id
    ids[:, 40:] = llada2_lm.config.mask_id
    full, window = full_and_cached(ids, mask)
    np.testing.assert_allclose(window, full[:, PREFIX:], rtol=CACHE_RTOL, atol=CACHE_ATOL)
    # The window's first block must not see its second: changing the second changes only it.
    ids[:, 40:] = 7
    full2, window2 = full_and_cached(ids, mask)
    np.testing.assert_array_equal(window2[:, :16], window[:, :16])
    assert np.abs(window2[:, 16:] - window[:, 16:]).max() > 1e-3


# ------------------------------------------------------------------------------------ routing
def route_reference(x, router, bias, *, top_k, n_group, topk_group, scaling):
    """The upstream rule token by token in float64: groups by the sum of their top-2 biased scores,
    top-k biased scores among the kept groups (ties to the lower index), unbiased weights normalised."""
    chosen, weights = [], []
    per_group = router.shape[1] // n_group
    for row in np.asarray(x, np.float64):
        scores = 1.0 / (1.0 + np.exp(-(row @ np.asarray(router, np.float64))))
        biased = scores + np.asarray(bias, np.float64)
        group_scores = [np.sort(biased[g * per_group : (g + 1) * per_group])[-2:].sum() for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-group_scores[g], g))[:topk_group]
        allowed = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        experts = sorted(allowed, key=lambda e: (-biased[e], e))[:top_k]
        w = scores[experts] / scores[experts].sum()
        chosen.append(experts)
        weights.append(w * scaling)
    return np.asarray(chosen), np.asarray(weights)


def test_routing_matches_the_per_token_rule():
    rng = np.random.default_rng(1)
    d, E, rule = 16, 16, dict(top_k=3, n_group=4, topk_group=2, scaling=2.5)
    x = rng.normal(size=(64, d)).astype(np.float32)
    router = rng.normal(size=(d, E)).astype(np.float32)
    bias = (0.3 * rng.normal(size=E)).astype(np.float32)
    # Ties: rows of zeros score 0.5 on every expert, so groups and experts tie on the bias alone;
    # with a bias that repeats across groups, whole groups tie too.
    x[:8] = 0.0
    tied_bias = np.tile(np.array([0.1, 0.0, 0.1, 0.0], np.float32), 4)
    for b in (bias, tied_bias):
        chosen, weights = jax.jit(lambda x, r, b: route(x, r, b, **rule))(x, router, b)
        ref_chosen, ref_weights = route_reference(x, router, b, **rule)
        np.testing.assert_array_equal(np.asarray(chosen), ref_chosen)
        np.testing.assert_allclose(np.asarray(weights), ref_weights, rtol=1e-6, atol=1e-6)
    assert set(ref_chosen[0]) == {0, 2, 4}  # tied groups 0 and 1 kept, lower indices first


def test_routed_experts_are_exact_for_every_slot_size_and_the_grouped_product():
    """Each token gets exactly its k experts, whatever the slot size (one row per expert and slot: as
    many slots as the largest group; three; the default) and through the grouped product (TPU's
    path, ``ragged_dot``), with empty experts, and with every token on one expert (the most slots)."""
    rng = np.random.default_rng(2)
    T, d, F, E, k = 24, 8, 6, 8, 2
    x = rng.normal(size=(T, d)).astype(np.float32)
    spread = np.stack([rng.choice([0, 1, 2, 5, 7], size=k, replace=False) for _ in range(T)])
    crowded = np.stack([np.full(T, 3), rng.choice([0, 1, 2, 4, 5, 6, 7], size=T)], axis=1)
    weights = rng.random((T, k)).astype(np.float32)
    wg, wu = rng.normal(size=(E, d, F)).astype(np.float32), rng.normal(size=(E, d, F)).astype(np.float32)
    wd = rng.normal(size=(E, F, d)).astype(np.float32)
    silu = lambda a: a / (1 + np.exp(-a))
    run = jax.jit(routed_experts, static_argnums=(6, 7, 8))
    for chosen in (spread.astype(np.int32), crowded.astype(np.int32)):
        ref = sum(
            weights[:, j, None]
            * np.stack([(silu(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e] for t, e in enumerate(chosen[:, j])])
            for j in range(k)
        )
        for rows, grouped in ((1, None), (3, None), (None, None), (None, ragged_matmul)):
            got = run(x, chosen, weights, wg, wu, wd, swiglu, rows, grouped)
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5, err_msg=f"{rows} {grouped}")


def test_slot_rows_cover_a_balanced_routing_in_one_slot():
    """Twice the mean group size, a power of two within [8, 32], never more than the tokens."""
    assert slot_rows(64, 16, 32) == 8  # DiffusionGemma's 100M shape, one canvas: mean 4
    assert slot_rows(256, 16, 128) == 32
    assert slot_rows(256, 256, 32) == 8  # LLaDA2.0-mini decoding: mean 1, at least 8
    assert slot_rows(8192, 16, 4096) == 32
    assert slot_rows(16, 8, 4) == 4  # no group exceeds 4 tokens


# ------------------------------------------------------------------------- real LLaDA2.0-mini
def test_key_table_equals_the_real_checkpoint_names_and_shapes():
    real = {w["name"]: tuple(w["shape"]) for w in json.loads((MINI / "weight_names.json").read_text())}
    keys = expected_keys(llada2_mini_config())
    assert len(real) == len(keys) == 14813
    assert {k: t.source_shape for k, t in keys.items()} == real
    target = keys["model.layers.7.mlp.experts.131.up_proj.weight"]
    assert (target.param, target.layer, target.expert, target.transpose) == ("moe_expert_up", 6, 131, True)


def test_parameter_count_equals_upstream():
    """eval_shape of the full model (no weights) has upstream's parameters plus the 19 x 256
    ``expert_bias`` values, which torch counts as buffers, not parameters."""
    cfg = llada2_mini_config()
    counts = json.loads((MINI / "param_count.json").read_text())
    model = nnx.eval_shape(lambda: LLaDA2MoE(cfg, dtype=jnp.bfloat16))
    sizes = {"/".join(map(str, p)): v.size for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    bias = sum(n for name, n in sizes.items() if "expert_bias" in name)
    assert bias == counts["persistent_buffers"] == 4864
    assert sum(sizes.values()) - bias == counts["parameters"] == cfg.param_count()
    assert cfg.param_count(include_expert_bias=True) == counts["state_dict_numel"]
    assert cfg.active_param_count() == counts["activated_parameters_per_token"]


# ------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize(
    "change, field",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"score_function": "softmax"}, "score_function"),
        ({"use_qkv_bias": True}, "use_qkv_bias"),
        ({"rotary_dim": 6}, "rotary_dim"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_unsupported_config_is_one_clear_error(change, field):
    raw = {**json.loads((TINY / "config.json").read_text()), **change}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "tiny", {"mask_token_id": 511, "eos_token_id": 508})
    assert field in str(err.value) and "\n" not in str(err.value)


def test_special_ids_come_from_decode_json_or_tokenizer_files(tmp_path):
    with pytest.raises(ConfigError, match="mask_token_id"):
        load_config(MINI)  # the real config and tokenizer_config.json name no ids
    (tmp_path / "config.json").write_text((MINI / "config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text((MINI / "tokenizer_config.json").read_text())
    ids = json.loads((MINI / "special_ids.json").read_text())
    added = [
        {"id": ids["eos_token_id"], "content": "<|endoftext|>"},
        {"id": ids["mask_token_id"], "content": "<|mask|>"},
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added, "model": {"vocab": {}}}))
    cfg = load_config(tmp_path)
    assert (cfg.mask_id, cfg.eos_id, cfg.pad_id) == (156895, 156892, 156892)
    assert cfg.param_count() == json.loads((MINI / "param_count.json").read_text())["parameters"]
