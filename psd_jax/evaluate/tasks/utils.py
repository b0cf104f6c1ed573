"""The harness's ``!function`` entry points of these tasks: psd_jax.evaluate.code_answers."""

from psd_jax.evaluate.code_answers import fenced_programs, humaneval_programs, pass_at_1, pass_at_k

__all__ = ["fenced_programs", "humaneval_programs", "pass_at_1", "pass_at_k"]
