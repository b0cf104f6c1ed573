"""A decode's model calls by shape, and seconds predicted from them (``psd_jax.calls``, ``psd_jax.costs``)."""

from __future__ import annotations

import json
import statistics

import pytest

from models import config_from_dict
from psd_jax import DecodeConfig
from psd_jax.calls import CallShape, call_shapes
from psd_jax.costs import CHIPS, call_timers, predicted_seconds, record_key, roofline_call_cost

from conftest import HF_CONFIGS


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
