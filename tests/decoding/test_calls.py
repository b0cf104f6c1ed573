"""A decode's model calls by shape, and seconds predicted from them (``psd_jax.core.calls``, ``psd_jax.costs``)."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
from paths import HF_CONFIGS

from models import config_from_dict
from psd_jax import DecodeConfig
from psd_jax.core.calls import CallShape, call_shapes
from psd_jax.costs import CHIPS, call_timers, predicted_seconds, record_key, roofline_call_cost


def test_call_shapes_follow_the_engines_counters():
    """Uncached: a full call at each forward size; cached: the refresh first (and a block-causal
    model's block refresh), then windows size-major, as the engine's ``lax.switch`` branches."""
    psd = DecodeConfig(gen_length=48, block_length=16, decoder="psd", depth=3)
    assert call_shapes(psd, 80) == tuple(CallShape("full", m, 80) for m in (1, 2, 4))
    prefix = psd.replace(cache="prefix")
    assert call_shapes(prefix, 80) == (
        CallShape("refresh", 1, 80),
        *(CallShape("window", m, w) for m in (1, 2, 4) for w in (16, 32, 48)),
    )
    dual = DecodeConfig(gen_length=32, block_length=8, cache="dual")
    assert call_shapes(dual, 40, block_causal=True) == (
        CallShape("refresh", 1, 40),
        CallShape("block_refresh", 1, 16),
        CallShape("window", 1, 8),
    )
    assert record_key({"kind": "window", "candidates": 4, "positions": 16, "batch": 8, "count": 3}) == "window 4x16 b8"


def test_predicted_seconds_need_every_shape_and_add_count_times_cost():
    calls = [
        {"kind": "refresh", "candidates": 1, "positions": 80, "batch": 2, "count": 3},
        {"kind": "window", "candidates": 1, "positions": 16, "batch": 2, "count": 10},
    ]
    costs = {"refresh 1x80 b2": 0.5, "window 1x16 b2": 0.125}
    assert predicted_seconds(calls, costs) == 3 * 0.5 + 10 * 0.125
    with pytest.raises(KeyError, match=r"no cost for the call shape\(s\) \['window 1x16 b2'\]"):
        predicted_seconds(calls, {"refresh 1x80 b2": 0.5})


def test_roofline_is_bandwidth_bound_at_small_batch_and_compute_bound_at_large():
    """LLaDA-8B on an H200: one canvas of one row reads all 16 GB of weights (about 3.4 ms), while
    32 rows of 112 positions are compute-bound (2 x 8e9 x 3584 tokens / 989 TFLOP/s, about 58 ms)."""
    mcfg = config_from_dict(json.loads((HF_CONFIGS / "LLaDA-8B-Instruct" / "config.json").read_text()), "llada-8b")
    h200, shape = CHIPS["h200"], CallShape("full", 1, 112)
    one = roofline_call_cost(mcfg, h200, shape, 1, 32)
    many = roofline_call_cost(mcfg, h200, shape, 32, 32)
    assert 3e-3 < one < 5e-3 and 40e-3 < many < 80e-3
    assert roofline_call_cost(mcfg, h200, CallShape("window", 1, 32), 1, 32) < one  # a block, not the canvas


def test_roofline_charges_the_lm_head_for_the_positions_that_get_logits():
    """A window call of ``draft_next_block`` predicts its block and the next (``logits`` 64 of a
    prefix window's 224 queries): one more block of the LM head, 2 x 4096 x 126464 x 32 FLOPs, over
    the one-block default; at 32 rows the call is compute-bound, so its time grows by that over peak."""
    mcfg = config_from_dict(json.loads((HF_CONFIGS / "LLaDA-8B-Instruct" / "config.json").read_text()), "llada-8b")
    h200, window = CHIPS["h200"], CallShape("window", 1, 224)
    one_block = roofline_call_cost(mcfg, h200, window, 32, 32)
    assert roofline_call_cost(mcfg, h200, window, 32, 32, logits=32) == one_block
    two_blocks = roofline_call_cost(mcfg, h200, window, 32, 32, logits=64)
    assert two_blocks - one_block == pytest.approx(2 * 4096 * 126464 * 32 * 32 / h200.flops)
    assert roofline_call_cost(mcfg, h200, window, 32, 32, logits=10_000) == roofline_call_cost(
        mcfg, h200, window, 32, 32, logits=224
    )  # never more positions than the call has


@pytest.mark.parametrize(("cache", "vicinity"), [("prefix", 0), ("dual", 16)])
def test_call_records_give_the_positions_that_get_logits(lms, cache, vicinity):
    """Drafts into the next block with a cache predict two blocks (``rules.logit_width``) in every
    call: the refresh's logits and each window's are 32 positions, not 16, where the call has them."""
    prompts = [[474, 488, 482, 450, 262, 258, 71, 195], [280, 242, 425, 15, 2, 138, 188]]
    settings = DecodeConfig(
        gen_length=48, block_length=16, decoder="psd", depth=15, draft_next_block=True, cache=cache, vicinity=vicinity
    )
    calls = lms["llada-tiny"].generate(prompts, settings, prompt_bucket=16)[0].calls
    assert {c["kind"] for c in calls} == {"refresh", "window"}
    for c in calls:
        assert c["logits"] == min(32, c["positions"]), c
    plain = dataclasses.replace(settings, decoder="plain", depth=3, draft_next_block=False)
    assert {c["logits"] for c in lms["llada-tiny"].generate(prompts, plain, prompt_bucket=16)[0].calls} == {16}


def test_measured_call_costs_predict_a_timed_decode(lms):
    """Each call shape a decode made, timed alone, sums to about the decode's own time. Timings, not
    counts: the decode and the calls are timed in turns (medians of five), and the bound is wide
    (a factor of two), since this is a check of the method, not a benchmark."""
    lm = lms["llada-tiny"]
    prompts = [[474, 488, 482, 450, 262, 258, 71, 195], [280, 242, 425, 15, 2, 138, 188]] * 4
    settings = DecodeConfig(gen_length=32, block_length=16, policy="threshold", threshold=0.7, cache="dual")
    first = lm.generate(prompts, settings, prompt_bucket=16, warm=True)[0]
    timers = call_timers(lm, settings, 16, len(prompts))
    decodes, costs = [], {key: [] for key in timers}
    for _ in range(5):
        decodes.append(lm.generate(prompts, settings, prompt_bucket=16)[0].seconds)
        for key, timer in timers.items():
            costs[key].append(timer())
    predicted = predicted_seconds(first.calls, {k: statistics.median(v) for k, v in costs.items()})
    assert 0.5 < predicted / statistics.median(decodes) < 2.0, (predicted, decodes)
    assert {record_key(c) for c in first.calls} <= set(timers) and sum(c["count"] for c in first.calls) >= first.nfe
