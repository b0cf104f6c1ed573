"""PSD drafting into the next block (``draft_next_block``, docs/algorithms.md "PSD", "Drafts past the
block") against its for-loop definition: one row at a time, one full forward per canvas, every
rule written out in numpy. The compiled loop must give the same tokens and model calls on the
goldens' LLaDA prompts, for the fixed schedule at one and two tokens per step and for the
threshold rule; the definition is checked to really draft across a block boundary there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from paths import GOLDENS
from safetensors.numpy import load_file

import psd_jax
from psd_jax import DecodeConfig
from psd_jax.core.policies import step_counts
from psd_jax.core.rules import window_lengths

from decode_driver import Driver, unpad

LENGTHS = dict(gen_length=48, block_length=16)
SETTINGS = {
    "fixed-1-d15": DecodeConfig(**LENGTHS, decoder="psd", depth=15, draft_next_block=True),
    "fixed-1-d15-conf": DecodeConfig(**LENGTHS, decoder="psd", depth=15, draft_next_block=True, accept_confidence=0.7),
    "threshold-d5": DecodeConfig(
        **LENGTHS, policy="threshold", threshold=0.9, decoder="psd", depth=5, draft_next_block=True
    ),
}
# With a cache the verifier is a window call, and each block starts with a full forward (at depth 7:
# the drafts still cross into the next block, in half the verifier's canvases of depth 15).
SETTINGS["fixed-1-d7/prefix"] = SETTINGS["fixed-1-d15"].replace(cache="prefix", depth=7)
SETTINGS["threshold-d5/dual+v16"] = SETTINGS["threshold-d5"].replace(cache="dual", vicinity=16)


@pytest.fixture(scope="module")
def lm():
    return psd_jax.load_model(GOLDENS / "llada-tiny")


@pytest.fixture(scope="module")
def prompts():
    cases = load_file(str(GOLDENS / "cases.safetensors"))
    rows = [unpad(cases[f"llada-tiny.threshold_0.9_row{r}.prompt"][0]) for r in (0, 1)]
    key = "llada-tiny.generate_s48"
    rows += [unpad(p, m) for p, m in zip(cases[f"{key}.prompt"], cases[f"{key}.attention_mask"])][1:]
    return rows


def ranked(conf: np.ndarray, positions: np.ndarray) -> list[int]:
    """Positions by confidence, highest first, ties to the lower position."""
    return sorted(np.flatnonzero(positions).tolist(), key=lambda i: (-conf[i], i))


def policy_commit(conf: np.ndarray, masked: np.ndarray, step: int, dcfg: DecodeConfig, counts) -> np.ndarray:
    order = ranked(conf, masked)
    if dcfg.policy == "fixed":
        k = len(order) if step >= len(counts) - 1 else int(counts[step])
    else:  # threshold: every position at or above tau, and always the most confident
        k = max(1, sum(conf[i] >= np.float32(dcfg.threshold) for i in order)) if order else 0
    chosen = np.zeros_like(masked)
    chosen[order[:k]] = True
    return chosen


class Uncached:
    """Every prediction is a full forward of the row's canvas, in its padded batch."""

    def __init__(self, driver: Driver, canvases: np.ndarray, attention, row: int):
        self.driver, self.canvases, self.attention, self.row = driver, canvases, attention, row

    def start(self, canvas):
        return self.verify(canvas, 0)

    def verify(self, canvas, block):
        batch = self.canvases.copy()
        batch[self.row] = canvas
        pred = self.driver.call(jnp.asarray(batch[:, None]), self.attention)
        return np.asarray(pred.token[self.row, 0]), np.asarray(pred.conf[self.row, 0])

    def moved_on(self, canvas, prediction):
        return prediction, 0  # the last forward already predicts the next block


class Cached(Uncached):
    """Fast-dLLM's block cache: a full forward at each block start fills the row's cache; within a
    block, a candidate is predicted by one window from the block start (dual: the block and
    ``vicinity``; prefix: the rest of the generation, in the loop's static lengths) against it, whose
    first two blocks of predictions replace the row's."""

    def __init__(self, driver: Driver, canvases: np.ndarray, attention, row: int):
        super().__init__(driver, canvases, attention, row)
        graphdef = driver.lm.graphdef
        self._prefill = jax.jit(lambda params, t, m: nnx.merge(graphdef, params).prefill(t, m))
        self._window = jax.jit(
            lambda params, *a, out: nnx.merge(graphdef, params).window(*a, out), static_argnames="out"
        )
        n = canvases.shape[1]
        self.positions = np.asarray(driver.lm.model.positions(attention, driver.batch, n))[row]

    def start(self, canvas):
        batch = self.canvases.copy()
        batch[self.row] = canvas
        logits, keys, values = self._prefill(self.driver.lm.params, jnp.asarray(batch), self.attention)
        r = self.row
        self.cache = keys[:, r : r + 1], values[:, r : r + 1]
        self.prediction = greedy(logits[r], self.driver.lm.config.mask_id)
        return self.prediction

    def verify(self, canvas, block):
        dcfg, p, n = self.driver.dcfg, self.driver.prompt_length, canvas.shape[0]
        start = p + block * dcfg.block_length
        lengths = window_lengths(dcfg)
        w = next((length for length in lengths if length >= n - start), lengths[-1])
        index = start + np.arange(w)
        window_mask = index < n
        index = np.minimum(index, n - 1)
        cached = np.asarray(self.attention[self.row]).astype(bool)
        cached[start : start + w] = False  # the window's fresh keys replace them
        out = min(2 * dcfg.block_length, w)
        logits = self._window(
            self.driver.lm.params,
            jnp.asarray(canvas[index][None, None]),
            jnp.asarray(self.positions[index][None, None]),
            *self.cache,
            jnp.asarray(cached[None]),
            jnp.asarray(window_mask[None]),
            out=out,
        )
        token, conf = (a.copy() for a in self.prediction)
        placed = greedy(logits[0, 0], self.driver.lm.config.mask_id)
        end = min(start + out, n)
        token[start:end], conf[start:end] = placed[0][: end - start], placed[1][: end - start]
        return token, conf

    def moved_on(self, canvas, prediction):
        return self.start(canvas), 1  # the next block starts with a full forward


def greedy(logits, mask_id: int):
    """Greedy tokens and their probabilities [N] of logits [N, V], never [MASK]."""
    logits = logits.at[..., mask_id].set(-jnp.inf)
    token = jnp.argmax(logits, axis=-1)
    conf = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), token[..., None], axis=-1)[..., 0]
    return np.asarray(token.astype(jnp.int32)), np.asarray(conf)


def decode_by_definition(driver: Driver, prompts: list[list[int]], row: int, dcfg: DecodeConfig):
    """Row ``row``'s decode as algorithms.md defines it: (generated tokens, model calls, the most
    positions of a next block one accepted iteration committed, the levels refused only by
    ``accept_confidence``)."""
    lm, p = driver.lm, driver.prompt_length
    mask_id, stops, eos = lm.config.mask_id, set(lm.config.stop_ids), lm.config.eos_id
    ids, attention = driver.inputs(prompts)
    canvases = np.concatenate([np.asarray(ids), np.full((driver.batch, dcfg.gen_length), mask_id, np.int32)], 1)
    model = (Uncached if dcfg.cache == "none" else Cached)(driver, canvases, attention, row)

    b, spb, n_blocks = dcfg.block_length, dcfg.steps_per_block, dcfg.num_blocks
    counts = step_counts(dcfg)
    x = canvases[row].copy()
    token, conf = model.start(x)
    calls, block, step, crossed, gated = 1, 0, 0, 0, 0
    positions = np.arange(x.shape[0])
    while True:
        here = (positions >= p + block * b) & (positions < p + (block + 1) * b)
        masked = here & (x == mask_id)
        chosen = policy_commit(conf, masked, step, dcfg, counts)
        s = [np.where(chosen, token, x)]
        complete = not (here & (s[0] == mask_id)).any()
        if complete and (any(int(t) in stops for t in s[0][here]) or block == n_blocks - 1):
            x = s[0]  # finished with the policy's commit: no forward
        else:
            order = ranked(conf, masked & ~chosen)
            if block + 1 < n_blocks:
                after = (positions >= p + (block + 1) * b) & (positions < p + (block + 2) * b) & (x == mask_id)
                order += ranked(conf, after)[:-1]  # never the next block's last position
            levels = draft_levels(order, chosen, step, dcfg, counts)
            for level in levels:
                if not level:
                    break
                s.append(s[-1].copy())
                s[-1][level] = token[level]
            if dcfg.cache != "none" and complete and len(s) == 1:
                x = s[0]  # nothing to verify: the next block's full forward predicts next
                step += 1
            else:
                x, accepted, refused = verify_levels(model, s, levels, token, block, dcfg)
                token, conf = model.verify(x, block)  # the chosen candidate's forward: this iteration's one call
                calls += 1
                gated += refused
                step += 1 + accepted
                crossed = max(crossed, int(((x != mask_id) & (canvases[row] == mask_id) & ~here).sum()) - b * block)
            complete = not (here & (x == mask_id)).any()
        if complete:
            if any(int(t) in stops for t in x[here]) and dcfg.eos_early_stop:
                x[p + (block + 1) * b :] = eos
                break
            if block == n_blocks - 1:
                break
            block += 1
            step = max(step - spb, 0) if dcfg.policy == "fixed" else 0
            (token, conf), refreshed = model.moved_on(x, (token, conf))
            calls += refreshed
    return x[p:].tolist(), calls, crossed, gated


def draft_levels(order: list[int], chosen, step: int, dcfg: DecodeConfig, counts) -> list[list[int]]:
    """PSD's levels 1..D from the ranked rest (algorithms.md "PSD"): the fixed policy's scheduled
    counts of the next steps (none past the next block's), the others the commit's size each."""
    levels, used = [], 0
    for j in range(1, dcfg.depth + 1):
        if dcfg.policy == "fixed":
            spb = dcfg.steps_per_block
            size = int(counts[(step + j) % spb]) if step + j < 2 * spb else 0
        else:
            size = max(1, int(chosen.sum()))
        levels.append(order[used : used + size])
        used += size
    return levels


def verify_levels(model, s: list, levels: list, token, block: int, dcfg: DecodeConfig):
    """Hierarchical acceptance of the candidates ``s``: (the chosen one, its level, 1 if the
    confidence gate alone refused the next level)."""
    accepted = 0
    for j, level in enumerate(levels[: len(s) - 1], start=1):
        verifier, verifier_conf = model.verify(s[j - 1], block)
        if not (verifier[level] == token[level]).all():
            break
        if dcfg.accept_confidence > 0 and not (verifier_conf[level] >= np.float32(dcfg.accept_confidence)).all():
            return s[accepted], accepted, 1  # the tokens agree, the verifier is not confident enough in them
        accepted = j
    return s[accepted], accepted, 0


@pytest.mark.parametrize("name", list(SETTINGS))
def test_compiled_loop_equals_the_for_loop_definition(lm, prompts, name):
    dcfg = SETTINGS[name]
    driver = Driver(lm, dcfg, batch=len(prompts), prompt_length=max(map(len, prompts)))
    compiled = lm.generate(prompts, dcfg, prompt_bucket=None)
    crossed = gated = 0
    for row, g in enumerate(compiled):
        tokens, calls, row_crossed, row_gated = decode_by_definition(driver, prompts, row, dcfg)
        assert g.output_ids == tokens[: len(g.output_ids)] and g.nfe == calls, (name, row)
        crossed, gated = max(crossed, row_crossed), gated + row_gated
    assert crossed > 0, f"{name}: no iteration drafted into the next block; the test would be vacuous"
    assert (gated > 0) == (dcfg.accept_confidence > 0), f"{name}: the confidence gate refused {gated} levels"


def test_drafting_on_saves_calls_over_drafts_in_the_block(lm, prompts):
    """The same depth without the next block's positions ends its reach at the block: more calls."""
    dcfg = SETTINGS["fixed-1-d15"]
    across = lm.generate(prompts, dcfg, prompt_bucket=None)
    within = lm.generate(prompts, dcfg.replace(draft_next_block=False), prompt_bucket=None)
    assert sum(g.nfe for g in across) < sum(g.nfe for g in within)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(acceptance="strict"), "needs acceptance 'tokens'"),
        (dict(cache="dual", vicinity=8), r"with the dual cache needs vicinity >= block_length 16 \(got 8\)"),
        (dict(policy="dream", steps=48), "policy 'fixed', 'threshold' or 'factor'"),
        (dict(depth=31), r"depth 31 \(PSD\) exceeds 2 \* block_length - 2 = 30"),
    ],
)
def test_settings_it_cannot_run_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**LENGTHS, decoder="psd", draft_next_block=True, **fields)
