"""scripts/device_check.sh in its TINY mode (every step on a toy model on the CPU), and its report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from paths import HF_CONFIGS, ROOT

from models import param_shapes
from models.quantize import is_projection
from psd_jax import DecodeConfig
from scripts.device import check as dc
from scripts.device import report


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    env = {**os.environ, "TINY": "1", "OUT": str(out), "PY": sys.executable}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        ["bash", "scripts/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, json.loads((out / "device_check.json").read_text())


def rows_of(result: dict, step: str) -> dict:
    return {r["key"]: r for r in result["steps"][step]["rows"]}


def test_every_step_ran_and_finished(tiny_run):
    _, _, result = tiny_run
    assert result["tiny"] is True
    for step in dc.STEPS:
        assert result["status"][step]["exit"] == 0, step
        assert result["steps"][step]["finished"] is True, step


def test_smoke_test_torch_reads_the_jax_weights(tiny_run):
    _, _, result = tiny_run
    env = result["steps"]["env"]
    (smoke,) = env["rows"]
    assert smoke["backends"]["jax"]["tokens_per_second"] > 0
    assert env["torch_smoke"]["ok"] is True and env["torch_smoke"]["logits_max_rel_diff"] < 1e-5


def test_forward_rows_count_the_flops(tiny_run):
    _, _, result = tiny_run
    fwd = result["steps"]["forward"]["rows"]
    assert [tuple(r["shape"]) for r in fwd] == list(dc.TINY.forward_shapes)
    cfg = dc.model_config(dc.TINY)
    # 2 layers of q, k, v, o (128 x 128 each) and the SwiGLU MLP (3 x 128 x 320), then the 128 x 512 head.
    weights = 2 * (4 * 128 * 128 + 3 * 128 * 320) + 128 * 512
    for r in fwd:
        batch, length = r["shape"]
        assert r["flops"]["matmul_weights"] == weights
        assert r["flops"]["total"] == 2 * weights * batch * length + 4 * 2 * batch * length**2 * 128
        assert r["flops"] == dc.forward_flops(cfg, batch, length)
        assert r["seconds"] > 0 and r["tflops_per_second"] > 0 and len(r["seconds_all"]) == dc.TINY.forward_repeats
        assert r["mfu"] is None  # no peak for a CPU


def test_jax_decodes_every_row(tiny_run):
    _, _, result = tiny_run
    got = rows_of(result, "jax_decode")
    expected = [f"{d}/{c}/{b}" for b in dc.TINY.batches for c in dc.CACHES for d in dc.DECODERS]
    expected += [f"threshold/dual+v4/{b}" for b in dc.TINY.batches]  # the window a quarter block past
    assert sorted(got) == sorted(expected) and len(got) == len(dc.rows(dc.TINY)) == 9
    for key, row in got.items():
        jax_row = row["backends"]["jax"]
        assert jax_row["tokens_per_second"] > 0, key
        assert jax_row["compile_seconds"] > 0, key
        assert 1 <= jax_row["nfe_per_prompt"] <= dc.TINY.gen_length, key
        assert DecodeConfig(**row["settings"]).cache_name == row["cache"], key
    for cache in dc.CACHES:
        for batch in dc.TINY.batches:
            fixed = got[f"fixed/{cache}/{batch}"]["backends"]["jax"]
            assert fixed["nfe_per_prompt"] == dc.TINY.gen_length  # one token per step
            assert got[f"psd/{cache}/{batch}"]["settings"]["depth"] == 3


def test_torch_rows_match_jax(tiny_run):
    _, _, result = tiny_run
    decoded, torch_rows = rows_of(result, "jax_decode"), rows_of(result, "torch")
    assert sorted(torch_rows) == sorted(decoded)
    for key, row in torch_rows.items():
        jax_row, torch_row = row["backends"]["jax"], row["backends"]["torch"]
        # The same device-made weights in every step: JAX decodes the same tokens as in jax_decode.
        assert jax_row["digest"] == decoded[key]["backends"]["jax"]["digest"], key
        assert "error" not in torch_row, (key, torch_row.get("error"))
        # float32 greedy decoding: the PyTorch backend gives JAX's tokens and call counts exactly.
        assert torch_row["same_tokens_as_jax"] is True, key
        assert torch_row["nfe_per_prompt"] == jax_row["nfe_per_prompt"], key
        assert torch_row["tokens_per_second"] > 0 and torch_row["jax_over_this"] > 0, key
    compiled = result["steps"]["torch_compile"]["rows"]
    assert [r["key"] for r in compiled] == [r["key"] for r in dc.rows(dc.TINY)[: dc.TINY.compile_rows]]
    for row in compiled:
        assert row["backends"]["torch.compile"]["same_tokens_as_jax"] is True
        assert row["backends"]["torch.compile"]["tokens_per_second"] > 0


def test_int8_rows_decode_the_quantized_weights(tiny_run):
    """The int8 step: the same device-made weights as jax_decode (the float model decodes the same
    tokens there), the projections stored as int8 with a float32 scale per output column (the
    toy's exact bytes), and both models decode every selected row."""
    out, _, result = tiny_run
    cfg = dc.model_config(dc.TINY)
    shapes = param_shapes(cfg)
    projections = [shape for name, shape in shapes.items() if is_projection(name)]
    floats = 4 * sum(math.prod(shape) for shape in shapes.values())
    int8 = floats - 3 * sum(math.prod(shape) for shape in projections) + 4 * sum(L * n for L, _, n in projections)
    assert result["steps"]["int8"]["weight_bytes"] == {"float32": floats, "int8": int8}
    got, decoded = rows_of(result, "int8"), rows_of(result, "jax_decode")
    assert sorted(got) == sorted(dc.TINY.int8_rows)
    for key, row in got.items():
        assert row["backends"]["jax"]["digest"] == decoded[key]["backends"]["jax"]["digest"], key
        quantized = row["backends"]["jax int8"]
        assert quantized["tokens_per_second"] > 0 and quantized["jax_over_this"] > 0, key
        assert 1 <= quantized["nfe_per_prompt"] <= dc.TINY.gen_length, key
    md = (out / "device_check.md").read_text()
    assert f"Weights on the device: float32 {floats / 1e9:.3g} GB, int8 {int8 / 1e9:.3g} GB." in md
    assert md.count("\n| threshold | dual | 1 |") == 3  # JAX, JAX against PyTorch, int8 against float32


def test_markdown_has_the_targets(tiny_run):
    out, stdout, result = tiny_run
    md = (out / "device_check.md").read_text()
    assert md in stdout  # printed at the end
    assert "| forward [8, 64] >= 50% of the H200 bfloat16 dense peak (989 TFLOP/s) |" in md
    target = "JAX >= 1.5x PyTorch eager tokens/s, every decoder, batch 1, cache none and dual"
    assert f"| {target} (threshold also dual with its window) |" in md
    assert md.count("\n| fixed | none | 1 |") == 2  # the JAX table and the JAX-against-PyTorch table
    assert len(result["targets"]) == 2 and result["targets"][0]["met"] is None  # no peak on a CPU
    ratios = result["targets"][1]["ratios"]
    assert len(ratios) == len(dc.rows(dc.TINY)) and result["targets"][1]["met"] == all(
        r >= 1.5 for r in ratios.values()
    )


def test_report_of_a_run_cut_short(tmp_path):
    """A torch step killed at its limit after one row, and a forward step that never ran: the report
    keeps the row, says which rows are missing, and holds no target as met."""
    parts = tmp_path / "parts"
    parts.mkdir()
    first = dc.rows(dc.GPU)[0]
    row = {**first, "backends": {"jax": {"tokens_per_second": 300.0}, "torch": {"tokens_per_second": 100.0}}}
    row["backends"]["torch"].update(jax_over_this=3.0, same_tokens_as_jax=False)
    (parts / "torch.json").write_text(json.dumps({"step": "torch", "tiny": False, "rows": [row]}))
    report.record_status(tmp_path, "torch", 124, 130.0)
    report.main(["--out", str(tmp_path)])
    result = json.loads((tmp_path / "device_check.json").read_text())
    fwd_target, torch_target = result["targets"]
    assert fwd_target["met"] is None and fwd_target["measured"] == "not measured"
    assert torch_target["met"] is False and torch_target["ratios"] == {first["key"]: 3.0}
    assert torch_target["measured"].startswith("1 of 18 rows")
    md = (tmp_path / "device_check.md").read_text()
    assert "| torch | exit 124: ran out of its time limit | 130 | 1 |" in md
    assert "| forward | not run |" in md
    assert "| fixed | none | 1 | 300.0 | 100.0 | 3.00x | yes | no | not run |" in md
    assert "| threshold | none | 1 | not run |" in md


def test_llada_8b_shape_is_the_checkpoint_config():
    path = HF_CONFIGS / "LLaDA-8B-Instruct" / "config.json"
    if not path.is_file():
        pytest.skip("no ../shared/hf-configs")
    upstream = json.loads(path.read_text())
    assert {k: upstream[k] for k in dc.LLADA_8B} == dc.LLADA_8B
    cfg = dc.model_config(dc.GPU)
    assert round(cfg.param_count() / 1e9, 2) == 8.02
    fwd = dc.forward_flops(cfg, 8, 512)
    assert round(fwd["matmul_weights"] / 1e9, 2) == 7.5  # every matrix but the embedding table
