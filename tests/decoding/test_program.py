"""The compile key (``runtime.Program``): the settings that set shapes or code paths, apart from
the per-row runtime values (``runtime.RUNTIME_FIELDS``)."""

from __future__ import annotations

import dataclasses

import pytest

from psd_jax import DecodeConfig
from psd_jax.core.config import ENTROPY_BOUND_FIELDS
from psd_jax.core.entropy_bound import EntropyBoundSettings
from psd_jax.core.runtime import FLAGS, RUNTIME_FIELDS, Program, RowValues


def test_every_setting_is_either_a_program_field_or_a_runtime_value():
    """One list of runtime values: a new ``DecodeConfig`` field that is neither in it nor a program
    field fails here, so it cannot be silently dropped from the compile key. DiffusionGemma's
    fields key its own sampler's programs (``entropy_bound.EntropyBoundSettings``), never this one."""
    settings = {f.name for f in dataclasses.fields(DecodeConfig)} - set(ENTROPY_BOUND_FIELDS)
    assert set(ENTROPY_BOUND_FIELDS) == {f.name for f in dataclasses.fields(EntropyBoundSettings)} - {"gen_length"}
    program = {f.name for f in dataclasses.fields(Program)}
    assert set(RUNTIME_FIELDS) <= settings and not set(RUNTIME_FIELDS) & program
    assert program == (settings - set(RUNTIME_FIELDS)) | set(FLAGS)
    assert {f.name for f in dataclasses.fields(RowValues)} == set(RUNTIME_FIELDS) | {"num_blocks", "gen_length"}


@pytest.mark.parametrize(
    "settings",
    [
        DecodeConfig(),
        DecodeConfig(temperature=0.7, top_k=5),
        DecodeConfig(top_p=0.9, temperature=0.5),
        DecodeConfig(cfg_scale=1.5),
        DecodeConfig(decoder="psd", accept_confidence=0.9),
    ],
    ids=["greedy", "top-k", "top-p", "guided", "gated"],
)
def test_flags_say_which_code_paths_the_values_need(settings):
    program = Program.of(settings)
    assert {flag: getattr(program, flag) for flag in FLAGS} == {flag: getattr(settings, flag) for flag in FLAGS}
    for name in RUNTIME_FIELDS:  # the loop cannot read a value from the key: it has none
        assert not hasattr(program, name), name


def test_rows_that_differ_only_in_values_share_a_program():
    base = DecodeConfig(policy="threshold", decoder="psd", depth=2, gen_length=64, block_length=16)
    same = base.replace(threshold=0.7, temperature=0.3, top_p=0.8, accept_confidence=0.6)
    other_values = same.replace(temperature=0.9, top_p=0.5, top_k=3, accept_confidence=0.95)
    assert Program.of(same) == Program.of(other_values) != Program.of(base)
    assert hash(Program.of(same)) == hash(Program.of(other_values))
    assert Program.of(base.replace(threshold=0.5)) == Program.of(base)  # a value alone changes nothing
    assert Program.of(base.replace(depth=3)) != Program.of(base)  # a shape does


def test_a_longer_canvas_keeps_the_rows_steps_per_block():
    """A row of gen 32 with 8 steps in a batch whose canvas is 64: its program takes 16 steps (4
    per block of 16, as the row's own), and a canvas that is no multiple of the block is refused."""
    row = DecodeConfig(gen_length=32, block_length=16, steps=8)
    program = Program.of(row, 64)
    assert (program.gen_length, program.steps, program.steps_per_block) == (64, 16, row.steps_per_block)
    with pytest.raises(ValueError, match="canvas gen_length 40 must be a multiple of block_length 16"):
        Program.of(row, 40)
