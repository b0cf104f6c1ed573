"""psd_jax.scoring's answer rule as a harness filter (the heldout task's ``psd-scoring``): the
number after the last ``####``, else the last number, normalised; what ``psd_jax.cli.bench`` scores."""

from __future__ import annotations

from psd_jax.scoring import extract_answer


def psd_answers(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    return [[extract_answer(text) or "[invalid]" for text in texts] for texts in resps]
