"""LLaDA2.1 token editing (``decoder="edit"``) against diffusers' ``LLaDA2Pipeline`` on
``llada2-tiny`` (goldens/README.md, "LLaDA2.1"): every batch-1 case token-, call-, edit- and
post-call-exact through ``python -m psd_jax.generate --json``, uncached and with the cache, and the
same rows exact inside mixed batches (the pipeline shares its counters across a batch; psd-jax keeps
every row its own). The ``raw2d_*`` cases pin the pipeline left to read its 2-D mask, which is not
the target, and are not decoded here.

Cases of one program (gen length, block, steps, minimal_topk, eos_early_stop) share a compiled
decode: thresholds, editing thresholds and the post-call cap are per-row values."""

from __future__ import annotations

import json

import numpy as np
import pytest
from paths import GOLDENS
from safetensors.numpy import load_file

from psd_jax import DecodeConfig, DecodeConfigError, load_model
from psd_jax.cli.generate import main as generate_main
from psd_jax.model_dir import default_model_path

TINY = GOLDENS / "llada2-tiny"
MASK, EOS = 511, 508
# (setting, flags besides the defaults' --block-length 8 --steps 8 --threshold 0.7 --gen-length 29)
SETTINGS = {
    "off": [],
    "speed": ["--threshold", "0.5"],
    "e05": ["--editing-threshold", "0.5"],
    "e09": ["--editing-threshold", "0.9"],
    "e07_t095": ["--editing-threshold", "0.7", "--threshold", "0.95"],
    "off_noeos": ["--no-eos-early-stop"],
    "e05_noeos": ["--editing-threshold", "0.5", "--no-eos-early-stop"],
    "e03_mp2": ["--editing-threshold", "0.3", "--max-post-steps", "2", "--no-eos-early-stop"],
    "e05_b4": ["--editing-threshold", "0.5", "--block-length", "4", "--steps", "4"],
    "e05_s4": ["--editing-threshold", "0.5", "--steps", "4"],
    "e05_tail": ["--editing-threshold", "0.5", "--gen-length", "30", "--no-eos-early-stop"],
}
BASE = ["--decoder", "edit", "--policy", "threshold_schedule", "--block-length", "8", "--steps", "8"]
BASE += ["--threshold", "0.7", "--gen-length", "29"]


@pytest.fixture(scope="module")
def edit_cases() -> dict:
    return load_file(str(GOLDENS / "llada21_editing_cases.safetensors"))


def field(cases: dict, case: str, name: str):
    return cases[f"llada2-tiny.{case}.{name}"]


def settings_of(cases: dict, case: str, **changes) -> DecodeConfig:
    """The pipeline call's settings as a ``DecodeConfig`` (its arguments' names are the fields')."""
    f = lambda name: field(cases, case, name)  # noqa: E731
    return DecodeConfig(
        decoder="edit",
        policy="threshold_schedule",
        gen_length=int(f("gen_length")),
        block_length=int(f("block_length")),
        steps=int(f("num_inference_steps")),
        threshold=float(f("threshold")),
        editing_threshold=float(f("editing_threshold")),
        max_post_steps=int(f("max_post_steps")),
        minimal_topk=int(f("minimal_topk")),
        eos_early_stop=bool(f("eos_early_stop")),
        **changes,
    )


def assert_pipeline(cases: dict, case: str, row: int, output_ids, nfe: int, stats: dict) -> None:
    """The pipeline's ``sequences`` row (a position it never wrote, left [MASK] after an EOS stop,
    may read EOS), its model calls, the edits it applied and its post-fill calls."""
    want = field(cases, case, "output")[row]
    got = np.asarray(output_ids)
    assert got.shape == want.shape, case
    assert np.all((got == want) | ((want == MASK) & (got == EOS))), (case, got.tolist(), want.tolist())
    if field(cases, case, "prompt").shape[0] == 1:  # the batch-1 cases' counts are the row's own
        assert nfe == int(field(cases, case, "nfe")), case
        assert stats["edits"] == int(field(cases, case, "num_edits")), case
        assert stats["post_calls"] == int(field(cases, case, "num_post_calls")), case


def prompt_flags(cases: dict, setting: str) -> list[str]:
    return [f"--prompt-ids={','.join(map(str, field(cases, f'{setting}_p{p}', 'prompt')[0]))}" for p in range(3)]


# Settings of their own program; the others are decoded with the cache in mixed batches below.
OWN_PROGRAMS = ("e05_b4", "e05_s4", "e05_tail")


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_every_case_through_the_cli(edit_cases, capsys, cache):
    """``python -m psd_jax.generate --decoder edit ... --json`` with the pipeline's argument names as
    flags; the three prompts (11, 19 and 27 tokens, finishing apart) decode as one batch, each row
    as the pipeline's batch-1 decode. The block cache is exact (earlier blocks are frozen): with it,
    the settings of a program of their own (the cached mixed batches below hold the rest)."""
    for setting, flags in SETTINGS.items():
        if cache != "none" and setting not in OWN_PROGRAMS:
            continue
        ids = prompt_flags(edit_cases, setting)
        assert generate_main(["--model", str(TINY), *BASE, *flags, "--cache", cache, *ids, "--json"]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(rows) == 3, setting
        for p, row in enumerate(rows):
            assert_pipeline(edit_cases, f"{setting}_p{p}", 0, row["output_ids"], row["nfe"], row["stats"])


@pytest.mark.parametrize(
    "group, cache",
    [(("off", "speed", "e05", "e09", "e07_t095"), "dual"), (("off_noeos", "e05_noeos", "e03_mp2"), "prefix")],
)
def test_rows_of_different_settings_in_one_batch(llada2_lm, edit_cases, group, cache):
    """Cases whose settings differ only in per-row values (fill and editing thresholds, the post-call
    cap) in one batch, decoded block by block as a server does: every row is its batch-1 decode,
    whatever its neighbours do (rows leave blocks, run post calls and stop at EOS apart)."""
    names = [f"{s}_p{p}" for s in group for p in range(3)]
    prompts = [field(edit_cases, n, "prompt")[0].tolist() for n in names]
    run = llada2_lm.start_rows(prompts, [settings_of(edit_cases, n, cache=cache) for n in names], [0] * len(names))
    while not run.advance().done.all():
        pass
    for name, result in zip(names, run.results()):
        assert_pipeline(edit_cases, name, 0, result.output_ids, result.nfe, result.stats)


def test_a_row_is_its_own_decode_where_the_pipeline_shares_counters(llada2_lm, edit_cases):
    """``batch2_e05``: the pipeline's row 1 differs from its batch-1 decode (its neighbour's masks
    keep it in the fill phase). Here row 0 is the pipeline's, and row 1 is the same decode beside
    other neighbours, not the pipeline's batch row. (Batches of three: the CLI test's program.)"""
    prompts = field(edit_cases, "batch2_e05", "prompt").tolist()
    settings = settings_of(edit_cases, "batch2_e05")
    assert field(edit_cases, "batch2_e05", "rows_equal_batch1").tolist() == [1, 0]
    others = [field(edit_cases, f"e05_p{p}", "prompt")[0].tolist() for p in range(3)]
    first = llada2_lm.generate([*prompts, others[0]], settings)
    second = llada2_lm.generate([others[2], others[1], prompts[1]], settings)
    assert_pipeline(edit_cases, "batch2_e05", 0, first[0].output_ids, first[0].nfe, first[0].stats)
    for result, case in ((first[2], "e05_p0"), (second[0], "e05_p2"), (second[1], "e05_p1")):
        assert_pipeline(edit_cases, case, 0, result.output_ids, result.nfe, result.stats)
    row, again = first[1], second[2]
    assert (row.output_ids, row.nfe, row.stats) == (again.output_ids, again.nfe, again.stats)
    assert row.output_ids != field(edit_cases, "batch2_e05", "output")[1].tolist()


def test_editing_off_fills_as_threshold_schedule_on_a_bidirectional_model():
    """On the shipped (bidirectional LLaDA) model the edit decoder runs on LLaDA's canvas: with
    editing off it writes the tokens of ``threshold_schedule`` alone, with one more call per block
    whose masks were filled before its last step (the pipeline's first post call); with editing on
    it rewrites tokens, and each block's post calls stay within the cap."""
    lm = load_model(default_model_path())
    prompts = ["Sam has 4 boxes of 6 pens. How many pens?", "What is 7 + 5?"]
    fill = dict(gen_length=64, block_length=32, steps=32, policy="threshold_schedule", threshold=0.8)
    fill["eos_early_stop"] = False  # every block decoded by both (their EOS rules differ)
    plain = lm.generate(prompts, DecodeConfig(**fill))
    off = lm.generate(prompts, DecodeConfig(**fill, decoder="edit"))
    on = lm.generate(prompts, DecodeConfig(**fill, decoder="edit", editing_threshold=0.5, max_post_steps=3))
    for p, e, o in zip(plain, off, on):
        assert e.output_ids == p.output_ids and e.stats["edits"] == 0
        assert e.nfe == p.nfe + e.stats["post_calls"] and 0 < e.stats["post_calls"] <= 2
        assert o.stats["post_calls"] <= 2 * 4  # two blocks, at most max_post_steps + 1 post calls each
    assert sum(o.stats["edits"] for o in on) > 0
    partial = DecodeConfig(**{**fill, "gen_length": 60}, decoder="edit")  # a last, partial block
    with pytest.raises(
        DecodeConfigError, match="partial block on block-causal models only, not the bidirectional llada"
    ):
        lm.generate(prompts, partial)
