"""``psd_jax.core.rules``, the one definition of each decoding rule, against plain-Python for-loops.

Each rule runs on small random inputs in both array namespaces the backends pass (``jax.numpy``
for the engine, ``array_api_compat.torch`` for the PyTorch backend) and must give exactly what a
for-loop over rows and positions, written from docs/algorithms.md's wording, gives: so the rules
say what the documentation says, and the two backends, which call nothing else, agree. Inputs
use confidences on a coarse grid (many ties, so the tie rules are exercised) and small blocks.
No model, no compile: the file runs in seconds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from psd_jax import DecodeConfig
from psd_jax.core import policies, rules
from psd_jax.core.decoders import psd, rps

SEEDS = range(4)
B, N = 5, 8  # rows, positions (one block of 8)


def _torch_namespace():
    pytest.importorskip("torch")
    import array_api_compat.torch

    return array_api_compat.torch


@pytest.fixture(params=["jax", "torch"])
def xp(request):
    return jnp if request.param == "jax" else _torch_namespace()


def host(a) -> np.ndarray:
    return a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else np.asarray(a)


def to(xp, a: np.ndarray):
    """A numpy array in the namespace (float64 inputs as float32, as the decoders' confidences)."""
    a = np.asarray(a)
    return xp.asarray(a.astype(np.float32) if a.dtype == np.float64 else a)


def random_inputs(seed: int):
    """conf [B, N] on a grid of eighths (ties), valid [B, N] (some rows empty), step [B]."""
    rng = np.random.default_rng(seed)
    conf = rng.integers(0, 9, (B, N)) / 8.0
    valid = rng.random((B, N)) < 0.6
    valid[0] = False  # a row with nothing to commit
    valid[1] = True
    step = rng.integers(0, 5, B)
    return conf, valid, step


# -------------------------------------------------------------------------- for-loop definitions


def loop_order(conf_row, valid_row) -> list[int]:
    """The valid positions by confidence, highest first, ties to the lower position."""
    return sorted((i for i in range(len(conf_row)) if valid_row[i]), key=lambda i: (-conf_row[i], i))


def loop_commit(conf_row, valid_row, step: int, dcfg: DecodeConfig) -> set[int]:
    """docs/algorithms.md "Policies", for one row."""
    order = loop_order(conf_row, valid_row)
    r = len(order)
    counts = policies.step_counts(dcfg)
    if dcfg.policy in ("fixed", "dream", "threshold_schedule", "sequential"):
        last = len(counts) - 1
        k = r if step >= last else int(counts[step])
        if dcfg.policy == "sequential":  # the k leftmost, whatever the confidences
            return set(sorted(order)[:k])
        if dcfg.policy == "threshold_schedule":
            k = min(k, r)
            sure = {i for i in order if conf_row[i] > dcfg.threshold}
            return sure if len(sure) >= k else set(order[:k])
        return set(order[:k])
    if dcfg.policy == "threshold":
        return set(order[:1]) | {i for i in order if conf_row[i] >= dcfg.threshold}
    # factor: leading ranks passing c_(k) >= 1 - f / (k + 2) (rank 0 always), all r if L >= r - 1
    leading = 0
    for k, i in enumerate(order):
        bound = np.float32(1.0) - np.float32(dcfg.factor) / np.float32(k + 2.0)
        if k == 0 or np.float32(conf_row[i]) >= bound:
            leading += 1
        else:
            break
    return set(order if leading >= r - 1 else order[:leading])


def loop_draft_sizes(chosen_row, step: int, dcfg: DecodeConfig) -> list[int]:
    if dcfg.policy == "fixed":
        counts = policies.step_counts(dcfg)
        return [int(counts[step + j]) if step + j < len(counts) else 0 for j in range(1, dcfg.depth + 1)]
    rate = dcfg.draft_rate if dcfg.draft_rate is not None else max(1, int(sum(chosen_row)))
    return [rate] * dcfg.depth


def loop_psd(conf_row, token_row, s0_row, chosen_row, valid_row, step: int, dcfg: DecodeConfig):
    """docs/algorithms.md "PSD" 2: (candidates s_0..s_D, levels as position sets, needed)."""
    remaining = [bool(v and not c) for v, c in zip(valid_row, chosen_row)]
    order = loop_order(conf_row, remaining)
    candidates, levels, taken = [list(s0_row)], [], 0
    for size in loop_draft_sizes(chosen_row, step, dcfg):
        level = order[taken : taken + size]
        taken += size
        s = list(candidates[-1])
        for i in level:
            s[i] = token_row[i]
        candidates.append(s)
        levels.append(set(level))
    needed = 1
    for level in levels:
        if not level:
            break
        needed += 1
    return candidates, levels, needed


def loop_accepted(candidates, levels, valid_row, verified_token, verified_conf, live, step, dcfg, mask_id) -> int:
    """docs/algorithms.md "PSD" 4: the leading consistent levels (0 for a row that is not live)."""
    if not live:
        return 0
    accepted = 0
    for j, level in enumerate(levels, start=1):
        ok = bool(level) and all(verified_token[j - 1][i] == candidates[j][i] for i in level)
        if ok and dcfg.acceptance == "strict":
            still_masked = [bool(v and candidates[j - 1][i] == mask_id) for i, v in enumerate(valid_row)]
            ok = loop_commit(verified_conf[j - 1], still_masked, step + j, dcfg) == level
        if not ok:
            break
        accepted += 1
    return accepted


# ---------------------------------------------------------------------------------- policies


@pytest.mark.parametrize("seed", SEEDS)
def test_ranks_order_valid_positions_by_confidence(xp, seed):
    conf, valid, _ = random_inputs(seed)
    rank = host(rules.ranks(xp, to(xp, conf), to(xp, valid)))
    for row in range(B):
        order = loop_order(conf[row], valid[row])
        assert [int(rank[row, i]) for i in order] == list(range(len(order)))
        assert all(rank[row, i] >= len(order) for i in range(N) if not valid[row, i])


POLICIES = {
    "fixed": DecodeConfig(gen_length=8, block_length=8, steps=3, policy="fixed"),
    "fixed-1": DecodeConfig(gen_length=8, block_length=8, policy="fixed"),
    "dream": DecodeConfig(gen_length=8, block_length=8, steps=4, policy="dream"),
    "threshold": DecodeConfig(gen_length=8, block_length=8, policy="threshold", threshold=0.75),
    "factor": DecodeConfig(gen_length=8, block_length=8, policy="factor", factor=1.0),
    "factor-2": DecodeConfig(gen_length=8, block_length=8, policy="factor", factor=2.0),
    "threshold_schedule": DecodeConfig(
        gen_length=8, block_length=8, steps=3, policy="threshold_schedule", threshold=0.6
    ),
    "sequential": DecodeConfig(gen_length=8, block_length=8, steps=3, policy="sequential"),
}


def _counts(xp, dcfg):
    counts = policies.step_counts(dcfg)
    return None if counts is None else xp.asarray(counts)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_commit_mask_is_the_policy(xp, policy, seed):
    dcfg = POLICIES[policy]
    conf, valid, step = random_inputs(seed)
    chosen = host(policies.commit_mask(xp, to(xp, conf), to(xp, valid), to(xp, step), dcfg, _counts(xp, dcfg), dcfg))
    for row in range(B):
        assert set(np.flatnonzero(chosen[row]).tolist()) == loop_commit(conf[row], valid[row], int(step[row]), dcfg)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_step_commits_whatever_the_scores(xp, policy):
    """NaN and infinite confidences (a model or a setting gone wrong): a policy still commits only
    committable positions, and at least one per row that has any (the scheduled policies exactly
    their count), so a block ends within its step bound instead of looping."""
    dcfg = POLICIES[policy]
    rng = np.random.default_rng(7)
    conf = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.5], np.float32), (B, N))
    conf[2], conf[3] = np.nan, -np.inf  # rows of NaN only and of -inf only
    valid = rng.random((B, N)) < 0.5
    valid[0], valid[1:4, 5] = False, True
    step = np.array([0, 0, 1, 2, 9])
    chosen = host(policies.commit_mask(xp, to(xp, conf), to(xp, valid), to(xp, step), dcfg, _counts(xp, dcfg), dcfg))
    assert not (chosen & ~valid).any()
    counts, remaining = policies.step_counts(dcfg), valid.sum(-1)
    for row in range(1, B):
        if counts is None:
            assert chosen[row].sum() >= 1
        else:
            scheduled = remaining[row] if step[row] >= len(counts) - 1 else min(counts[step[row]], remaining[row])
            assert chosen[row].sum() >= scheduled if policy == "threshold_schedule" else chosen[row].sum() == scheduled


def test_every_policy_has_a_commit_rule():
    from psd_jax.core.config import POLICIES as ALL

    assert {dcfg.policy for dcfg in POLICIES.values()} == set(ALL)
    assert set(policies.POLICIES) == set(ALL)  # each a module of psd_jax.core.policies
    with pytest.raises(ValueError, match="no commit rule for policy 'nearest'"):
        policies.step_counts(SimpleNamespace(policy="nearest"))


# --------------------------------------------------------------------------------------- PSD

PSD = {
    "threshold": DecodeConfig(gen_length=8, block_length=8, policy="threshold", threshold=0.75, decoder="psd", depth=3),
    "threshold-rate": DecodeConfig(
        gen_length=8, block_length=8, policy="threshold", threshold=0.75, decoder="psd", depth=2, draft_rate=2
    ),
    "fixed": DecodeConfig(gen_length=8, block_length=8, steps=4, policy="fixed", decoder="psd", depth=3),
    "fixed-strict": DecodeConfig(
        gen_length=8, block_length=8, steps=4, policy="fixed", decoder="psd", depth=2, acceptance="strict"
    ),
    "schedule-strict": DecodeConfig(
        gen_length=8,
        block_length=8,
        steps=4,
        policy="threshold_schedule",
        threshold=0.6,
        decoder="psd",
        depth=3,
        acceptance="strict",
    ),  # fmt: skip
    "factor-strict": DecodeConfig(
        gen_length=8, block_length=8, policy="factor", decoder="psd", depth=3, acceptance="strict"
    ),
}
MASK = 99


def _psd_case(seed: int, dcfg: DecodeConfig):
    conf, valid, step = random_inputs(seed)
    rng = np.random.default_rng(100 + seed)
    token = rng.integers(0, 5, (B, N))
    canvas = np.where(valid, MASK, rng.integers(0, 5, (B, N)))
    chosen = np.zeros((B, N), bool)
    for row in range(B):
        chosen[row, list(loop_commit(conf[row], valid[row], int(step[row]), dcfg))] = True
    s0 = np.where(chosen, token, canvas)
    return conf, valid, step, token, chosen, s0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("setting", list(PSD))
def test_psd_candidates_are_the_drafts(xp, setting, seed):
    dcfg = PSD[setting]
    conf, valid, step, token, chosen, s0 = _psd_case(seed, dcfg)
    got = psd.psd_candidates(
        xp, to(xp, conf), to(xp, token), to(xp, s0), to(xp, chosen), to(xp, valid), to(xp, step), dcfg,
        _counts(xp, dcfg),
    )  # fmt: skip
    candidates, levels, needed = map(host, got)
    for row in range(B):
        c, lv, nd = loop_psd(conf[row], token[row], s0[row], chosen[row], valid[row], int(step[row]), dcfg)
        assert candidates[row].tolist() == c
        assert [set(np.flatnonzero(level).tolist()) for level in levels[row]] == lv
        assert int(needed[row]) == nd


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("setting", list(PSD))
def test_psd_acceptance_keeps_the_leading_consistent_levels(xp, setting, seed):
    dcfg = PSD[setting]
    conf, valid, step, token, chosen, s0 = _psd_case(seed, dcfg)
    rng = np.random.default_rng(200 + seed)
    d = dcfg.depth
    cases = [loop_psd(conf[r], token[r], s0[r], chosen[r], valid[r], int(step[r]), dcfg) for r in range(B)]
    candidates = np.array([c for c, _, _ in cases])  # [B, D+1, N]
    levels = np.array([[[i in level for i in range(N)] for level in lv] for _, lv, _ in cases])
    # The verifier F(s_{j-1}) mostly reproduces the drafts of level j (so deep acceptance happens).
    agree = rng.random((B, d + 1, N)) < 0.9
    shifted = np.concatenate([candidates[:, 1:], candidates[:, -1:]], axis=1)
    verified_token = np.where(agree, shifted, rng.integers(0, 5, (B, d + 1, N)))
    verified_conf = rng.integers(0, 9, (B, d + 1, N)) / 8.0
    live = rng.random(B) < 0.8
    got = host(
        psd.psd_accepted(
            xp, to(xp, levels), to(xp, candidates), to(xp, valid), to(xp, verified_token), to(xp, verified_conf),
            to(xp, live), to(xp, step), dcfg, _counts(xp, dcfg), MASK, dcfg,
        )
    )  # fmt: skip
    expected = [
        loop_accepted(
            candidates[r], cases[r][1], valid[r], verified_token[r], verified_conf[r], live[r], int(step[r]), dcfg, MASK
        )
        for r in range(B)
    ]
    assert got.tolist() == expected


# --------------------------------------------------------------------------------------- RPS

RPS = DecodeConfig(gen_length=8, block_length=8, policy="threshold", decoder="rps", k_max=3, ratio=0.3, pivot_tau=0.6)


def _rps_case(seed: int):
    conf, valid, step = random_inputs(seed)
    rng = np.random.default_rng(300 + seed)
    k = RPS.k_max
    raw = rng.random((B, N, k + 1)) ** 3
    probs = -np.sort(-(raw / raw.sum(-1, keepdims=True)), axis=-1)[..., :k]  # top-k, descending
    ids = rng.integers(0, 50, (B, N, k))
    chosen = np.zeros((B, N), bool)
    for row in range(B):
        chosen[row, list(loop_commit(conf[row], valid[row], 0, RPS))] = True
    s0 = np.where(chosen, 7, MASK)
    return valid, chosen, s0, probs.astype(np.float32), ids


@pytest.mark.parametrize("seed", SEEDS)
def test_rps_pivot_and_branches(xp, seed):
    valid, chosen, s0, probs, ids = _rps_case(seed)
    candidates, needed, state = rps.rps_candidates(
        xp, to(xp, probs), to(xp, ids), to(xp, s0), to(xp, chosen), to(xp, valid), RPS, RPS
    )
    candidates, needed = host(candidates), host(needed)
    for row in range(B):
        remaining = [i for i in range(N) if valid[row, i] and not chosen[row, i]]
        eligible = [i for i in remaining if float(probs[row, i].sum()) >= RPS.pivot_tau]
        entropy = {i: -sum(float(p) * math.log(max(float(p), rps.LOG_FLOOR)) for p in probs[row, i]) for i in eligible}
        assert bool(host(state["searched"])[row]) == bool(remaining)
        assert bool(host(state["found"])[row]) == bool(eligible)
        if not eligible:
            assert int(needed[row]) == 1
            continue
        pivot = max(eligible, key=lambda i: (entropy[i], -i))  # highest entropy, ties to the lower position
        top = probs[row, pivot]
        ok = [float(p) >= RPS.ratio * float(top[0]) for p in top]
        assert int(host(state["pivot"])[row]) == pivot
        assert host(state["branch_ok"])[row].tolist() == ok
        np.testing.assert_allclose(host(state["log_p"])[row], np.log(np.maximum(top, rps.LOG_FLOOR)), rtol=1e-6)
        assert set(np.flatnonzero(host(state["others"])[row]).tolist()) == set(remaining) - {pivot}
        assert int(needed[row]) == 1 + sum(ok)  # the valid branches are a prefix
        assert candidates[row, 0].tolist() == s0[row].tolist()
        for b in range(1, int(needed[row])):
            expected = s0[row].copy()
            expected[pivot] = ids[row, pivot, b - 1]
            assert candidates[row, b].tolist() == expected.tolist()


@pytest.mark.parametrize("seed", SEEDS)
def test_rps_winner_is_the_best_scoring_valid_branch(xp, seed):
    rng = np.random.default_rng(400 + seed)
    k = RPS.k_max
    others = rng.random((B, N)) < 0.5
    others[0] = False  # the pivot was the last masked position: the entropy term is 0
    entropy = (rng.integers(0, 16, (B, k + 1, N)) / 4.0).astype(np.float32)
    log_p = np.log(rng.random((B, k)) + 0.05).astype(np.float32)
    branch_ok = np.cumprod(rng.random((B, k)) < 0.8, axis=-1).astype(bool)
    live = rng.random(B) < 0.85
    lam = 0.3
    got = host(rps.rps_winner(xp, to(xp, others), to(xp, entropy), to(xp, log_p), to(xp, branch_ok), to(xp, live), lam))
    for row in range(B):
        if not live[row]:
            assert int(got[row]) == 0
            continue
        cells = [i for i in range(N) if others[row, i]]
        scores = []
        for c in range(k + 1):
            if c > 0 and not branch_ok[row, c - 1]:
                continue
            mean = sum(float(entropy[row, c, i]) for i in cells) / max(len(cells), 1)
            scores.append((-mean + lam * (0.0 if c == 0 else float(log_p[row, c - 1])), -c))
        assert int(got[row]) == -max(scores)[1]  # the best score, ties to the lower branch (MASK first)


# ------------------------------------------------------------------------------ loop geometry


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eos_early_stop", [True, False])
def test_advance_moves_completed_blocks_and_stops_at_eos(xp, seed, eos_early_stop):
    mcfg = SimpleNamespace(mask_id=9, eos_id=8, stop_ids=(8, 7))
    dcfg = DecodeConfig(gen_length=12, block_length=4, eos_early_stop=eos_early_stop)
    prompt, n = 3, 15
    rng = np.random.default_rng(500 + seed)
    block = rng.integers(0, 3, B)
    canvas = rng.integers(0, 7, (B, n))
    canvas[rng.random((B, n)) < 0.08] = 8
    canvas[rng.random((B, n)) < 0.06] = 7
    for row in range(B):  # some rows keep masks in their block, and later blocks are masked
        start = prompt + 4 * block[row]
        canvas[row, start + 4 :] = 9
        if rng.random() < 0.4:
            canvas[row, start + rng.integers(0, 4)] = 9
    step = rng.integers(1, 4, B)
    done = rng.random(B) < 0.2
    got = rules.advance(xp, to(xp, canvas), to(xp, block), to(xp, step), to(xp, done), prompt, mcfg, dcfg, dcfg)
    got = [host(a) for a in got]
    for row in range(B):
        c, b, s, d = canvas[row].copy(), int(block[row]), int(step[row]), bool(done[row])
        start, end = prompt + 4 * b, prompt + 4 * b + 4
        complete = not d and all(c[i] != 9 for i in range(start, end))
        eos_stop = complete and eos_early_stop and any(c[i] in (8, 7) for i in range(start, end))
        if eos_stop:
            c[end:] = 8
        new_done = d or eos_stop or (complete and b + 1 >= dcfg.num_blocks)
        expected = (c.tolist(), b + int(complete and not new_done), 0 if complete else s, new_done)
        assert (got[0][row].tolist(), int(got[1][row]), int(got[2][row]), bool(got[3][row])) == expected


@pytest.mark.parametrize("seed", SEEDS)
def test_cache_rows_move_through_blocks_together(xp, seed):
    """docs/algorithms.md "Block KV cache": a stale row waits until every live row is stale, then
    all are refreshed at once; after the iteration a waiting row is not done, and a row that moved
    to a new block (or waits) is stale."""
    rng = np.random.default_rng(600 + seed)
    done = rng.random(B) < 0.3
    stale = rng.random(B) < 0.5
    if seed % 2:
        stale |= ~done  # every live row at a block start: synced
    waiting, refresh = (host(a) for a in rules.cache_phase(xp, to(xp, stale), to(xp, done)))
    synced = all(stale[r] or done[r] for r in range(B))
    assert waiting.tolist() == [bool(stale[r] and not done[r] and not synced) for r in range(B)]
    assert refresh.tolist() == [bool(stale[r] and not done[r] and synced) for r in range(B)]
    before, after = rng.integers(0, 3, B), rng.integers(0, 3, B)
    done_after = rng.random(B) < 0.5
    got = rules.cache_stale(xp, to(xp, waiting), to(xp, done_after), to(xp, before), to(xp, after))
    expected_done = [bool(done_after[r] and not waiting[r]) for r in range(B)]
    expected_stale = [bool(waiting[r] or (after[r] != before[r] and not expected_done[r])) for r in range(B)]
    assert [host(a).tolist() for a in got] == [expected_done, expected_stale]


@pytest.mark.parametrize("every", [0, 1, 3])
def test_a_refresh_falls_due_after_its_window_calls(xp, every):
    """docs/algorithms.md "Block KV cache": within its block, a live row is refreshed once it has
    made ``refresh_every`` window calls since its last full forward (0: never); stale and finished
    rows are left to the block-start refresh."""
    rng = np.random.default_rng(700 + every)
    since, stale, done = rng.integers(0, 5, B), rng.random(B) < 0.3, rng.random(B) < 0.3
    got = host(rules.refresh_due(xp, to(xp, since), to(xp, stale), to(xp, done), every))
    expected = [bool(every and since[r] >= every and not stale[r] and not done[r]) for r in range(B)]
    assert got.tolist() == expected
    assert every == 0 or any(expected), "the case should have a row due"


def test_static_sizes():
    """The static parts both backends read: forward sizes and their covering index, the logit
    window's width and start, and the cached calls' window lengths."""
    assert (
        rules.forward_sizes(1) == (1,) and rules.forward_sizes(4) == (1, 2, 4) and rules.forward_sizes(11) == (1, 6, 11)
    )
    assert [int(rules.covering_index(jnp, (1, 6, 11), jnp.asarray(m))) for m in (1, 2, 6, 7, 11)] == [0, 1, 1, 2, 2]
    none, dual = (
        DecodeConfig(gen_length=64, block_length=16),
        DecodeConfig(gen_length=64, block_length=16, cache="dual"),
    )
    assert rules.logit_width(none, 64) == 32 and rules.logit_width(dual, 64) == 16
    assert rules.logit_width(DecodeConfig(gen_length=32, block_length=16), 32) is None  # two blocks: all of them
    start, width = rules.logit_window(none, 10, 64, jnp.asarray([0, 2]))
    assert host(start).tolist() == [10, 42] and width == 32
    index = host(rules.logit_index(jnp, jnp.asarray([10, 58]), 32, 74, 1))  # the last block's window ends past N
    assert index[0].tolist() == list(range(9, 41)) and index[1].tolist() == list(range(57, 74)) + [73] * 15
    prefix = DecodeConfig(gen_length=128, block_length=16, cache="prefix")
    assert rules.window_lengths(prefix) == (16, 32, 64, 128)
    assert rules.window_lengths(DecodeConfig(gen_length=96, block_length=32, cache="prefix")) == (32, 64, 96)
    assert rules.window_lengths(dual) == (16,) and rules.window_lengths(prefix, block_causal=True) == (16,)
