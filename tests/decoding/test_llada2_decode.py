"""LLaDA2.0 block diffusion decoding against upstream ``LLaDA2MoeModelLM.generate``: the
``threshold_schedule`` policy on the block-causal canvas gives upstream's tokens and model calls,
uncached and with the exact block cache; PSD and RPS keep their guarantees on it; the CLI runs it.

Every golden case is decoded in a padded batch of its three prompts (lengths 10, 21 and 16), so each
test also checks that a row decodes in a batch exactly as alone (upstream ran batch 1). Compiles
dominate the time, so each compiled loop checks as much as it can: the uncached cases of
``g32b8s4t07`` are checked through RPS without an eligible pivot (which must be its base policy
exactly), those of ``g32b8s8t09eos`` through the CLI."""

from __future__ import annotations

import json

import pytest
from paths import GOLDENS

from psd_jax import DecodeConfig
from psd_jax.cli.flags import EXIT_BAD_INPUT
from psd_jax.cli.generate import main as generate_main
from psd_jax.core.block_layout import canvas_length

TINY = GOLDENS / "llada2-tiny"
SETTINGS = ("g32b8s8t095", "g32b8s4t07", "g48b16s16t1", "g32b8s8t09eos")
ROWS = range(3)


def case(cases: dict, setting: str, row: int, field: str):
    return cases[f"llada2-tiny.generate_{setting}_p{row}.{field}"]


def settings_of(cases: dict, setting: str, **changes) -> DecodeConfig:
    """The DecodeConfig of an upstream ``generate`` call (``steps`` is per block, as there)."""
    field = lambda name: case(cases, setting, 0, name)  # noqa: E731
    return DecodeConfig(
        gen_length=int(field("gen_length")),
        block_length=int(field("block_length")),
        steps=int(field("steps")),
        policy="threshold_schedule",
        threshold=float(field("threshold")),
        eos_early_stop=bool(field("eos_early_stop")),
        **changes,
    )


def prompts(cases: dict, setting: str) -> list[list[int]]:
    return [case(cases, setting, row, "prompt")[0].tolist() for row in ROWS]


def upstream(cases: dict, setting: str, row: int) -> tuple[list[int], int]:
    """(generated ids, upstream cut after the first EOS, and the model calls) of one case."""
    prompt, output = case(cases, setting, row, "prompt"), case(cases, setting, row, "output")
    return output[0, prompt.shape[1] :].tolist(), int(case(cases, setting, row, "nfe"))


def assert_upstream(cases: dict, setting: str, output_ids: list[list[int]], nfe: list[int], eos: int) -> None:
    """Each row's ids equal upstream's up to its cut (the rest EOS), with upstream's model calls."""
    for row in ROWS:
        want, want_nfe = upstream(cases, setting, row)
        got = output_ids[row]
        assert got[: len(want)] == want, (setting, row)
        assert all(t == eos for t in got[len(want) :]), (setting, row)
        assert nfe[row] == want_nfe, (setting, row)


def generate(lm, cases: dict, setting: str, bucket: int | None = None, **changes):
    results = lm.generate(prompts(cases, setting), settings_of(cases, setting, **changes), prompt_bucket=bucket)
    return [r.output_ids for r in results], [r.nfe for r in results], results


@pytest.mark.parametrize("setting", ["g32b8s8t095", "g48b16s16t1"])
def test_golden_cases_uncached(llada2_lm, llada2_cases, setting):
    ids, nfe, _ = generate(llada2_lm, llada2_cases, setting)
    assert_upstream(llada2_cases, setting, ids, nfe, llada2_lm.config.eos_id)


@pytest.mark.parametrize("setting, cache", [("g48b16s16t1", "prefix"), ("g32b8s8t09eos", "dual")])
def test_golden_cases_cached(llada2_lm, llada2_cases, setting, cache):
    """The block cache is exact (finished blocks' keys/values never change under block-causal
    attention) and costs no extra call; ``dual`` is the same cache here. Prompts padded to 32: the
    rows' first decoded blocks are aligned by whole blocks of left padding. (The same cache, on the
    same checkpoint, is exact in every cached token-editing golden: test_llada21_editing.py.)"""
    ids, nfe, results = generate(llada2_lm, llada2_cases, setting, bucket=32, cache=cache)
    assert_upstream(llada2_cases, setting, ids, nfe, llada2_lm.config.eos_id)
    # The batch's calls by shape: its start (a full refresh), each block's first call a window over
    # the previous and the current block, the rest windows of the block; at least every row's calls.
    calls = {(c["kind"], c["candidates"], c["positions"]): c["count"] for c in results[0].calls}
    dcfg = settings_of(llada2_cases, setting, cache=cache)
    canvas, block = canvas_length(32, dcfg, block_causal=True), dcfg.block_length
    assert calls[("refresh", 1, canvas)] == 1 and calls[("block_refresh", 1, 2 * block)] > 0
    assert set(calls) == {("refresh", 1, canvas), ("block_refresh", 1, 2 * block), ("window", 1, block)}
    assert sum(calls.values()) >= max(nfe)


def test_cli_decodes_upstream_tokens_and_refuses_guidance(llada2_cases, capsys):
    """``python -m psd_jax.generate --policy threshold_schedule`` (token-id prompts: the tiny
    checkpoint has no tokenizer) on the early-stop setting; a setting the family cannot run is one
    line and exit status 2."""
    setting = SETTINGS[3]
    dcfg = settings_of(llada2_cases, setting)
    flags = ["--model", str(TINY), "--policy", "threshold_schedule", "--gen-length", str(dcfg.gen_length)]
    flags += ["--block-length", str(dcfg.block_length), "--steps", str(dcfg.steps), "--threshold", str(dcfg.threshold)]
    ids = [f"--prompt-ids={','.join(map(str, p))}" for p in prompts(llada2_cases, setting)]
    assert generate_main([*flags, "--eos-early-stop", *ids, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert_upstream(llada2_cases, setting, [r["output_ids"] for r in rows], [r["nfe"] for r in rows], 508)
    assert generate_main([*flags, "--cfg-scale", "1", *ids]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "classifier-free guidance" in err[0], err
    # The flat cache's refinements: this family's cache is exact, so they would change nothing.
    assert generate_main([*flags, "--cache", "dual", "--vicinity", "4", *ids]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refresh_every and vicinity are not used for the block-causal" in err[0], err


def test_strict_psd_gives_the_policy_tokens_with_no_more_calls(llada2_lm, llada2_cases):
    setting = "g32b8s8t095"
    ids, nfe, results = generate(llada2_lm, llada2_cases, setting, decoder="psd", depth=1, acceptance="strict")
    for row in ROWS:
        want, want_nfe = upstream(llada2_cases, setting, row)
        assert ids[row][: len(want)] == want and nfe[row] <= want_nfe
    assert sum(r.stats["accepted_depth"][1] for r in results) > 0  # some drafts were accepted


def test_rps_without_an_eligible_pivot_is_its_base_policy(llada2_lm, llada2_cases):
    """A pivot needs top-k_max mass >= pivot_tau: with one value and tau 1 none qualifies here, and
    RPS is then its base policy exactly: upstream's tokens and model calls."""
    setting = "g32b8s4t07"
    ids, nfe, results = generate(llada2_lm, llada2_cases, setting, decoder="rps", k_max=1, pivot_tau=1.0)
    assert all(r.stats["pivot_found"] == 0 for r in results)
    assert_upstream(llada2_cases, setting, ids, nfe, llada2_lm.config.eos_id)
