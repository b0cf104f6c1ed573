"""Sharded decoding on 8 simulated CPU devices gives the same tokens as one device."""

from __future__ import annotations

import math

import jax
import pytest
from diffusion_gemma_goldens import golden_case
from paths import GOLDENS, HF_CONFIGS

from models import param_shapes
from psd_jax.parallel.sharding import (
    MeshError,
    batch_sharding,
    kv_cache_spec,
    logical_axes,
    make_mesh,
    param_shardings,
    parse_mesh,
    spec_for,
)

from conftest import llada2_mini_config
from sharded_decode import (
    CACHED,
    DECODERS,
    DG_CASE,
    DG_OWN_MESH,
    DG_REPLAY_MESH,
    MESHES,
    MOE_DECODE,
    MOE_INT8_MESH,
    MOE_MESHES,
)


@pytest.mark.parametrize(("mesh", "decoder"), [(mesh, name) for mesh, names in MESHES.items() for name in names])
def test_mesh_gives_single_device_tokens(sharded_run, mesh, decoder):
    """Every decoder, uncached and with the KV cache, on a tensor-parallel mesh (and a data-parallel one)."""
    assert sharded_run["meshes"][mesh][decoder] == sharded_run["reference"][decoder]


def test_a_running_batch_on_a_mesh_joins_and_regroups_as_one_device(sharded_run):
    """A block-by-block decode on data=2,model=4 that grows from 2 to 4 rows, takes two joined rows
    (their own thresholds and lengths) and shrinks to 2 as rows finish: every row's ids and model
    calls are one device's decode of it alone."""
    run = sharded_run["serving"]
    assert run["block_decode"] == [[ids, nfe] for ids, nfe, _ in run["reference"]]


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_server_on_a_mesh_answers_as_one_device(sharded_run, batching):
    """Concurrent requests of different lengths and thresholds to a server on data=2,model=4: each
    answer (ids up to EOS, model calls) is one device's decode of it alone."""
    run = sharded_run["serving"]
    assert run[batching]["failed_batches"] == 0
    assert run[batching]["answers"] == [[ids[:tokens], nfe] for ids, nfe, tokens in run["reference"]]


def test_every_setting_runs_on_a_tensor_parallel_mesh():
    tensor_parallel = set(MESHES["data=1,model=8"]) | set(MESHES["data=2,model=4"])
    assert tensor_parallel == set(DECODERS) | set(CACHED)


def test_parameters_are_really_sharded(sharded_run):
    tensor_parallel = ["embed", "lm_head", "w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]
    assert sharded_run["meshes"]["data=1,model=8"]["split_params"] == tensor_parallel
    assert sharded_run["meshes"]["data=2,model=4"]["split_params"] == tensor_parallel
    assert sharded_run["meshes"]["data=8,model=1"]["split_params"] == []


def test_mesh_loads_read_exactly_the_one_device_values(sharded_run):
    """Each device's blocks are read from the safetensors files (convert.hf.sharded_params): every
    parameter of every mesh load, LLaDA's and LLaDA2.0's expert meshes, equals the one-device load."""
    meshes = [*sharded_run["meshes"].values(), *sharded_run["moe"].values()]
    assert [m["params_equal"] for m in meshes] == [True] * (len(MESHES) + len(MOE_MESHES))


def test_expert_mesh_forward_equals_one_device(sharded_run):
    """LLaDA2.0-tiny's logits (8 experts, top-2) on expert meshes against one device. Rows the
    expert devices do not divide stay whole on each device: splitting only experts is then exact
    (each row's expert sum is the same float32 sum). 8 rows are split over data x expert, and the
    reference is one device at the mesh's rows per device; the expert product then runs on the
    gathered rows and (with ``model``) the tensor-parallel contractions are summed in another
    order: within float32 rounding, |diff| <= 1e-5 + 2e-6 |logit| (test_llada2's cached-forward
    tolerance)."""
    runs = sharded_run["moe"]
    assert runs["expert=8"]["two_rows_max_abs_diff"] == 0.0
    for mesh in MOE_MESHES:
        assert runs[mesh]["max_excess"] <= 1e-5, (mesh, runs[mesh])


def test_expert_mesh_splits_rows_over_the_expert_devices(sharded_run):
    """Attention, dense layers and the head run data parallel over data x expert: each device holds
    and computes 8 / (data x expert) of the rows (models.moe.row_axes)."""
    runs = sharded_run["moe"]
    want = {"expert=8": 1, "data=2,expert=2,model=2": 2, "expert=4,model=2": 2}
    assert {mesh: runs[mesh]["logit_rows_per_device"] for mesh in MOE_MESHES} == want
    assert {mesh: runs[mesh]["rows_per_device"] for mesh in MOE_MESHES} == want


def test_expert_weights_are_really_split(sharded_run):
    runs = sharded_run["moe"]
    experts = ["expert_down", "expert_gate", "expert_up"]
    tensor_parallel = ["embed", "lm_head", "shared_down", "shared_gate", "shared_up", "w_down", "w_gate", "w_up"]
    assert runs["expert=8"]["split_params"] == experts  # router, expert_bias, norms: replicated
    for mesh in ["data=2,expert=2,model=2", "expert=4,model=2"]:
        assert runs[mesh]["split_params"] == sorted(experts + tensor_parallel + ["wo", "wqkv"])
    # one layer's [experts, d_model, F] / [experts, F, d_model] on each device (8 experts, F = 32)
    assert runs["expert=8"]["expert_shards"] == {
        "expert_down": [1, 32, 64],
        "expert_gate": [1, 64, 32],
        "expert_up": [1, 64, 32],
    }
    assert runs["data=2,expert=2,model=2"]["expert_shards"]["expert_gate"] == [4, 64, 16]
    assert runs["expert=4,model=2"]["expert_shards"] == {
        "expert_down": [2, 16, 64],
        "expert_gate": [2, 64, 16],
        "expert_up": [2, 64, 16],
    }


@pytest.mark.parametrize("mesh", MOE_MESHES)
def test_expert_mesh_decodes_single_device_tokens(sharded_run, mesh):
    """Block diffusion on each expert mesh (uncached; the block cache; PSD on it) gives one device's
    tokens and model calls for a padded batch of two rows."""
    run = sharded_run["moe"][mesh]
    assert run["decoded"] == run["decoded_reference"]
    assert all(len(ids) == MOE_DECODE[mesh].gen_length for ids, _ in run["decoded"])


def test_sdar_on_a_mesh_decodes_single_device_tokens(sharded_run):
    """SDAR (block-causal, dense) with its exact block cache on data=4,model=2: one device's tokens
    and model calls for a padded batch of four rows; its projections really split over ``model``."""
    run = sharded_run["sdar"]
    assert run["decoded"] == run["reference"]
    assert {"wq", "wk", "wo", "w_gate", "w_down"} <= set(run["split_params"])  # unrolled layers' names


def test_kv_cache_sharding_is_pinned(sharded_run):
    """llada-tiny's 4 KV heads split over model=4; on model=8 (which does not divide them) the head
    dimension is split instead of the cache being replicated; rows over data."""
    specs = {mesh: run["kv_cache_spec"] for mesh, run in sharded_run["meshes"].items()}
    assert specs["data=2,model=4"] == [None, "data", None, "model", None]
    assert specs["data=1,model=8"] == [None, None, None, None, "model"]
    assert specs["data=8,model=1"] == [None, None, None, None, None]  # 2 rows do not split over 8


def test_kv_cache_spec_rule():
    from models import load_config

    cfg = load_config(HF_CONFIGS / "Dream-v0-Instruct-7B")  # 4 KV heads of 128
    assert kv_cache_spec(cfg, {"data": 1, "model": 8}, 32) == jax.sharding.PartitionSpec(
        None, None, None, None, "model"
    )
    assert kv_cache_spec(cfg, {"data": 2, "model": 4}, 32) == jax.sharding.PartitionSpec(
        None, "data", None, "model", None
    )
    assert kv_cache_spec(cfg, {"data": 1, "model": 1}, 1) == jax.sharding.PartitionSpec(None, None, None, None, None)


def test_rows_split_over_expert_devices_when_they_divide_the_batch():
    from models.moe import row_axes

    cfg = llada2_mini_config()
    P = jax.sharding.PartitionSpec
    assert row_axes({"data": 1, "expert": 8, "model": 1}, 32) == ("data", "expert")
    assert row_axes({"data": 2, "expert": 2, "model": 2}, 6) == "data"  # 4 does not divide 6
    assert row_axes({"data": 1, "expert": 8, "model": 1}, 4) is None
    assert row_axes({"data": 2, "model": 4}, 8) == "data"
    assert kv_cache_spec(cfg, {"data": 1, "expert": 8, "model": 1}, 32) == P(None, ("data", "expert"), None, None, None)
    assert kv_cache_spec(cfg, {"data": 1, "expert": 4, "model": 2}, 1) == P(None, None, None, "model", None)
    assert batch_sharding(make_mesh("expert=1"), 4).spec == P(None)  # one device: rows whole


def test_mesh_spec_parsing():
    assert parse_mesh("data=2,model=4", 8) == {"data": 2, "model": 4}
    assert parse_mesh("data=2", 8) == {"data": 2, "model": 4}
    assert parse_mesh(None, 8) == {"data": 1, "model": 8}
    with pytest.raises(MeshError, match="needs 6 devices, found 8"):
        parse_mesh("data=2,model=3", 8)
    with pytest.raises(MeshError, match="unknown mesh axis 'tensor'"):
        parse_mesh("tensor=8", 8)
    with pytest.raises(MeshError, match="data=3 does not divide the 8 devices"):
        parse_mesh("data=3", 8)


def test_expert_mesh_spec_parsing():
    assert parse_mesh("expert=8", 8) == {"data": 1, "expert": 8, "model": 1}
    assert parse_mesh("data=1,expert=4,model=2", 8) == {"data": 1, "expert": 4, "model": 2}
    assert parse_mesh("expert=4", 8) == {"data": 1, "expert": 4, "model": 2}
    assert parse_mesh("data=2,expert=2", 8) == {"data": 2, "expert": 2, "model": 2}
    assert parse_mesh("expert=2,model=2", 8) == {"data": 2, "expert": 2, "model": 2}
    with pytest.raises(MeshError, match="expert=3 does not divide the 8 devices"):
        parse_mesh("expert=3", 8)
    with pytest.raises(MeshError, match="needs 16 devices, found 8"):
        parse_mesh("data=2,expert=4,model=2", 8)
    assert make_mesh("expert=1").axis_names == ("data", "expert", "model")
    assert make_mesh("data=1").axis_names == ("data", "model")


def test_llada2_logical_axes_map_to_mesh_axes():
    """LLaDA2.0-mini: experts over expert, their hidden units over model, router replicated; on
    expert=8 each device holds an eighth of the experts and the rest whole."""
    from jax.sharding import AbstractMesh, PartitionSpec

    from psd_jax.parallel.sharding import bytes_per_device

    cfg = llada2_mini_config()
    mesh = AbstractMesh((1, 8, 1), ("data", "expert", "model"))
    specs = {name: spec_for(logical_axes(cfg, name), shape, mesh) for name, shape in param_shapes(cfg).items()}
    assert specs["moe_expert_gate"] == PartitionSpec(None, "expert", None, "model")
    assert specs["moe_expert_down"] == PartitionSpec(None, "expert", "model", None)
    assert all(a is None for a in specs["moe_router"]) and all(a is None for a in specs["moe_expert_bias"])
    assert specs["moe_wqkv"] == PartitionSpec(None, None, "model") and specs["lm_head"] == PartitionSpec(None, "model")
    sizes = {name: math.prod(shape) for name, shape in param_shapes(cfg).items()}
    experts = sum(sizes[f"moe_expert_{p}"] for p in ("gate", "up", "down"))
    assert bytes_per_device(cfg, mesh) == 2 * (sum(sizes.values()) - experts + experts // 8)


def test_logical_axes_map_to_mesh_axes():
    mesh = make_mesh("data=1,model=1")
    assert spec_for(("layers", "embed", "heads"), (2, 64, 64), mesh) == jax.sharding.PartitionSpec(None, None, "model")
    from models import load_config

    cfg = load_config(GOLDENS / "dream-tiny")
    specs = {name: s.spec for name, s in param_shardings(cfg, mesh).items()}
    assert specs["embed"] == jax.sharding.PartitionSpec("model", None)
    assert specs["w_down"] == jax.sharding.PartitionSpec(None, "model", None)


def test_int8_on_a_mesh_decodes_as_on_one_device(sharded_run):
    """Quantized weights split with their float weights (scales as far as their shape allows):
    quantize-then-shard (the loaders) equals shard-then-quantize, and the tokens one device's."""
    int8 = sharded_run["int8"]
    for mesh in MESHES:
        assert int8[mesh]["arrays_equal"], mesh
        tensor_parallel = parse_mesh(mesh, 8).get("model", 1) > 1
        assert int8[mesh]["qvalue_split"] == tensor_parallel, mesh  # data-parallel meshes replicate weights
        assert int8[mesh]["tokens"] == int8["reference"], mesh


def test_int8_llada2_on_an_expert_mesh(sharded_run):
    """int8 LLaDA2.0 on MOE_INT8_MESH (expert=4,model=2): every quantized parameter (fused QKV, dense and shared
    MLPs, routed experts) is exactly the arrays of shard-then-quantize; the experts' integers split
    over expert and their hidden units over model, their scales with them (the down projection's
    per-channel scales whole over model); the routed experts run expert parallel on the int8 shards
    within float32 rounding of one device (|diff| <= 1e-5 + 2e-6 |out|, as the float expert meshes)."""
    assert MOE_INT8_MESH == "expert=4,model=2"
    run = sharded_run["moe_int8"]
    assert run["arrays_equal"] == dict.fromkeys(run["arrays_equal"], True)
    assert len(run["arrays_equal"]) == 13  # 5 dense-layer projections, 8 of the MoE layers
    # [layers, experts, in, out] per device: 8 experts over expert=4, F = 32 over model=2
    assert run["expert_shards"] == {
        "moe_expert_gate": {"qvalue": [2, 2, 64, 16], "scale": [2, 2, 1, 16]},
        "moe_expert_up": {"qvalue": [2, 2, 64, 16], "scale": [2, 2, 1, 16]},
        "moe_expert_down": {"qvalue": [2, 2, 16, 64], "scale": [2, 2, 1, 64]},
    }
    assert run["layer_max_abs"] > 1.0
    assert run["layer_max_excess"] <= 1e-5


def test_diffusion_gemma_on_an_expert_mesh_decodes_as_upstream(sharded_run):
    """DiffusionGemma's sampler on an expert mesh reproduces upstream's replayed decode (ids, per-row
    calls and passes); the experts really split over ``expert`` and the heads and vocabulary over
    ``model`` (its own draws on a data x model mesh: tests/parallel/test_multihost.py)."""
    run = sharded_run["diffusion_gemma"]
    c = golden_case(DG_CASE)
    want = c["output"][:, c["prompt"].shape[1] :].tolist()
    assert [ids for ids, _, _ in run[DG_REPLAY_MESH]["decoded"]] == want
    assert [passes for _, _, passes in run[DG_REPLAY_MESH]["decoded"]] == c["decoder_passes"].tolist()
    split = run[DG_REPLAY_MESH]["split_params"]
    assert split["layer2_expert_gate_up"] == str(jax.sharding.PartitionSpec("expert", None, "model"))
    assert split["embed"] == str(jax.sharding.PartitionSpec("model", None))
    assert {"layer0_wq", "layer0_wo", "layer2_wq", "sc_gate"} <= set(split)


def test_diffusion_gemma_canvas_session_on_a_mesh_decodes_as_on_one_device(sharded_run):
    """DiffusionGemma's canvas session on data=2,model=4 (one row whole on every device, then two
    split over ``data``; rows joined, the batch grown and shrunk) decodes every row's ids and calls
    as one device's ``generate`` of it alone. (The server on that mesh, across two processes, is
    tests/parallel/test_multihost.py's.)"""
    run = sharded_run["diffusion_gemma"]["serving"]
    reference = run["served_reference"]
    assert run["session"] == [[ids, nfe] for ids, nfe, _ in reference], DG_OWN_MESH
