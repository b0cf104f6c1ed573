"""Sharded decoding on 8 simulated CPU devices gives the same tokens as one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from psd_jax.sharding import MeshError, kv_cache_spec, make_mesh, param_shardings, parse_mesh, spec_for

from conftest import GOLDENS, HF_CONFIGS


@pytest.fixture(scope="module")
def sharded_run():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    script = Path(__file__).with_name("sharded_decode.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(GOLDENS / "llada-tiny")], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", ["data=1,model=8", "data=2,model=4", "data=8,model=1"])
@pytest.mark.parametrize("decoder", ["fixed", "threshold", "psd", "rps"])
def test_mesh_gives_single_device_tokens(sharded_run, mesh, decoder):
    assert sharded_run["meshes"][mesh][decoder] == sharded_run["reference"][decoder]


@pytest.mark.parametrize("mesh", ["data=1,model=8", "data=2,model=4", "data=8,model=1"])
@pytest.mark.parametrize("decoder", ["fixed+prefix", "threshold+dual", "psd+dual", "rps+dual"])
def test_mesh_with_kv_cache_gives_single_device_tokens(sharded_run, mesh, decoder):
    assert sharded_run["meshes"][mesh][decoder] == sharded_run["reference"][decoder]


def test_parameters_are_really_sharded(sharded_run):
    tensor_parallel = ["embed", "lm_head", "w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]
    assert sharded_run["meshes"]["data=1,model=8"]["split_params"] == tensor_parallel
    assert sharded_run["meshes"]["data=2,model=4"]["split_params"] == tensor_parallel
    assert sharded_run["meshes"]["data=8,model=1"]["split_params"] == []


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


def test_logical_axes_map_to_mesh_axes():
    mesh = make_mesh("data=1,model=1")
    assert spec_for(("layers", "embed", "heads"), (2, 64, 64), mesh) == jax.sharding.PartitionSpec(None, None, "model")
    from models import load_config

    cfg = load_config(GOLDENS / "dream-tiny")
    specs = {name: s.spec for name, s in param_shardings(cfg, mesh).items()}
    assert specs["embed"] == jax.sharding.PartitionSpec("model", None)
    assert specs["w_down"] == jax.sharding.PartitionSpec(None, "model", None)
