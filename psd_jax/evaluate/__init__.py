"""Evaluation with EleutherAI's lm-evaluation-harness (``python -m psd_jax.evaluate``, the ``eval``
extra): psd-jax as the harness model ``psd_jax``, with an efficiency record beside the scores.

One module per job: ``cli`` (the entry point and its pre-check), ``harness`` (the harness ``LM``;
importing it registers ``psd_jax``), ``args`` (model arguments into ``DecodeConfig``),
``gen_kwargs`` (a request's generation kwargs onto the decode), ``loglikelihood`` (LLaDA's Monte
Carlo estimator), ``efficiency`` (the NFE/TPF records), ``protocols`` (the published evaluation
runs by name) and ``protocol_cli`` (``--list-protocols``, ``--protocol``, ``--dry-run``),
``code_answers`` and ``tasks/`` (code tasks scored as upstream scores them). Nothing here imports
the harness until a run needs it, so ``main`` reports a missing harness as one line.
docs/evaluation.md.
"""

from .cli import main

__all__ = ["main"]
