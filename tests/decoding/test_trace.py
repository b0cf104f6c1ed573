"""The decode's trace (``generate(..., trace=True)``, ``core.trace``): recorded in the compiled loop,
it changes no token and no call (golden cases of each family and decoder decoded with it on), says
what each decoder did (one write per step of one token per step, PSD's accepted depths, RPS's
pivots, the editing decoder's rewrites), and adds nothing to a decode without it."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import DEFAULT_MODEL
from test_decoding_goldens import _rows
from test_llada2_decode import assert_upstream, prompts, settings_of
from test_llada21_editing import assert_pipeline, edit_cases  # noqa: F401  (a fixture)
from test_llada21_editing import field as edit_field
from test_llada21_editing import settings_of as edit_settings

from psd_jax import DecodeConfig, load_model
from psd_jax.core import policies
from psd_jax.core.engine import decode
from psd_jax.core.runtime import Program, RowValues


def assert_consistent(r, stop_ids=()) -> Counter:
    """What holds for every trace: one entry per generated position, steps within the row's calls,
    a kind exactly where a step is, the first token the output unless rewritten later; returns the
    writes per step."""
    t = r.trace
    n = len(r.output_ids)
    assert [len(t[k]) for k in ("step", "kind", "first", "rewritten")] == [n] * 4
    assert all(0 <= s <= r.nfe for s in t["step"]) and all(0 <= s <= r.nfe for s in t["rewritten"])
    assert all((s == 0) == (k == "none") for s, k in zip(t["step"], t["kind"]))
    for i, (s, first, again) in enumerate(zip(t["step"], t["first"], t["rewritten"])):
        if s and not again and r.output_ids[i] not in stop_ids:
            assert first == r.output_ids[i], i
        assert not again or again > s, i
    return Counter(s for s in t["step"] if s)


def test_llada_and_dream_goldens_with_the_trace_on(lms, cases):
    """LLaDA's ``generate`` (4 tokens per step, a padded batch), Fast-dLLM's threshold rule and Dream's
    schedule: upstream's tokens and calls, and the trace of a fixed schedule writes its count at
    every step."""
    pre = "llada-tiny.generate_s12."
    settings = DecodeConfig(gen_length=48, block_length=16, steps=12)
    out = lms["llada-tiny"].generate(
        _rows(cases[pre + "prompt"], cases[pre + "attention_mask"]), settings, prompt_bucket=None, trace=True
    )
    np.testing.assert_array_equal([r.output_ids for r in out], cases[pre + "output"][:, 20:])
    for r in out:
        assert r.nfe == 12 and assert_consistent(r) == dict.fromkeys(range(1, 13), 4)
        assert set(r.trace["kind"]) == {"policy"}

    pre = "llada-tiny.threshold_0.7_row0."
    settings = DecodeConfig(gen_length=48, block_length=16, policy="threshold", threshold=0.7)
    (r,) = lms["llada-tiny"].generate(_rows(cases[pre + "prompt"], None), settings, prompt_bucket=None, trace=True)
    np.testing.assert_array_equal(r.output_ids, cases[pre + "output"][0, 20:])
    assert r.nfe == int(cases[pre + "nfe"])
    # every call of the threshold rule commits at least one position (all 48 are written)
    assert set(assert_consistent(r)) == set(range(1, r.nfe + 1)) and min(r.trace["step"]) >= 1

    pre = "dream-tiny.generate_maskgit_plus_s8."
    settings = DecodeConfig(gen_length=32, block_length=32, steps=8, policy="dream", confidence="prob")
    prompts_ = _rows(cases[pre + "prompt"], cases[pre + "attention_mask"])
    out = lms["dream-tiny"].generate(prompts_, settings, prompt_bucket=None, trace=True)
    np.testing.assert_array_equal([r.output_ids for r in out], cases[pre + "output"][:, 20:])
    counts = policies.step_counts(Program.of(settings))  # Dream's schedule: 3, 4, ..., 4, 5
    for r in out:
        assert r.nfe == 8 and assert_consistent(r) == {step + 1: int(c) for step, c in enumerate(counts)}


def test_block_causal_golden_with_the_cache_and_the_trace_on(llada2_lm, llada2_cases):
    """LLaDA2.0's block diffusion with the block cache, rows of three prompt lengths: upstream's tokens
    and calls; the trace is laid out as the output (each row's own blocks), so every position before
    a row's first EOS was written, with the token it holds."""
    setting = "g48b16s16t1"
    dcfg = settings_of(llada2_cases, setting, cache="prefix")
    out = llada2_lm.generate(prompts(llada2_cases, setting), dcfg, prompt_bucket=32, trace=True)
    eos = llada2_lm.config.eos_id
    assert_upstream(llada2_cases, setting, [r.output_ids for r in out], [r.nfe for r in out], eos)
    for r in out:
        assert_consistent(r, (eos,))
        end = r.output_ids.index(eos) if eos in r.output_ids else len(r.output_ids)
        assert all(s > 0 for s in r.trace["step"][:end])


def test_editing_golden_with_the_trace_on(llada2_lm, edit_cases):  # noqa: F811
    """LLaDA2.1's token editing (three prompts in one batch, each its batch-1 decode): the pipeline's
    tokens, calls and edits; the rewritten positions are among the edits counted."""
    names = [f"e05_p{p}" for p in range(3)]
    batch = [edit_field(edit_cases, name, "prompt")[0].tolist() for name in names]
    out = llada2_lm.generate(batch, edit_settings(edit_cases, names[0]), trace=True)
    for name, r in zip(names, out):
        assert_pipeline(edit_cases, name, 0, r.output_ids, r.nfe, r.stats)
        assert_consistent(r, llada2_lm.config.stop_ids)
        again = [i for i, s in enumerate(r.trace["rewritten"]) if s]
        assert 0 < len(again) <= r.stats["edits"], name
        assert all(r.trace["kind"][i] == "edit" for i in again)


@pytest.fixture(scope="module")
def shipped():
    return load_model(DEFAULT_MODEL)


QUESTIONS = ["what is 3 plus 4", "how many is 12 minus 5"]


def test_psd_drafts_and_rps_pivots_are_the_decoders_own_counts(shipped):
    """PSD over one token per step: a level is one position, so the positions written as drafts of
    depth d are the steps that accepted depth d or deeper; RPS: one pivot position per committed pivot.
    PSD's tokens, calls and statistics are those of its decode without the trace."""
    psd = DecodeConfig(gen_length=32, block_length=16, decoder="psd", depth=3)
    rps = DecodeConfig(
        gen_length=32, block_length=16, policy="threshold", threshold=0.7, decoder="rps", k_max=4, pivot_tau=0.5
    )
    for settings in (psd, rps):
        traced = shipped.generate(QUESTIONS, settings, trace=True)
        if settings is psd:
            plain = shipped.generate(QUESTIONS, settings)
            assert [(r.output_ids, r.nfe, r.stats) for r in traced] == [(r.output_ids, r.nfe, r.stats) for r in plain]
        for r in traced:
            assert_consistent(r, shipped.config.stop_ids)
            kinds = Counter(r.trace["kind"])
            if settings is psd:
                hist = r.stats["accepted_depth"]
                for d in range(1, 4):
                    assert kinds[f"draft-{d}"] == sum(hist[d:]), (d, kinds, hist)
            else:
                assert kinds["pivot"] == r.stats["pivot_committed"]
        if settings is psd:
            assert sum(sum(r.stats["accepted_depth"][1:]) for r in traced) > 0
        else:
            assert sum(r.stats["pivot_committed"] for r in traced) > 0


def while_carry(hlo: str) -> int:
    """Operands of the decode loop's ``stablehlo.while``."""
    (line,) = [line for line in hlo.splitlines() if "stablehlo.while" in line][:1]
    return len(re.findall(r"%iterArg\w*", line))


def test_the_trace_is_opt_in_and_adds_only_its_four_arrays(shipped):
    """Off, the decode's state and output hold no trace (the loop is the one without it); on, its
    loop carries exactly the trace's four [B, N] arrays more."""
    settings = DecodeConfig(gen_length=32, block_length=16, cache="dual")
    ids, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
    values = RowValues.of([settings] * 2)
    lower = lambda program: decode.lower(  # noqa: E731
        shipped.graphdef, shipped.params, ids, mask, jax.random.key(0), values, mcfg=shipped.config, program=program
    )
    off, on = lower(Program.of(settings)), lower(Program.of(settings.replace(trace=True)))
    assert off.out_info.trace is None and [a.shape for a in jax.tree.leaves(on.out_info.trace)] == [(2, 8 + 32)] * 4
    assert while_carry(on.as_text()) == while_carry(off.as_text()) + 4
