"""Prompt lengths against the model's context: the one bucket rounding and the one context check.

Prompts are left-padded to a multiple of ``prompt_bucket`` so that prompts of similar length share
one compiled program; the padded prompt and the whole generation must fit the model's context.
The API, the harness, the likelihood estimator and the server all measure a prompt here.
"""

from __future__ import annotations

from .errors import InputError


def padded_length(tokens: int, bucket: int | None) -> int:
    """A prompt's length once left-padded to its bucket (``None`` or 0: no bucketing)."""
    return tokens if not bucket else -(-tokens // bucket) * bucket


def check_context(tokens: int, bucket: int | None, gen_length: int, max_length: int, what: str = "prompt") -> int:
    """The padded length of a ``tokens``-token prompt; ``InputError`` if it and ``gen_length``
    generated positions exceed the model's context of ``max_length``."""
    padded = padded_length(tokens, bucket)
    if padded + gen_length > max_length:
        raise InputError(
            f"{what} ({tokens} tokens, padded to {padded}) + gen_length {gen_length} "
            f"exceeds the model's context of {max_length}"
        )
    return padded


def check_questions(prompt_ids: list[list[int]], bucket: int | None, gen_length: int, max_length: int) -> None:
    """Every problem's encoded question fits the context with the generation: a run over a problem
    file checks this before its first decode, so that no setting fails after others have run."""
    for i, ids in enumerate(prompt_ids):
        check_context(len(ids), bucket, gen_length, max_length, f"problem {i + 1}'s question")
