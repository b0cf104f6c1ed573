"""PSD (parallel speculative decoding, algorithms.md "PSD") on the goldens' tiny checkpoints.

What is shown, each on a case checked to really exercise it:
- ``depth=0`` is exactly the base policy (tokens and model calls) for every policy;
- ``acceptance="strict"`` is lossless, with fewer calls on some case and more on none;
- the one batched verification call over ``[B, D+1, N]`` equals one call per depth;
- rows of a batch accepting different depths decode exactly as they do alone;
- with ``acceptance="tokens"`` every accepted level's tokens are the verifier's argmax on the
  state before it, the deepest consistent level is accepted, and each iteration commits
  ``|S0| + sum of the accepted levels' sizes`` positions (re-derived independently in numpy);
- the ``accepted_depth`` histogram counts the row's forwards after the first one (``nfe - 1``).

Compiled work is shared through module-scoped caches (one compile per checkpoint, batch shape and
settings); the file is bound by XLA compilation (about 50-60 s of CPU time, roughly 35-45 s of wall
time on two idle cores).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from paths import SHARED
from safetensors.numpy import load_file

import psd_jax
from psd_jax import DecodeConfig
from psd_jax.core.decoders import forward_sizes

from decode_driver import Driver, unpad

GOLDENS = SHARED / "goldens"

LLADA = dict(gen_length=48, block_length=16)  # steps default to gen_length: 1 token per step for `fixed`
DREAM = dict(gen_length=32, block_length=32, steps=32)
TRAJ = DecodeConfig(**LLADA, policy="threshold", decoder="psd", depth=3)  # acceptance="tokens"

# The base policies' outputs and call counts are pinned by the goldens (upstream's reference
# decoders, which plain decoding reproduces token for token: tests/decoding/test_decoding_goldens.py);
# `factor` has no golden, so its base is the plain decoder here.
BASES = {
    "fixed": ("llada-tiny", "generate_s48", DecodeConfig(**LLADA, policy="fixed")),
    "fixed-s24": ("llada-tiny", "generate_s24", DecodeConfig(**LLADA, steps=24, policy="fixed")),
    "threshold": ("llada-tiny", "threshold_0.9", DecodeConfig(**LLADA, policy="threshold", threshold=0.9)),
    "dream": (
        "dream-tiny",
        "generate_maskgit_plus_s32",
        DecodeConfig(**DREAM, policy="dream", confidence="maskgit_plus"),
    ),
}
# (base, depth) pairs for the strict check: several depths, and 1 and 2 tokens per step for `fixed`.
STRICT = [("fixed", 1), ("fixed-s24", 5), ("threshold", 3), ("threshold", 5)]


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cases():
    return load_file(str(GOLDENS / "cases.safetensors"))


@pytest.fixture(scope="module")
def models():
    return {name: psd_jax.load_model(GOLDENS / name) for name in ("llada-tiny", "dream-tiny")}


@pytest.fixture(scope="module")
def golden(cases):
    """``golden(base)`` -> (checkpoint, prompts, settings, outputs, nfe): the base policy's result."""

    def _golden(base):
        name, case, settings = BASES[base]
        if case.startswith("threshold"):
            rows = [f"{name}.{case}_row{r}" for r in (0, 1)]
            prompts = [unpad(cases[f"{r}.prompt"][0]) for r in rows]
            outputs = [cases[f"{r}.output"][0, -settings.gen_length :].tolist() for r in rows]
            nfe = [int(cases[f"{r}.nfe"]) for r in rows]
        else:
            key = f"{name}.{case}"
            prompts = [unpad(p, m) for p, m in zip(cases[f"{key}.prompt"], cases[f"{key}.attention_mask"])]
            outputs = [o[-settings.gen_length :].tolist() for o in cases[f"{key}.output"]]
            nfe = [settings.total_steps] * len(prompts)  # upstream: one model call per step
        return name, prompts, settings, outputs, nfe

    return _golden


@pytest.fixture(scope="module")
def prompts(golden):
    """LLaDA batch of the trajectory tests: both threshold prompts (20 tokens each) and the
    left-padded row of generate_s48 (15 tokens)."""
    return golden("threshold")[1] + golden("fixed")[1][1:]


@pytest.fixture(scope="module")
def run(models):
    """``run(checkpoint, prompts, settings)`` -> list[Generation], memoised per module."""
    memo = {}

    def _run(name, prompt_rows, settings):
        key = (name, settings, tuple(map(tuple, prompt_rows)))
        if key not in memo:
            memo[key] = models[name].generate(prompt_rows, settings, prompt_bucket=None)
        return memo[key]

    return _run


# ------------------------------------------------------- low-level driver: init_state + step


@pytest.fixture(scope="module")
def driver(models, prompts):
    return Driver(models["llada-tiny"], TRAJ, batch=len(prompts), prompt_length=max(map(len, prompts)))


@pytest.fixture(scope="module")
def traj(driver, prompts):
    return driver.trajectory(prompts)


# --------------------------------------------------------------------------------- D = 0


@pytest.mark.parametrize("base", ["fixed", "threshold", "dream"])
def test_depth_zero_is_the_base_policy(run, golden, base):
    name, prompt_rows, settings, outputs, nfe = golden(base)
    for row, g in enumerate(run(name, prompt_rows, settings.replace(decoder="psd", depth=0))):
        assert g.output_ids == outputs[row], row
        assert g.nfe == nfe[row], row
        assert g.stats["accepted_depth"] == [g.nfe - 1]  # every forward after the first: depth 0


def test_depth_zero_is_the_base_policy_factor(run, prompts):
    settings = DecodeConfig(**LLADA, policy="factor", factor=1.0)
    base = run("llada-tiny", prompts, settings)
    psd = run("llada-tiny", prompts, settings.replace(decoder="psd", depth=0))
    assert min(g.nfe for g in base) < settings.gen_length  # several tokens in some step: really dynamic
    for b, p in zip(base, psd):
        assert p.output_ids == b.output_ids
        assert p.nfe == b.nfe
        assert p.sequence_forwards == b.sequence_forwards  # K = D + 1 = 1 canvas per row and call
        assert p.stats["accepted_depth"] == [b.nfe - 1]


def test_levels_past_the_block_are_not_forwarded(run, prompts):
    """``fixed`` at 4 steps per block drafts at most 3 levels (the block's remaining steps), so
    depth 7 decodes exactly as depth 3 and its calls forward at most 4 of its 8 candidates per
    row (``forward_sizes(8)`` = 1, 4, 8), where forwarding all D + 1 would cost 8."""
    settings = DecodeConfig(**LLADA, policy="fixed", steps=12, decoder="psd")
    shallow = run("llada-tiny", prompts, settings.replace(depth=3))
    deep = run("llada-tiny", prompts, settings.replace(depth=7))
    assert max(g.stats["accepted_depth"][2] + g.stats["accepted_depth"][3] for g in deep) > 0  # drafts accepted
    for d3, d7 in zip(shallow, deep):
        assert d7.output_ids == d3.output_ids and d7.nfe == d3.nfe
        assert d7.stats["accepted_depth"][:4] == d3.stats["accepted_depth"] and sum(d7.stats["accepted_depth"][4:]) == 0
    calls = max(g.nfe for g in deep)
    assert deep[0].sequence_forwards <= len(prompts) * (1 + 4 * (calls - 1))


# ---------------------------------------------------------------------- strict is lossless


@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_strict_acceptance_is_lossless(run, golden, policy):
    saved = []
    for base, depth in (c for c in STRICT if c[0].split("-")[0] == policy):
        name, prompt_rows, settings, outputs, nfe = golden(base)
        strict = settings.replace(decoder="psd", depth=depth, acceptance="strict")
        for row, g in enumerate(run(name, prompt_rows, strict)):
            assert g.output_ids == outputs[row], (base, depth, row)
            assert g.nfe <= nfe[row], (base, depth, row)
            saved.append(nfe[row] - g.nfe)
            # Same steps as the base, so each accepted level saves one call, except that a row
            # ending on an accepted level pays for a forward the base skips.
            levels = sum(j * h for j, h in enumerate(g.stats["accepted_depth"]))
            assert nfe[row] - g.nfe in (levels, levels - 1), (base, depth, row)
    assert max(saved) > 0, "strict PSD never saved a model call: the test would be vacuous"


def test_strict_is_stronger_than_tokens_acceptance(traj, golden, prompts):
    """Plain token acceptance does change these outputs, so the strict check is not vacuous."""
    _, rows, settings, outputs, _ = golden("threshold")
    final = np.asarray(traj[0][-1].canvas)[:, -settings.gen_length :]
    assert prompts[:2] == rows
    assert any(final[r].tolist() != outputs[r] for r in range(2))


# ----------------------------------------------------- batched verification == one per depth


def test_batched_verification_equals_one_forward_per_depth(driver, traj):
    """Every mid-decode state's candidates [B, D+1, N] in one ``Loop.call`` vs one call per depth."""
    states, mask = traj
    d = TRAJ.depth
    full_depth = 0
    for state in states[1:-1]:
        proposal, batched = driver.propose_and_verify(state, mask)
        candidates = proposal.candidates
        assert candidates.shape == (driver.batch, d + 1, driver.loop.total_length)
        for depth in range(d + 1):
            single = driver.call(candidates[:, depth : depth + 1], mask)
            np.testing.assert_array_equal(np.asarray(batched.token[:, depth]), np.asarray(single.token[:, 0]))
            np.testing.assert_allclose(np.asarray(batched.conf[:, depth]), np.asarray(single.conf[:, 0]), atol=1e-5)
        # States where every level adds positions: all D + 1 candidates really differ.
        full_depth += int(np.asarray(proposal.state.levels.any(-1).all(-1)).any())
    assert full_depth > 0


# ------------------------------------------------------------------- rows are independent


def _final(states, settings):
    last = states[-1]
    canvas = np.asarray(last.canvas)[:, -settings.gen_length :]
    hist = np.asarray(last.stats["accepted_depth"])
    return canvas, np.asarray(last.row_nfe), hist


def test_rows_with_different_depths_decode_as_alone(driver, traj, prompts):
    """Each row of a batch whose rows accept different depths decodes exactly as it does alone.

    "Alone" is the row's prompt repeated over the whole batch: identical rows accept identical
    depths at every iteration, so no other row can influence it, and the batch shape (hence the
    compiled loop and the forward's numerics per row) stays the same as the mixed batch's."""
    canvas, nfe, hist = _final(traj[0], TRAJ)
    assert len({tuple(h) for h in hist}) == len(prompts), f"rows accepted the same depths {hist.tolist()}"
    # Iteration by iteration, the rows really accepted different depths at the same time.
    deltas = [
        np.asarray(a.stats["accepted_depth"]) - np.asarray(b.stats["accepted_depth"])
        for b, a in zip(traj[0], traj[0][1:])
    ]
    assert any(len({int(r.argmax()) for r, live in zip(dl, dl.sum(-1)) if live}) > 1 for dl in deltas)
    for row, prompt in enumerate(prompts):
        alone_states, _ = driver.trajectory([prompt] * len(prompts))
        alone_canvas, alone_nfe, alone_hist = _final(alone_states, TRAJ)
        for r in range(len(prompts)):
            assert alone_canvas[r].tolist() == canvas[row].tolist(), row
            assert alone_nfe[r] == nfe[row], row
            assert alone_hist[r].tolist() == hist[row].tolist(), row


# ------------------------------------------------------------ token acceptance, re-derived


def _threshold_commit(conf, masked, tau):
    """Fast-dLLM threshold policy in numpy: argmax position (lowest index on ties) + conf >= tau."""
    chosen = masked & (conf >= np.float32(tau))
    if masked.any():
        chosen[int(np.argmax(np.where(masked, conf, -np.inf)))] = True
    return chosen


def _levels_by_definition(driver, canvas, token, conf, block, done, mask_id: int):
    """S0 and the levels of every row, in numpy from the carried F(x) (algorithms.md "PSD"); the
    canvases x, s_0, s_1, ..., s_D for the verifier. Returns (canvases [B, D + 2, N], levels
    [B, D + 1, N], S0 per row, the block's positions per row)."""
    d, n = TRAJ.depth, driver.loop.total_length
    stack = np.repeat(canvas[:, None], d + 2, axis=1)
    levels = np.zeros((driver.batch, d + 1, n), bool)
    s0_sets, blocks = [], []
    for b in range(driver.batch):
        start = driver.prompt_length + block[b] * TRAJ.block_length
        in_block = (np.arange(n) >= start) & (np.arange(n) < start + TRAJ.block_length)
        masked = (canvas[b] == mask_id) & in_block & ~done[b]
        s0 = _threshold_commit(conf[b], masked, TRAJ.threshold)
        s0_sets.append(s0)
        blocks.append(in_block)
        rest = sorted(np.flatnonzero(masked & ~s0), key=lambda i: (-conf[b, i], i))
        size = max(1, int(s0.sum()))
        row = stack[b]  # a view (one advanced index per assignment below)
        row[1:, s0] = token[b, s0]
        for j in range(1, d + 1):
            idx = np.asarray(rest[(j - 1) * size : j * size], int)
            levels[b, j, idx] = True
            row[j + 1 :, idx] = token[b, idx]
    return stack, levels, s0_sets, blocks


def test_tokens_acceptance_matches_verifier_argmax(driver, traj, models):
    """Replays the recorded trajectory: S0 and the draft levels are re-derived in numpy from the
    carried F(x), every state before a level is re-forwarded on its own, and the committed set,
    its size, its tokens and the accepted depth are checked against algorithms.md "PSD"."""
    states, mask = traj
    d, mask_id = TRAJ.depth, models["llada-tiny"].config.mask_id
    depths_seen, rejected_levels, multi_s0, call_sizes = [], 0, 0, set()
    for before, after in zip(states[:-1], states[1:]):
        canvas = np.asarray(before.canvas)
        token, conf = np.asarray(before.pred.token), np.asarray(before.pred.conf)
        block, done = np.asarray(before.block), np.asarray(before.done)
        new_canvas = np.asarray(after.canvas)
        delta = np.asarray(after.stats["accepted_depth"]) - np.asarray(before.stats["accepted_depth"])
        assert int(after.nfe) - int(before.nfe) == int(delta.sum() > 0)  # one model call per iteration
        forwarded = int(after.sequence_forwards) - int(before.sequence_forwards)
        stack, levels, s0_sets, blocks = _levels_by_definition(driver, canvas, token, conf, block, done, mask_id)
        # The call forwards the leading candidates a live row can choose: s0 and the levels up to
        # its first empty one, in the fewest of the engine's static sizes that cover every row.
        live_rows = delta.sum(-1) > 0
        most = max((1 + int(np.cumprod(levels[b, 1:].any(-1)).sum()) for b in np.flatnonzero(live_rows)), default=0)
        assert forwarded == (0 if not most else driver.batch * min(s for s in forward_sizes(d + 1) if s >= most))
        call_sizes.add(forwarded // driver.batch)
        # One forward per canvas: verifier[:, 0] = argmax F(x), verifier[:, j + 1] = argmax F(s_j)
        # ([MASK] excluded, temperature 0).
        verifier = np.stack(
            [np.asarray(driver.call(jnp.asarray(stack[:, k : k + 1]), mask).token[:, 0]) for k in range(d + 2)], 1
        )
        for b in range(driver.batch):
            if done[b]:
                assert (new_canvas[b] == canvas[b]).all()
                continue
            masked = (canvas[b] == mask_id) & blocks[b]
            # The carried prediction is F(x), the forward of the current canvas.
            np.testing.assert_array_equal(token[b, masked], verifier[b, 0, masked])
            np.testing.assert_array_equal(new_canvas[b, s0_sets[b]], token[b, s0_sets[b]])
            assert delta[b].sum() in (0, 1)
            j_star = int(delta[b].argmax()) if delta[b].sum() else 0
            if delta[b].sum() == 0:
                assert bool(after.done[b])  # not live: finished with its policy commit, no forward
            committed = masked & (new_canvas[b] != mask_id)
            np.testing.assert_array_equal(committed, s0_sets[b] | levels[b, 1 : j_star + 1].any(0))
            assert committed.sum() == s0_sets[b].sum() + levels[b, 1 : j_star + 1].sum()
            for j in range(1, j_star + 1):
                at = levels[b, j]
                assert at.any()  # accepted levels are never empty
                # The level's tokens are the verifier's argmax on the state before it, s_{j-1}.
                np.testing.assert_array_equal(new_canvas[b, at], verifier[b, j, at])
                np.testing.assert_array_equal(new_canvas[b, at], token[b, at])
            if delta[b].sum() and j_star < d and levels[b, j_star + 1].any():
                # The deepest consistent level: the next one disagrees with F(s_{j*}) somewhere.
                at = levels[b, j_star + 1]
                assert (verifier[b, j_star + 1, at] != token[b, at]).any()
                rejected_levels += 1
            depths_seen.append(j_star)
            multi_s0 += int(s0_sets[b].sum() > 1)
    # Not vacuous: multi-level acceptance, rejected levels, levels of several positions, and calls
    # of all and of only the first two candidates occurred.
    assert max(depths_seen) >= 2 and rejected_levels > 0 and multi_s0 > 0 and {2, d + 1} <= call_sizes


# ------------------------------------------------------------------------------------ stats


def test_accepted_depth_histogram_counts_forwards(run, golden, driver, traj):
    """Every model call after ``init_state``'s verifies the candidates of the rows still live, and
    each live row accepts exactly one depth in it; a row whose last iteration ends with its policy
    commit is not live then (and a call nobody needs is skipped). So per row
    ``sum(accepted_depth) == nfe - 1``.

    With ``fixed`` (and no EOS stop) an iteration accepting depth j consumes 1 + j schedule steps,
    so ``sum((1 + j) * hist[j])`` is ``steps`` or ``steps - 1``, the latter when the row's last
    iteration was a policy-only one without a forward."""
    checked = 0
    for base, depth in STRICT:
        name, prompt_rows, settings, _, _ = golden(base)
        settings = settings.replace(decoder="psd", depth=depth, acceptance="strict")
        gens = run(name, prompt_rows, settings)
        calls = max(g.nfe for g in gens)
        for g in gens:
            hist = g.stats["accepted_depth"]
            assert len(hist) == depth + 1
            assert sum(hist) == g.nfe - 1
            # Honest compute: init_state forwards B sequences, every later call B (only s_0, when
            # no row has a draft) or B * (D + 1).
            assert len(gens) * calls <= g.sequence_forwards <= len(gens) * (1 + (calls - 1) * (depth + 1))
            if settings.policy == "fixed" and g.tokens == settings.gen_length:
                assert settings.total_steps - sum((1 + j) * h for j, h in enumerate(hist)) in (0, 1)
            checked += 1
    final = traj[0][-1]
    np.testing.assert_array_equal(np.asarray(final.stats["accepted_depth"]).sum(-1), np.asarray(final.row_nfe) - 1)
    assert checked == 2 * len(STRICT)
