"""The shipped default model: real LLaDA layout, loads through the converter path, and is what
``python -m psd_jax.generate`` answers with when given no arguments. (Its accuracy is measured by
``python -m psd_jax.bench``, not asserted here.)"""

from __future__ import annotations

import json

import pytest
from paths import DEFAULT_MODEL as DEFAULT
from safetensors import safe_open

from convert.hf import check_key_set
from convert.keys import expected_keys
from models import load_config
from psd_jax import DecodeConfig, load_model
from psd_jax.cli.generate import DEMO_PROBLEMS, EXPLAIN_STATS, describe
from psd_jax.cli.generate import main as generate_main
from psd_jax.model_dir import decode_defaults
from psd_jax.recommended import read_recommended
from psd_jax.scoring import extract_answer, gold_answer, load_jsonl

MAX_CHECKPOINT_BYTES = 25 * 2**20  # the budget for a committed checkpoint


@pytest.fixture(scope="module")
def test_set() -> list[dict]:
    return load_jsonl(DEFAULT / "test.jsonl")


def test_checkpoint_is_llada_layout_and_small():
    cfg = load_config(DEFAULT)
    raw = json.loads((DEFAULT / "config.json").read_text())
    assert cfg.family == "llada" and raw["model_type"] == "llada"
    with safe_open(str(DEFAULT / "model.safetensors"), "np") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    check_key_set(cfg, shapes, str(DEFAULT))  # raises, naming any missing/extra/misshaped tensor
    assert set(shapes) == set(expected_keys(cfg))
    assert (DEFAULT / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES


def test_cli_without_arguments_compares_the_recommended_decoder_with_one_token_per_step(capsys, test_set):
    """No arguments: the shipped model answers its first held-out questions with the recommended
    decoder and with one token per step (chat template, the model's decode lengths); the question
    shown, its answer, the reference and both rows of counts are exactly those decodes'."""
    assert generate_main([]) == 0
    out = capsys.readouterr().out.splitlines()
    examples = test_set[:DEMO_PROBLEMS]
    questions = [ex["question"] for ex in examples]
    lm = load_model(DEFAULT)
    assert decode_defaults(DEFAULT) == {"gen_length": 48, "block_length": 16}
    shipped = read_recommended(DEFAULT)
    assert shipped.tuned and shipped.device == "cpu"  # the tuned setting for this device, not the library's
    assert shipped.provenance["objective"] == "seconds"
    recommended = DecodeConfig(gen_length=48, **shipped.settings)
    baseline = DecodeConfig(gen_length=48, block_length=16)
    runs = [lm.generate(questions, s, chat=True) for s in (recommended, baseline)]
    right = [[extract_answer(r.text) == gold_answer(ex) for r, ex in zip(rs, examples)] for rs in runs]
    shown = right[0].index(True)
    assert out[0] == f"Question {shown + 1} of {DEMO_PROBLEMS}:  {questions[shown]}"
    answer_lines = runs[0][shown].text.strip().splitlines()
    assert (
        out[1] == "Answer:    " + answer_lines[0]
        and [o.strip() for o in out[2 : 1 + len(answer_lines)]] == answer_lines[1:]
    )
    assert out[1 + len(answer_lines)] == f"Reference: {gold_answer(examples[shown])}  ->  right"
    rows = [line for line in out if line.startswith((describe(recommended), "one token per step"))]
    assert len(rows) == 2
    for row, results, ok in zip(rows, runs, right):
        cells = row.split()
        nfe = sum(r.nfe for r in results)
        assert f"{sum(ok)}/{DEMO_PROBLEMS}" in cells
        assert f"{nfe / DEMO_PROBLEMS:.1f}" in cells and f"{sum(r.tokens for r in results) / nfe:.2f}" in cells
    assert sum(r.nfe for r in runs[0]) < sum(r.nfe for r in runs[1])  # the point: fewer model calls
    assert "\n".join(out[-len(EXPLAIN_STATS.splitlines()) :]) == EXPLAIN_STATS
    # tokens/s of each warm decode, and the recommended setting's over one token per step's
    speeds, speedups = [float(row.split()[-5]) for row in rows], [row.split()[-4] for row in rows]
    assert speedups[1] == "1.00x" and abs(float(speedups[0][:-1]) - speeds[0] / speeds[1]) < 0.02


def test_decode_defaults_reject_unknown_keys(tmp_path):
    assert decode_defaults(tmp_path) == {}
    (tmp_path / "decode_defaults.json").write_text('{"gen_length": 48, "block_len": 16}')
    with pytest.raises(ValueError, match=r"unknown keys \['block_len'\]"):
        decode_defaults(tmp_path)
