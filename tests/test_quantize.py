"""Weight-only int8/int4 quantization (models.quantize, through qwix).

- A quantized model's logits equal those of the float model whose projection weights are replaced
  by their dequantized values (the quantized matmul computes exactly that product), in both layer
  layouts.
- int8 stays near float32 on every golden family (the goldens' 2 x 300 forward inputs): max
  |logit error| within INT8_REL_TOL of the largest |logit| and top-1 agreeing on at least
  INT8_TOP1 of the positions (measured: 0.045 / 0.967 llada-tiny, 0.041 / 0.963 llada-tiny-gqa,
  0.032 / 0.965 dream-tiny; random tiny weights are the hard case for rounding).
- Strict PSD over an int8 model is lossless against the same int8 model's base decode.
- Bad values are one clear error in the API, the CLIs and the harness's model arguments.
"""

from __future__ import annotations

import numpy as np
import pytest
import qwix

from models.quantize import PROJECTIONS, quantize_weight
from psd_jax import DecodeConfig, load_model
from psd_jax.evaluate.args import EvalArgsError, parse_eval_args
from psd_jax.generate import main as generate_main

from conftest import GOLDENS

FAMILIES = ("llada-tiny", "llada-tiny-gqa", "dream-tiny")
INT8_REL_TOL = 0.06
INT8_TOP1 = 0.95


def dequantized_copy(name: str, quantize: str, unroll: bool):
    """The float model with each projection weight replaced by dequantize(quantize(w))."""
    lm = load_model(GOLDENS / name, unroll_layers=unroll)
    model = lm.model
    for pname in PROJECTIONS:
        stacked = model.layer_weights()[pname]
        value = qwix.dequantize(quantize_weight(stacked, quantize, 1))
        model.set_param(pname, value)
    from flax import nnx

    lm.graphdef, lm.params = nnx.split(model)
    return lm


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "stacked"])
def test_quantized_logits_equal_the_dequantized_weights_product(cases, quantize, unroll):
    ids = cases["llada-tiny.forward.input_ids"][:, :64]
    quantized = load_model(GOLDENS / "llada-tiny", unroll_layers=unroll, quantize=quantize)
    reference = dequantized_copy("llada-tiny", quantize, unroll)
    got, want = np.asarray(quantized.logits(ids)), np.asarray(reference.logits(ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    w = quantized.model.layers[0]["wq"].get_value() if unroll else quantized.model.wq.get_value()
    assert isinstance(w, qwix.QArray) and np.dtype(w.qtype).name == quantize


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_logits_stay_near_float32(cases, name):
    ids = cases[f"{name}.forward.input_ids"]
    want = cases[f"{name}.forward.logits"]
    got = np.asarray(load_model(GOLDENS / name, quantize="int8").logits(ids))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err <= INT8_REL_TOL, err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= INT8_TOP1


def test_a_converted_checkpoint_quantizes_on_restore_as_the_hf_directory_does(tmp_path, cases):
    from convert.__main__ import main as convert_main

    out = tmp_path / "llada-tiny-orbax"
    assert convert_main(["--hf-dir", str(GOLDENS / "llada-tiny"), "--out", str(out), "--dtype", "float32"]) == 0
    ids = cases["llada-tiny.forward.input_ids"][:, :64]
    from_hf = load_model(GOLDENS / "llada-tiny", quantize="int8", unroll_layers=False)
    from_orbax = load_model(out, quantize="int8", unroll_layers=False)
    for name in PROJECTIONS:
        a, b = getattr(from_hf.model, name).get_value(), getattr(from_orbax.model, name).get_value()
        np.testing.assert_array_equal(np.asarray(a.qvalue), np.asarray(b.qvalue))
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    np.testing.assert_array_equal(np.asarray(from_hf.logits(ids)), np.asarray(from_orbax.logits(ids)))


def test_strict_psd_on_int8_is_lossless_against_its_int8_base(cases):
    lm = load_model(GOLDENS / "llada-tiny", quantize="int8")
    prompts = [cases[f"llada-tiny.threshold_0.9_row{r}.prompt"][0].tolist() for r in range(2)]
    base = DecodeConfig(gen_length=48, block_length=16, policy="threshold", threshold=0.9)
    plain = lm.generate(prompts, base)
    strict = lm.generate(prompts, base.replace(decoder="psd", depth=3, acceptance="strict"))
    assert [g.output_ids for g in strict] == [g.output_ids for g in plain]
    assert all(s.nfe <= p.nfe for s, p in zip(strict, plain))
    assert sum(p.nfe - s.nfe for s, p in zip(strict, plain)) > 0


def test_bad_quantize_values_are_one_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown quantize 'int3'; choose one of int8, int4"):
        load_model(GOLDENS / "llada-tiny", quantize="int3")
    with pytest.raises(ValueError, match="quantize='int4' with a mesh is not supported yet"):
        load_model(GOLDENS / "llada-tiny", quantize="int4", mesh="data=1")
    with pytest.raises(ValueError, match="not supported for the llada2_moe family yet"):
        load_model(GOLDENS / "llada2-tiny", quantize="int8")
    with pytest.raises(EvalArgsError, match="quantize must be one of int8, int4 or none, got 'int3'"):
        parse_eval_args({"pretrained": str(GOLDENS / "llada-tiny"), "quantize": "int3"})
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--model", str(GOLDENS / "llada-tiny"), "--quantize", "int3", "--prompt-ids", "5,6"])
    assert exit_info.value.code == 2
    assert "--quantize: invalid choice: 'int3'" in capsys.readouterr().err
    args = ["--model", str(GOLDENS / "llada-tiny"), "--quantize", "int4", "--mesh", "data=1", "--prompt-ids", "5,6"]
    assert generate_main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: quantize='int4' with a mesh is not supported yet (int8 is): load int4 on one device"
    ]
