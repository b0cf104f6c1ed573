"""RPS (Ripple-Pivot Search, algorithms.md "RPS") on the goldens' tiny LLaDA and Dream checkpoints.

What is shown, each on a case checked to really exercise it:
- the one batched lookahead call over the ``k_max + 1`` branches equals one call per branch, and
  the branch the decoder commits is the one with the best lookahead score;
- with no eligible pivot (``pivot_tau = 1``, ``k_max = 1``) RPS is exactly the base policy;
- replaying recorded trajectories against an independent softmax of the raw logits: when MASK
  wins nothing beyond the policy's commit changes; otherwise exactly one position, the pivot,
  does, it is an eligible masked position of the current block (the truncated-entropy argmax),
  and its token has ``p >= ratio * p_max`` under ``F(x)``;
- the statistics are consistent (committed <= found <= searched, winner ranks sum to committed).

Compiled work is shared through module-scoped fixtures (one compile per checkpoint, batch shape and
settings); the file is bound by XLA compilation (about 50-60 s of CPU time, roughly 35-45 s of wall
time on two idle cores).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from paths import SHARED
from safetensors.numpy import load_file

import psd_jax
from psd_jax import DecodeConfig
from psd_jax.core.decoders import forward_sizes
from psd_jax.core.policies import step_counts

from decode_driver import Driver, unpad

GOLDENS = SHARED / "goldens"

LLADA = dict(gen_length=48, block_length=16)  # steps default to gen_length: 1 token per step for `fixed`
DREAM = dict(gen_length=32, block_length=32, steps=32)
# Recorded trajectories: LLaDA with the paper's defaults (k_max 10, r 0.1, tau 0.9, lambda 0.3) over
# three blocks; Dream with its own schedule, a lower tau and lambda (more pivots win) and a larger
# ratio r, so that the candidate filter p >= r * p_max really excludes branches that would win.
TRAJ = {
    "llada-tiny": DecodeConfig(**LLADA, policy="fixed", decoder="rps"),
    "dream-tiny": DecodeConfig(
        **DREAM, policy="dream", confidence="maskgit_plus", decoder="rps", pivot_tau=0.8, lam=0.1, ratio=0.3
    ),
}
STATS = ("pivot_searched", "pivot_found", "pivot_committed", "winner_rank")


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cases():
    return load_file(str(GOLDENS / "cases.safetensors"))


@pytest.fixture(scope="module")
def models():
    return {name: psd_jax.load_model(GOLDENS / name) for name in ("llada-tiny", "dream-tiny")}


@pytest.fixture(scope="module")
def prompts(cases):
    """LLaDA: both threshold prompts (20 tokens) + the left-padded row of generate_s48 (15 tokens);
    Dream: the two rows of generate_maskgit_plus_s32 (20 and 15 tokens, left-padded)."""
    g, d = "llada-tiny.generate_s48", "dream-tiny.generate_maskgit_plus_s32"
    return {
        "llada-tiny": [unpad(cases[f"llada-tiny.threshold_0.9_row{r}.prompt"][0]) for r in (0, 1)]
        + [unpad(cases[f"{g}.prompt"][1], cases[f"{g}.attention_mask"][1])],
        "dream-tiny": [unpad(p, m) for p, m in zip(cases[f"{d}.prompt"], cases[f"{d}.attention_mask"])],
    }


@pytest.fixture(scope="module")
def trajectories(models, prompts):
    """name -> (driver, states, attention mask)."""
    out = {}
    for name, settings in TRAJ.items():
        rows = prompts[name]
        driver = Driver(models[name], settings, batch=len(rows), prompt_length=max(map(len, rows)))
        states, mask = driver.trajectory(rows)
        out[name] = (driver, states, mask)
    return out


def _probs(lm, canvas, mask):
    """p = softmax of the raw logits in float64, Dream's right shift applied, [MASK] excluded."""
    logits = np.asarray(lm.logits(canvas, mask), np.float64)
    if lm.config.family == "dream":
        logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
    logits[..., lm.config.mask_id] = -np.inf
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


def _scheduled_commit(conf, masked, counts, step):
    """`fixed` / `dream` in numpy: the schedule's count of the most confident masked positions
    (ties to the lower position), everything remaining at the schedule's last step."""
    order = sorted(np.flatnonzero(masked), key=lambda i: (-conf[i], i))
    k = len(order) if step >= len(counts) - 1 else int(counts[step])
    chosen = np.zeros_like(masked)
    chosen[order[:k]] = True
    return chosen


# --------------------------------------------------------------------- no eligible pivot


@pytest.mark.parametrize("base", ["fixed", "threshold"])
def test_no_eligible_pivot_is_the_base_policy(cases, models, base):
    """``pivot_tau`` 1 with one candidate value: no position of this checkpoint has a top-1
    probability of exactly 1, so none is ever eligible and RPS is the base policy; the base's
    tokens and call counts are pinned by the goldens (upstream's reference decoders)."""
    lm = models["llada-tiny"]
    if base == "fixed":
        key = "llada-tiny.generate_s48"
        rows = [unpad(p, m) for p, m in zip(cases[f"{key}.prompt"], cases[f"{key}.attention_mask"])]
        outputs = [o[-48:].tolist() for o in cases[f"{key}.output"]]
        nfe = [48, 48]  # one call per step
    else:
        keys = [f"llada-tiny.threshold_0.9_row{r}" for r in (0, 1)]
        rows = [unpad(cases[f"{k}.prompt"][0]) for k in keys]
        outputs = [cases[f"{k}.output"][0, -48:].tolist() for k in keys]
        nfe = [int(cases[f"{k}.nfe"]) for k in keys]
    settings = DecodeConfig(**LLADA, policy=base, decoder="rps", pivot_tau=1.0, k_max=1)
    gens = lm.generate(rows, settings, prompt_bucket=None)
    calls = max(g.nfe for g in gens)
    for row, g in enumerate(gens):
        assert g.output_ids == outputs[row], row
        assert g.nfe == nfe[row], row
        assert g.stats["pivot_searched"] > 0  # the search really ran ...
        assert g.stats["pivot_found"] == 0 and g.stats["pivot_committed"] == 0  # ... and found nothing
        assert sum(g.stats["winner_rank"]) == 0
        assert g.stats["pivot_searched"] <= g.nfe - 1
        # Honest compute: B sequences per call when only s0 is forwarded, B * (k_max + 1) at most.
        assert len(rows) * calls <= g.sequence_forwards <= len(rows) * (1 + (calls - 1) * (settings.k_max + 1))


# ------------------------------------------------------------ lookahead == one per branch


def test_batched_lookahead_equals_one_forward_per_branch(trajectories, models):
    driver, states, mask = trajectories["dream-tiny"]
    settings = driver.dcfg
    k = settings.k_max + 1
    # Every mid-decode state whose proposal has a pivot in some row.
    picked = []
    for index in range(1, len(states) - 1):
        proposal, batched = driver.propose_and_verify(states[index], mask)
        if np.asarray(proposal.state.found).any():
            picked.append((index, proposal, batched))
    winners = []
    for index, proposal, batched in picked:
        assert proposal.candidates.shape == (driver.batch, k, driver.loop.total_length)
        singles = [driver.call(proposal.candidates[:, c : c + 1], mask) for c in range(k)]
        for c, single in enumerate(singles):
            for field in ("token", "topk_id"):
                np.testing.assert_array_equal(
                    np.asarray(getattr(batched, field)[:, c]), np.asarray(getattr(single, field)[:, 0])
                )
            for field in ("conf", "entropy", "topk_prob"):
                np.testing.assert_allclose(
                    np.asarray(getattr(batched, field)[:, c]), np.asarray(getattr(single, field)[:, 0]), atol=1e-5
                )
        # The branches: MASK = s0 itself, then s0 with the pivot set to each token of T_{i*}
        # (valid while p >= r * p_max). The decoder commits the branch with the best lookahead
        # score, recomputed from the single forwards: -mean H over R \ {i*} + lambda * log p_{i*}(c),
        # the plausibility term from F(x) and 0 for MASK.
        state, after = states[index], states[index + 1]
        extra = {f.name: np.asarray(getattr(proposal.state, f.name)) for f in dataclasses.fields(proposal.state)}
        candidates, s0 = np.asarray(proposal.candidates), np.asarray(proposal.s0)
        entropy = np.stack([np.asarray(s.entropy[:, 0]) for s in singles], 1)  # [B, K, N]
        top_p, top_id = np.asarray(state.pred.topk_prob), np.asarray(state.pred.topk_id)
        in_block = np.asarray(driver.loop.in_block(state.block))
        remaining = np.asarray(proposal.valid) & (s0 == models["dream-tiny"].config.mask_id)  # R
        for b in range(driver.batch):
            np.testing.assert_array_equal(candidates[b, 0], s0[b])
            if bool(state.done[b]) or not extra["found"][b]:
                continue
            i = int(extra["pivot"][b])
            pivot_p = top_p[b, i]  # T_{i*}'s probabilities under F(x), descending
            np.testing.assert_array_equal(extra["branch_ok"][b], pivot_p >= settings.ratio * pivot_p[0])
            for c in range(1, k):
                np.testing.assert_array_equal(np.flatnonzero(candidates[b, c] != s0[b]), [i])
                assert candidates[b, c, i] == top_id[b, i, c - 1]
            others = remaining[b] & (np.arange(remaining.shape[-1]) != i)
            mean_h = entropy[b][:, others].mean(-1) if others.any() else np.zeros(k)  # empty R \ {i*}: 0
            score = -mean_h + settings.lam * np.concatenate([[0.0], np.log(pivot_p)])
            ok = np.concatenate([[True], extra["branch_ok"][b]])
            best = int(np.argmax(np.where(ok, score, -np.inf)))
            np.testing.assert_array_equal(np.asarray(after.canvas)[b, in_block[b]], candidates[b, best, in_block[b]])
            winners.append((int(ok.sum()), best))
    # Not vacuous: several valid branches competed, and both MASK and a pivot token won.
    assert max(n for n, _ in winners) >= 3, winners
    assert any(w == 0 for n, w in winners if n > 1) and any(w > 0 for _, w in winners), winners


# --------------------------------------------------------------- trajectories, re-derived


def _pivot_scores(p, remaining, settings):
    """Per position of a row: T_i's probabilities (the top k_max, descending), their mass, their
    truncated entropy, and the remaining positions eligible as the pivot (mass >= tau)."""
    top = -np.sort(-p, axis=-1)[:, : settings.k_max]
    mass = top.sum(-1)
    trunc_entropy = -(top * np.log(np.maximum(top, 1e-30))).sum(-1)
    return top, mass, trunc_entropy, remaining & (mass >= settings.pivot_tau)


def _call_size(forwarded: int, batch: int, most, k_max: int) -> int:
    """Candidates per row of a call, checked to be the fewest of the engine's static sizes that
    cover every live row (``most``: the row count a hair below and above the ratio boundary)."""
    sizes = [min(s for s in forward_sizes(k_max + 1) if s >= m) for m in most]
    assert sizes[0] <= forwarded // batch <= sizes[1] and forwarded % batch == 0
    return forwarded // batch


def _branches(top, eligible, trunc_entropy, ratio: float) -> np.ndarray:
    """The pivot's branches passing the ratio filter, counted with the float64 probabilities a
    hair above and below the boundary (0 without an eligible position)."""
    if not eligible.any():
        return np.zeros(2, int)
    pivot_top = top[np.flatnonzero(eligible)[trunc_entropy[eligible].argmax()]]
    return (pivot_top >= ratio * pivot_top[0] * np.array([[1 + 1e-5], [1 - 1e-5]])).sum(-1)


def _rank_passing_ratio(p, v: int, settings) -> int:
    """The rank of the committed value ``v`` in the pivot's T_i, checked to pass the ratio filter."""
    assert p[v] >= settings.ratio * p.max() * (1 - 1e-5)
    rank = int(np.sum(p > p[v]))
    assert rank < settings.k_max
    return rank


@pytest.mark.parametrize("name", ["llada-tiny", "dream-tiny"])
def test_pivot_rules_on_recorded_trajectory(trajectories, models, name):
    """At each iteration: the chosen canvas differs from the policy's commit s0 in at most one
    position of the current block; if it does, that is the pivot: masked in s0, in the block,
    eligible (top-k_max mass >= tau), the truncated-entropy argmax among the eligible ones, and its
    token has p >= ratio * p_max under F(x). Otherwise (MASK won) nothing else changed."""
    driver, states, mask = trajectories[name]
    lm, settings = models[name], driver.dcfg
    counts = step_counts(settings)
    seen = dict(commits=0, mask_won=0, searched=0, later_blocks=0, call_sizes=set())
    for before, after in zip(states[:-1], states[1:]):
        it = Iteration(
            canvas=np.asarray(before.canvas),
            new=np.asarray(after.canvas),
            token=np.asarray(before.pred.token),
            conf=np.asarray(before.pred.conf),
            block=np.asarray(before.block),
            step=np.asarray(before.step),
            done=np.asarray(before.done),
            done_after=np.asarray(after.done),
            live=np.asarray(after.row_nfe) - np.asarray(before.row_nfe),
            delta={s: np.asarray(after.stats[s]) - np.asarray(before.stats[s]) for s in STATS},
            p=_probs(lm, before.canvas, mask),  # F(x), independently
        )
        forwarded = int(after.sequence_forwards) - int(before.sequence_forwards)
        # The most leading candidates (MASK + the branches passing the ratio filter) a live row can
        # choose, counted with the float64 probabilities a hair below and above the boundary.
        most = np.zeros(2, int)
        near_tau = False
        for b in range(driver.batch):
            if it.done[b]:
                assert (it.new[b] == it.canvas[b]).all() and not any(it.delta[s][b].any() for s in STATS)
                continue
            branches, near = _check_row(it, b, driver, lm.config, settings, counts, seen)
            most, near_tau = np.maximum(most, 1 + branches), near_tau or near
        if not it.live.any():
            assert forwarded == 0
        elif not near_tau:
            seen["call_sizes"].add(_call_size(forwarded, driver.batch, most, settings.k_max))
    # Not vacuous: pivots were committed, MASK also won with a pivot found, calls of all branches
    # and of only some occurred.
    assert seen["commits"] > 0 and seen["mask_won"] > 0 and seen["searched"] > 0, seen
    assert settings.k_max + 1 in seen["call_sizes"] and len(seen["call_sizes"]) >= 2, seen
    if settings.num_blocks > 1:
        assert seen["later_blocks"] > 0, seen


@dataclasses.dataclass
class Iteration:
    """One iteration of a recorded trajectory, on the host: the state before and the changes."""

    canvas: np.ndarray
    new: np.ndarray
    token: np.ndarray
    conf: np.ndarray
    block: np.ndarray
    step: np.ndarray
    done: np.ndarray
    done_after: np.ndarray
    live: np.ndarray
    delta: dict
    p: np.ndarray


def _check_row(it: Iteration, b: int, driver, mcfg, settings, counts, seen: dict):
    """Row ``b``'s iteration against the definition; (its branches a hair below and above the
    ratio boundary, zeros when not live; whether a remaining mass sits right at tau)."""
    mask_id, n = mcfg.mask_id, driver.loop.total_length
    start = driver.prompt_length + it.block[b] * settings.block_length
    pos = np.arange(n)
    in_block = (pos >= start) & (pos < start + settings.block_length)
    masked = (it.canvas[b] == mask_id) & in_block  # M(x)
    # The carried prediction is F(x), the forward of the current canvas.
    np.testing.assert_array_equal(it.token[b, masked], it.p[b].argmax(-1)[masked])
    chosen = _scheduled_commit(it.conf[b], masked, counts, it.step[b])
    s0 = np.where(chosen, it.token[b], it.canvas[b])
    remaining = masked & ~chosen  # R
    top, mass, trunc_entropy, eligible = _pivot_scores(it.p[b], remaining, settings)
    delta = {s: d[b] for s, d in it.delta.items()}
    branches, near = np.zeros(2, int), False
    assert it.live[b] in (0, 1)
    if it.live[b]:
        assert delta["pivot_searched"] == int(remaining.any())
        # Tolerance: float32 (engine) vs float64 (here) masses right at tau.
        near = bool((remaining & (np.abs(mass - settings.pivot_tau) < 1e-5)).any())
        if not near:
            assert delta["pivot_found"] == int(eligible.any())
        branches = _branches(top, eligible, trunc_entropy, settings.ratio)
    else:
        assert bool(it.done_after[b]) and not any(delta[s].any() for s in STATS)
    # Outside the block nothing changes, except the EOS fill after an early stop.
    outside = ~in_block & (it.new[b] != s0)
    assert ((it.new[b] == mcfg.eos_id) & (pos >= start + settings.block_length))[outside].all()
    diff = in_block & (it.new[b] != s0)
    assert diff.sum() == delta["pivot_committed"] <= 1
    assert delta["winner_rank"].sum() == delta["pivot_committed"]
    seen["searched"] += int(delta["pivot_searched"])
    if diff.any():
        (i,) = np.flatnonzero(diff)
        assert s0[i] == mask_id and it.canvas[b, i] == mask_id and in_block[i] and remaining[i]
        assert mass[i] >= settings.pivot_tau - 1e-5  # eligible
        assert trunc_entropy[i] >= trunc_entropy[eligible].max() - 1e-5  # the truncated-entropy argmax
        assert _rank_passing_ratio(it.p[b, i], it.new[b, i], settings) == delta["winner_rank"].argmax()
        seen["commits"] += 1
        seen["later_blocks"] += int(it.block[b] > 0)
    elif it.live[b] and delta["pivot_found"]:
        seen["mask_won"] += 1
    return branches, near


# ------------------------------------------------------------------------------------ stats


def test_stats_are_consistent(trajectories):
    committed = 0
    for name, (driver, states, _) in trajectories.items():
        final = states[-1]
        stats = {s: np.asarray(final.stats[s]) for s in STATS}
        row_nfe = np.asarray(final.row_nfe)
        assert stats["winner_rank"].shape == (driver.batch, driver.dcfg.k_max)
        assert (stats["pivot_committed"] <= stats["pivot_found"]).all(), name
        assert (stats["pivot_found"] <= stats["pivot_searched"]).all(), name
        assert (stats["pivot_searched"] <= row_nfe - 1).all(), name  # at most one search per forward
        np.testing.assert_array_equal(stats["winner_rank"].sum(-1), stats["pivot_committed"])
        calls = int(final.nfe)
        assert (
            driver.batch * calls
            <= int(final.sequence_forwards)
            <= driver.batch * (1 + (calls - 1) * (driver.dcfg.k_max + 1))
        )
        committed += int(stats["pivot_committed"].sum())
    assert committed > 0
