"""The shipped default model: real LLaDA layout, loads through the converter path, and is what
``python -m psd_jax.generate`` answers with when given no arguments. (Its accuracy is measured by
``python -m psd_jax.bench``, not asserted here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from convert.hf import check_key_set
from convert.keys import expected_keys
from models import load_config
from psd_jax import DecodeConfig, load_model
from psd_jax.api import decode_defaults
from psd_jax.generate import main as generate_main
from psd_jax.scoring import load_jsonl

DEFAULT = Path(__file__).resolve().parents[1] / "models" / "default"
MAX_CHECKPOINT_BYTES = 25 * 2**20  # the budget for a committed checkpoint


@pytest.fixture(scope="module")
def test_set() -> list[dict]:
    return load_jsonl(DEFAULT / "test.jsonl")


def test_checkpoint_is_llada_layout_and_small():
    cfg = load_config(DEFAULT)
    raw = json.loads((DEFAULT / "config.json").read_text())
    assert cfg.family == "llada" and raw["model_type"] == "llada"
    with safe_open(str(DEFAULT / "model.safetensors"), "np") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    check_key_set(cfg, shapes, str(DEFAULT))  # raises, naming any missing/extra/misshaped tensor
    assert set(shapes) == set(expected_keys(cfg))
    assert (DEFAULT / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES


def test_cli_without_arguments_answers_a_held_out_question(capsys, test_set):
    """No arguments: the shipped model, held-out question 0, chat template, the model's decode
    lengths at one token per step; the printed answer and counts are exactly that decode's."""
    assert generate_main([]) == 0
    out = capsys.readouterr().out.splitlines()
    question = test_set[0]["question"]
    (expected,) = load_model(DEFAULT).generate([question], DecodeConfig(gen_length=48, block_length=16), chat=True)
    assert decode_defaults(DEFAULT) == {"gen_length": 48, "block_length": 16}
    assert out[0] == f"> {question}"
    assert "\n".join(out[1:-1]) == expected.text and expected.tokens > 0
    assert out[-1].startswith(f"[tokens {expected.tokens} | NFE {expected.nfe} | TPF {expected.tpf:.2f} | ")


def test_decode_defaults_reject_unknown_keys(tmp_path):
    assert decode_defaults(tmp_path) == {}
    (tmp_path / "decode_defaults.json").write_text('{"gen_length": 48, "block_len": 16}')
    with pytest.raises(ValueError, match=r"unknown keys \['block_len'\]"):
        decode_defaults(tmp_path)
