"""Setting names (``psd_jax.names``): every name the tuner or the benchmark writes reads back as the
same setting, a name stands for one setting only, and a bad name is refused naming what is wrong."""

from __future__ import annotations

import re

import pytest

from psd_jax.cli import bench
from psd_jax.core.config import POLICIES, DecodeConfig, DecodeConfigError
from psd_jax.names import entropy_bound_fields, entropy_bound_name, full_name, setting_fields, setting_name
from psd_jax.tuning.space import default_space

GEN = 48


def read_back(name: str) -> DecodeConfig:
    return DecodeConfig(gen_length=GEN, **{"block_length": 16, **setting_fields(name, GEN)})


def test_every_candidate_of_the_tuners_space_reads_back_as_itself():
    space = [DecodeConfig(gen_length=GEN, **fields) for fields in default_space(GEN, 16)]
    names = {full_name(settings) for settings in space}
    assert len(names) == len(space)  # one name per setting
    for settings in space:
        assert read_back(full_name(settings)) == settings, full_name(settings)


@pytest.mark.parametrize(
    "fields",
    [
        dict(policy="fixed", steps=36),  # not a whole number of tokens per step
        dict(policy="dream", steps=24),
        dict(policy="threshold_schedule", threshold=0.95),
        dict(policy="threshold_schedule", threshold=0.9, steps=4),
        dict(policy="sequential", steps=4),
        dict(
            decoder="edit", policy="threshold_schedule", threshold=0.5, steps=8, editing_threshold=0.7, max_post_steps=4
        ),
        dict(policy="factor", factor=0.5, temperature=0.7),
        dict(policy="fixed", steps=GEN, predict_mask=True, temperature=0.5),
        dict(decoder="psd", policy="threshold", depth=5, draft_rate=2),
        dict(
            decoder="psd", steps=GEN, depth=20, draft_next_block=True, accept_confidence=0.95, cache="dual", vicinity=16
        ),
        dict(decoder="rps", policy="threshold", k_max=5, ratio=0.2, pivot_tau=0.8, lam=0.5),
    ],
)
def test_names_read_back_as_their_settings(fields):
    settings = DecodeConfig(gen_length=GEN, block_length=16, **fields)
    assert read_back(full_name(settings)) == settings


def test_every_policy_has_its_own_name():
    names = {p: setting_name(DecodeConfig(gen_length=32, block_length=8, policy=p)) for p in POLICIES}
    assert len(set(names.values())) == len(POLICIES)
    assert all(name.startswith(p.split("_")[-1] if p == "threshold_schedule" else p) for p, name in names.items())


def test_the_benchmark_runs_any_name_with_its_cache_and_block():
    base = DecodeConfig(gen_length=GEN, block_length=16, cache="dual")
    matrix = bench.decoder_matrix(base, ["psd-fixed-1-d15-next-conf0.95/dual+v16", "threshold-0.9/prefix/b8"])
    assert list(matrix) == ["psd-fixed-1-d15-next-conf0.95/dual+v16", "threshold-0.9/prefix/b8"]
    drafts, threshold = matrix.values()
    assert (drafts.depth, drafts.draft_next_block, drafts.accept_confidence, drafts.vicinity) == (15, True, 0.95, 16)
    assert (threshold.policy, threshold.cache, threshold.block_length) == ("threshold", "prefix", 8)
    assert all(setting_name(settings) == name.split("/")[0] for name, settings in matrix.items())


@pytest.mark.parametrize(
    "name, message",
    [
        ("greedy", "unknown setting name 'greedy'"),
        ("fixed-5", "gen_length 48 is not a multiple of 5 tokens per step"),
        ("threshold-0.9-d3", "depth belongs to a psd- name"),
        ("psd-threshold-0.9-d3-k5", "k_max belongs to a rps- name"),
        ("fixed-1/dual+x3", "dual+x3"),
        ("fixed-1/dual/b8/b4", "after the setting come a cache and a block length"),
    ],
)
def test_bad_names_are_refused_naming_the_problem(name, message):
    with pytest.raises(DecodeConfigError, match=message.replace("+", r"\+")):
        setting_fields(name, GEN)


def test_the_benchmark_refuses_a_bad_name_in_one_line(capsys):
    assert bench.main(["--decoders", "fixed-1,psd-fixed-1-d3-next-k4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "psd-fixed-1-d3-next-k4" in err[0] and "k_max belongs to a rps- name" in err[0]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"entropy_bound": 2.5, "max_denoising_steps": 6},
        {"confidence_threshold": 0.0, "stability_threshold": 3},
        {"t_max": 1.25, "t_min": 0.1, "entropy_bound": 0.0},
    ],
)
def test_entropy_bound_names_read_back_as_their_settings(fields):
    """DiffusionGemma's names: the release's settings are ``entropy-bound-0.1``, and any other
    reads back as itself, naming only what differs from the release."""
    settings = DecodeConfig(**fields)
    name = entropy_bound_name(settings)
    assert DecodeConfig(**entropy_bound_fields(name)) == settings
    assert name.count("-") == 2 + len(set(fields) - {"entropy_bound"})


@pytest.mark.parametrize(
    "name, message",
    [
        ("entropy-bound-x", "unknown DiffusionGemma setting name 'entropy-bound-x'"),
        ("entropy-bound-0.1/dual", "no cache or block length"),
        ("entropy-bound-0.1-stop0.1-s4", "expected entropy-bound-B[-sN][-stopC]"),
    ],
)
def test_bad_entropy_bound_names_are_refused_naming_the_problem(name, message):
    with pytest.raises(DecodeConfigError, match=re.escape(message)):
        entropy_bound_fields(name)
