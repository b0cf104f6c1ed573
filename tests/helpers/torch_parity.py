"""The PyTorch backend against the JAX engine: one comparison of their ``Generation`` records, for
tests/backends/test_torch_backend.py and tests/backends/test_torch_cache.py (imported by both, needs no torch)."""

from __future__ import annotations

from collections.abc import Sequence

from psd_jax.core.records import Generation

# What a row of the two backends must share besides its ids (timings differ).
ROW_FIELDS = ("nfe", "tokens", "text", "stats")


def assert_same_generations(got: Sequence[Generation], expected: Sequence[Generation]) -> None:
    """``got`` (torch) equals ``expected`` (JAX), row by row: the generated ids first (the clearest
    failure), then the model calls, tokens before EOS, text and decoder statistics, then the batch's
    sequence forwards."""
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]
    row = lambda g: tuple(getattr(g, field) for field in ROW_FIELDS)
    assert [row(g) for g in got] == [row(e) for e in expected]
    assert got[0].sequence_forwards == expected[0].sequence_forwards
