"""Continuous batching in the engine: rows written into a running batch (``BlockDecode.join``),
moved to another compiled size (``regroup``) and decoding their own runtime values and generation
lengths give exactly the tokens and model calls of a ``generate`` of their own (greedy), with and
without the block KV cache, for every decoder; a new runtime value compiles nothing."""

from __future__ import annotations

import pytest
from paths import GOLDENS  # noqa: F401  (the lms fixture reads the goldens)

from psd_jax import DecodeConfig
from psd_jax.core.runtime import Program

PROMPTS = [
    [474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492],
    [280, 242, 425, 15, 2, 138, 188],
    [17, 301, 99, 4, 250, 12, 64, 3, 77],
    [5, 6, 7, 8, 9, 10],
]
BUCKET = 16
BASE = dict(gen_length=32, block_length=16, policy="threshold", threshold=0.7)
DECODERS = {"plain": {}, "psd": {"decoder": "psd", "depth": 2}, "rps": {"decoder": "rps", "k_max": 3, "pivot_tau": 0.5}}
# Every decoder and every cache at least once (a Latin square over the three of each), and PSD on
# the dual cache, the recommended setting: a joined row is the same property in every cell, and
# each compiled cell costs seconds.
SETTINGS = {
    f"{decoder}-{cache}": DecodeConfig(**BASE, cache=cache, **DECODERS[decoder])
    for decoder, cache in (("plain", "none"), ("psd", "prefix"), ("rps", "dual"), ("psd", "dual"))
}


def drive(run, actions: dict[int, list[tuple]], max_calls: int = 60) -> dict[int, tuple]:
    """Advance ``run`` block by block; before call i, ``actions[i]`` run in order: ``("join", row,
    prompt, settings)`` writes a request into a done row, ``("regroup", index)`` moves the rows.
    Returns each request's (generated ids, model calls): the rows started with keyed -1, -2, ...,
    joined ones 0, 1, ... in order."""
    done_at: dict[int, tuple] = {}
    owner: dict[int, int | None] = {row: -1 - row for row in range(run.rows)}
    joined = 0
    for call in range(max_calls):
        for action in actions.get(call, []):
            if action[0] == "join":
                _, row, prompt, settings = action
                assert owner.get(row) is None, f"row {row} is busy"
                run.join([row], [prompt], [settings], [0])
                owner[row], joined = joined, joined + 1
            else:
                index = action[1]
                owner = {new: owner.get(old) for new, old in enumerate(index) if old >= 0}
                run.regroup(index)
        if run.done and call > max(actions, default=-1):
            break
        progress = run.advance()
        for row, who in list(owner.items()):
            if who is not None and progress.done[row]:
                done_at[who] = (progress.generated[row, : progress.gen_length[row]].tolist(), int(progress.nfe[row]))
                owner[row] = None
    return done_at


def alone(lm, prompt, settings):
    (result,) = lm.generate([prompt], settings, prompt_bucket=BUCKET)
    return result.output_ids, result.nfe


@pytest.mark.parametrize("name", list(SETTINGS))
def test_joined_rows_decode_as_alone(lms, name):
    """A batch of 4 starts with one row; two more join while it runs (one of them after the first
    has finished, into its row), each equal to its own generate."""
    lm, settings = lms["llada-tiny"], SETTINGS[name]
    run = lm.start_rows([PROMPTS[0]], [settings], [0], batch_size=4, prompt_bucket=BUCKET)
    joins = {1: [("join", 1, PROMPTS[1], settings)], 2: [("join", 2, PROMPTS[2], settings)]}
    got = drive(run, {**joins, 4: [("join", 0, PROMPTS[3], settings)]})
    assert got[-1] == alone(lm, PROMPTS[0], settings)
    for order, prompt in enumerate(PROMPTS[1:]):
        assert got[order] == alone(lm, prompt, settings), (name, order)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_rows_with_different_runtime_values_and_lengths_share_a_program(lms, cache):
    """Thresholds, RPS's values and generation lengths differ per row; each row gets its own
    decode's tokens, and new values compile nothing."""
    lm = lms["dream-tiny"]
    rows = [
        DecodeConfig(**{**BASE, "threshold": 0.5}, cache=cache),
        DecodeConfig(**{**BASE, "threshold": 0.95, "gen_length": 16}, cache=cache),
        DecodeConfig(**{**BASE, "threshold": 0.8}, cache=cache),
    ]
    assert len({Program.of(s, 32) for s in rows}) == 1
    run = lm.start_rows(PROMPTS[:3], rows, [0, 0, 0], batch_size=4, prompt_bucket=BUCKET, gen_length=32)
    programs = lm.compiled_programs
    got = drive(run, {2: [("join", 3, PROMPTS[3], DecodeConfig(**{**BASE, "threshold": 0.6}, cache=cache))]})
    assert lm.compiled_programs == programs + 2  # the block call and the join, once each
    for r, settings in enumerate(rows):
        assert got[-1 - r] == alone(lm, PROMPTS[r], settings), r
    assert got[0] == alone(lm, PROMPTS[3], DecodeConfig(**{**BASE, "threshold": 0.6}, cache=cache))
    # generate compiled one program per generation length (32, 16), none per threshold
    assert lm.compiled_programs == programs + 4


def test_psd_rows_with_different_confidence_gates_share_a_program(lms):
    """PSD's ``accept_confidence`` is a runtime value: rows gated differently (and one joining with a
    new gate) share one program, and each row gets its own decode's tokens and model calls."""
    lm = lms["llada-tiny"]
    psd = SETTINGS["psd-dual"]
    gates = [0.3, 0.9, 0.6]
    rows = [psd.replace(accept_confidence=g) for g in gates]
    run = lm.start_rows(PROMPTS[:2], rows[:2], [0, 0], batch_size=3, prompt_bucket=BUCKET)
    programs = lm.compiled_programs
    got = drive(run, {1: [("join", 2, PROMPTS[2], rows[2])]})
    assert lm.compiled_programs == programs + 2  # the block call and the join, once each
    alone_runs = [alone(lm, PROMPTS[r], rows[r]) for r in range(3)]
    assert [got[-1], got[-2], got[0]] == alone_runs
    ungated = [alone(lm, PROMPTS[r], psd) for r in range(3)]
    assert [calls for _, calls in alone_runs] != [calls for _, calls in ungated]  # the gate refused drafts


def test_regrouping_keeps_every_row(lms):
    """A batch grows from 2 to 4 rows (its rows swapped), takes a third request, then shrinks to the
    rows still running; every request decodes as alone."""
    lm, settings = lms["llada-tiny"], SETTINGS["psd-dual"]
    run = lm.start_rows(PROMPTS[:2], [settings] * 2, [0, 0], batch_size=2, prompt_bucket=BUCKET)
    grow = [("regroup", [1, 0, -1, -1]), ("join", 3, PROMPTS[2], settings)]
    got = drive(run, {1: grow, 2: [("regroup", [3, 1])]})
    assert got[-1] == alone(lm, PROMPTS[0], settings)
    assert got[-2] == alone(lm, PROMPTS[1], settings)
    assert got[0] == alone(lm, PROMPTS[2], settings)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_a_seeded_sampled_row_draws_as_alone(lms, cache):
    """Sampling draws from the row's own key: a joined sampled row equals generate with its seed."""
    lm = lms["llada-tiny"]
    sampled = DecodeConfig(**BASE, temperature=1.0, cache=cache)
    run = lm.start_rows([PROMPTS[0]], [sampled], [3], batch_size=2, prompt_bucket=BUCKET)
    got = drive(run, {1: [("join", 1, PROMPTS[1], sampled)]})
    run2 = lm.start_rows([PROMPTS[1]], [sampled], [11], batch_size=1, prompt_bucket=BUCKET)
    got2 = drive(run2, {})
    (first,) = lm.generate([PROMPTS[0]], sampled, seed=3, prompt_bucket=BUCKET)
    (other,) = lm.generate([PROMPTS[1]], sampled, seed=11, prompt_bucket=BUCKET)
    (joined,) = lm.generate([PROMPTS[1]], sampled, seed=0, prompt_bucket=BUCKET)
    assert got[-1] == (first.output_ids, first.nfe)
    assert got2[-1] == (other.output_ids, other.nfe)
    assert got[0] == (joined.output_ids, joined.nfe)
    assert first.output_ids != lm.generate([PROMPTS[0]], sampled, seed=4, prompt_bucket=BUCKET)[0].output_ids


def test_block_causal_rows_join_as_alone(llada2_lm):
    """LLaDA2.0's block diffusion, uncached and with its exact block cache: a joined row (its prompt
    filled into the cache by its own first forward) decodes as alone."""
    lm = llada2_lm
    prompts = [p[: 5 + 3 * i] for i, p in enumerate(PROMPTS[:3])]
    for cache in ("none", "prefix"):
        settings = DecodeConfig(gen_length=16, block_length=8, policy="threshold_schedule", threshold=0.9, cache=cache)
        run = lm.start_rows([prompts[0]], [settings], [0], batch_size=2, prompt_bucket=BUCKET)
        got = drive(run, {1: [("join", 1, prompts[1], settings)], 4: [("join", 0, prompts[2], settings)]})
        assert got[-1] == alone(lm, prompts[0], settings), cache
        assert got[0] == alone(lm, prompts[1], settings), cache
        assert got[1] == alone(lm, prompts[2], settings), cache


def test_program_cache_is_bounded_least_recently_used_first(lms):
    lm = lms["llada-tiny"]
    before, lm.max_programs = dict(lm.placed.programs), 2
    try:
        lm.placed.programs.clear()
        a, b, c = (DecodeConfig(gen_length=16, block_length=16, steps=s) for s in (16, 8, 4))
        for settings in (a, b, a, c):  # a used again before c: b is the least recently used
            lm.generate([PROMPTS[0]], settings, prompt_bucket=BUCKET)
        assert lm.compiled_programs == 2
        assert lm.generate([PROMPTS[0]], a, prompt_bucket=BUCKET)[0].compile_seconds == 0.0
        assert lm.generate([PROMPTS[0]], b, prompt_bucket=BUCKET)[0].compile_seconds > 0.0
        assert lm.generate([PROMPTS[0]], a.replace(steps=16), prompt_bucket=BUCKET)[0].compile_seconds == 0.0
    finally:
        lm.max_programs = None
        lm.placed.programs.clear()
        lm.placed.programs.update(before)


def test_a_new_threshold_compiles_nothing(lms):
    lm = lms["llada-tiny"]
    settings = DecodeConfig(**BASE)
    lm.generate([PROMPTS[0]], settings, prompt_bucket=BUCKET)
    programs = lm.compiled_programs
    for threshold in (0.51, 0.9000001, 0.99):
        (row,) = lm.generate([PROMPTS[0]], settings.replace(threshold=threshold), prompt_bucket=BUCKET)
        assert row.compile_seconds == 0.0
    assert lm.compiled_programs == programs
    low, high = (lm.generate([PROMPTS[0]], settings.replace(threshold=t), prompt_bucket=BUCKET)[0] for t in (0.3, 0.99))
    assert low.nfe < high.nfe  # the value reaches the rule: more commits per call at a low threshold
