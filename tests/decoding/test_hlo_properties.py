"""Properties of the compiled programs users run: checked in a subprocess under XLA's default
flags (tests/helpers/hlo_properties.py), not the suite's fast-compile flags, on 8 simulated CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from paths import GOLDENS, HELPERS, ROOT

from conftest import FAST_COMPILE_FLAGS
from sharded_decode import MOE_MESHES

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU lowering and fusion properties")


def default_flags(extra: str) -> str:
    """The environment's XLA_FLAGS without the suite's fast-compile flags, plus ``extra``."""
    return " ".join([os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE_FLAGS, "").strip(), extra]).strip()


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, XLA_FLAGS=default_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    assert "xla_backend_optimization_level" not in env["XLA_FLAGS"]
    script = HELPERS / "hlo_properties.py"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HELPERS), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), str(GOLDENS / "llada-tiny"), str(GOLDENS / "llada2-tiny")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bfloat16_matmul_on_cpu_does_not_upcast_its_operands(compiled):
    """XLA:CPU rewrites a bfloat16-out dot as a float32 dot on converted operands (about 4x slower);
    ``models.transformer.matmul`` asks for a float32 result instead, which its bfloat16 GEMM serves
    directly."""
    assert compiled["matmul"]["plain_upcasts"], "the plain product no longer upcasts: drop the workaround"
    assert compiled["matmul"]["matmul_is_a_bf16_dot"] and not compiled["matmul"]["matmul_upcasts"]


def test_rope_tables_are_evaluated_once_per_forward(compiled):
    """sin/cos of the positions, computed once per forward: XLA otherwise fuses them into each
    layer's q and k RoPE and re-evaluates them per head."""
    assert compiled["rope"] == {"sine": 1, "cosine": 1}


@pytest.mark.parametrize("mesh", MOE_MESHES)
def test_no_collective_moves_expert_weights(compiled, mesh):
    """The compiled LLaDA2.0 forward on each expert mesh has no collective shaped like expert
    weights (models.moe.expert_parallel: each device runs its own experts)."""
    assert compiled["expert_collectives"][mesh] == []
