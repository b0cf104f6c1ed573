"""Properties of compiled programs, checked under XLA's default flags (the suite compiles with
``conftest.FAST_COMPILE_FLAGS``, which users never run): run as a subprocess on 8 simulated CPU
devices by tests/decoding/test_hlo_properties.py, printing one JSON object.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/helpers/hlo_properties.py LLADA_DIR LLADA2_DIR
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from models import DiffusionLM, load_config
from models.transformer import matmul
from psd_jax import load_model
from psd_jax.parallel.sharding import batch_sharding

from sharded_decode import MOE_IDS, MOE_MESHES, expert_weight_collectives

UPCAST = r"= f32\[(8,64|64,32)\]\S* convert\("


def matmul_upcasts() -> dict:
    """Whether a bfloat16 product converts its operands to float32, plainly and through ``matmul``."""
    x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
    plain = jax.jit(lambda x, w: x @ w).lower(x, w).compile().as_text()
    ours = jax.jit(matmul).lower(x, w).compile().as_text()
    return {
        "plain_upcasts": bool(re.search(UPCAST, plain)),
        "matmul_upcasts": bool(re.search(UPCAST, ours)),
        "matmul_is_a_bf16_dot": bool(re.search(r"bf16\[8,64\]\S* parameter", ours)) and " dot(" in ours,
    }


def rope_evaluations(llada_dir: str) -> dict:
    """sin/cos ops in one compiled forward of the unrolled tiny LLaDA."""
    graphdef, params = nnx.split(DiffusionLM(load_config(llada_dir), unroll_layers=True))
    ids = jnp.zeros((2, 12), jnp.int32)
    hlo = jax.jit(lambda p, ids: nnx.merge(graphdef, p)(ids)).lower(params, ids).compile().as_text()
    return {"sine": len(re.findall(r" sine\(", hlo)), "cosine": len(re.findall(r" cosine\(", hlo))}


def expert_collectives(llada2_dir: str) -> dict:
    """Collectives shaped like expert weights in the compiled forward, per expert mesh."""
    ids = jnp.asarray(MOE_IDS, jnp.int32)
    out = {}
    for mesh in MOE_MESHES:
        lm = load_model(llada2_dir, mesh=mesh)
        cfg = lm.config
        with jax.set_mesh(lm.mesh):  # as generate compiles: routed experts run expert-parallel
            rows = batch_sharding(lm.mesh, len(MOE_IDS))
            hlo = lm._forward.lower(lm.params, jax.device_put(ids, rows), None).compile().as_text()
        hidden = {cfg.moe_hidden, cfg.moe_hidden // lm.mesh.shape.get("model", 1)}
        out[mesh] = expert_weight_collectives(hlo, cfg.d_model, hidden)
    return out


def main(llada_dir: str, llada2_dir: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    result = {
        "matmul": matmul_upcasts(),
        "rope": rope_evaluations(llada_dir),
        "expert_collectives": expert_collectives(llada2_dir),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
