"""The lm-evaluation-harness model ``psd_jax``: harness requests through psd-jax's decoders.

Importing this module registers the model (``lm_eval.api.registry.register_model``);
``python -m psd_jax.evaluate`` (``psd_jax.evaluate.cli``) does so and then runs the harness's
own command line.

- ``generate_until``: requests are decoded in the harness's order, ``--batch_size`` at a time,
  through ``LoadedModel.generate`` (one jitted loop per batch). That order and padding are the
  benchmark's, so a harness score and ``psd_jax.cli.bench`` agree problem by problem. The decode
  length is ``gen_length`` capped by the request's ``max_gen_toks`` rounded up to whole blocks
  (the rounding is logged and recorded); the text is cut to ``max_gen_toks`` tokens, at the first
  EOS/EOT, then at the first ``until`` string, and special tokens are removed. The request's
  ``do_sample``/``temperature``/``top_p``/``top_k`` set its sampling; other generation kwargs are
  refused (``psd_jax.evaluate.gen_kwargs``).
- Prompts are encoded as the harness renders them (no special tokens added, unless
  ``add_special_tokens`` or ``add_bos_token``); chat templates come through the harness's
  ``--apply_chat_template``, which calls ``apply_chat_template`` here with the checkpoint's
  tokenizer.
- ``loglikelihood``: LLaDA's Monte Carlo estimator (``psd_jax.evaluate.loglikelihood``);
  ``loglikelihood_rolling``: the same bound over the whole text after one BOS/EOS token.
- DiffusionGemma decodes ``generate_until`` requests with its entropy-bound sampler (the
  release's settings unless model arguments say otherwise; a length capped by ``max_gen_toks`` in
  whole canvases) and has no likelihood: its ``loglikelihood`` requests are refused in one line.

Every request is encoded and checked against the model's context before the first model call.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..api import LoadedModel, load_model
from ..core.config import ENTROPY_BOUND_FAMILY, PER_BLOCK_STEPS, DecodeConfig
from ..core.errors import InputError
from ..core.lengths import check_context
from .args import EvalArgs, parse_eval_args
from .efficiency import EfficiencyLog
from .gen_kwargs import parse_gen_kwargs, request_settings
from .loglikelihood import Estimator, LikelihoodScorer, Prepared

log = logging.getLogger(__name__)

CREATED: list[PsdJaxLM] = []  # models made in this process, for the entry point's efficiency record


class _GenJob:
    """One ``generate_until`` request, encoded: ids, its settings and how its text is cut."""

    def __init__(self, ids: list[int], settings: DecodeConfig, until: list[str], max_tokens: int | None, task):
        self.ids, self.settings, self.until, self.max_tokens, self.task = ids, settings, until, max_tokens, task


@register_model("psd_jax")
class PsdJaxLM(LM):
    """A psd-jax model as a harness ``LM``; model arguments: ``psd_jax.evaluate.args``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.args: EvalArgs = parse_eval_args(kwargs)  # checked against the model's config before loading
        settings = self.args.settings
        self.lm: LoadedModel = self.args.start.load(load_model)  # the weights, with dtype=, mesh= and quantize=
        est = Estimator(
            mc_num=self.args.mc_num,
            mc_batch=self.args.mc_batch,
            cfg=self.args.cfg,
            seed=self.args.seed,
            draws_per_call=self.args.batch_size,
            bucket=self.args.prompt_bucket,
        )
        self.scorer = LikelihoodScorer(self.lm, est)
        self.efficiency = EfficiencyLog()
        self._noted: set = set()
        self.started = time.time()  # the efficiency record goes beside results written after this
        CREATED.append(self)
        log.info("psd_jax: %s, settings %s", self.args.pretrained, settings)

    # ------------------------------------------------------------------ chat templates
    @property
    def tokenizer_name(self) -> str:
        return str(self.args.pretrained).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not self.lm.has_chat_template:
            raise InputError(
                f"{self.args.pretrained}: --apply_chat_template needs a chat template; this tokenizer has none"
            )
        return self.lm.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The checkpoint's template rendered as text (the harness passes the text back as the prompt)."""
        self.chat_template()
        return self.lm.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # -------------------------------------------------------------------- tokenizing
    def _encode(self, text: str) -> list[int]:
        tokenizer = self.lm.tokenizer
        if tokenizer is None:
            raise InputError(f"{self.args.pretrained}: this checkpoint has no tokenizer, and harness requests are text")
        ids = [int(i) for i in tokenizer(text, add_special_tokens=self.args.add_special_tokens)["input_ids"]]
        bos = tokenizer.bos_token_id
        if self.args.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [int(bos), *ids]
        return ids

    def _prefix_token(self) -> list[int]:
        bos = self.lm.tokenizer.bos_token_id if self.lm.tokenizer is not None else None
        return [int(bos)] if bos is not None else [self.lm.config.eos_id]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """LLaDA's split: trailing spaces move to the continuation, whose ids are those of the whole
        text after the context's; an empty context becomes one BOS (or EOS) token."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return self._prefix_token(), self._encode(continuation)
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return ctx, whole[len(ctx) :]

    # ---------------------------------------------------------------- generate_until
    def _settings_for(self, max_tokens: int | None, task) -> DecodeConfig:
        """``gen_length`` capped by ``max_gen_toks`` rounded up to whole blocks (noted once per value)."""
        s = self.args.settings
        if max_tokens is None or max_tokens >= s.gen_length:
            return s
        blocks = math.ceil(max_tokens / s.block_length)
        # threshold_schedule and sequential count steps per block already; the others over the generation.
        steps = s.steps if s.steps is None or s.policy in PER_BLOCK_STEPS else s.steps_per_block * blocks
        capped = s.replace(gen_length=blocks * s.block_length, steps=steps)
        self.efficiency.task(task).gen_lengths[str(max_tokens)] = capped.gen_length
        if (task, max_tokens) not in self._noted:
            self._noted.add((task, max_tokens))
            log.warning(
                "psd_jax: %s: max_gen_toks %d decodes %d positions (%d blocks of %d); the text is cut to %d tokens",
                task,
                max_tokens,
                capped.gen_length,
                blocks,
                s.block_length,
                max_tokens,
            )
        return capped

    def _gen_job(self, request) -> _GenJob:
        context, task = request.args[0], request.task_name
        gen = parse_gen_kwargs(request.args[1])
        if gen.overridden and ("greedy", task) not in self._noted:
            self._noted.add(("greedy", task))
            log.warning("psd_jax: %s: do_sample=False decodes greedily (temperature %g not used)", task, gen.overridden)
        ids = self._encode(context)
        capped = self._settings_for(gen.max_tokens, task)
        settings = request_settings(capped, gen, self.args.decode_fields, f"task {task}'s generation kwargs")
        settings = self.lm.settings(settings)  # checked against the model (a filter its sampler ignores, ...)
        max_length = self.lm.config.max_length
        check_context(len(ids), self.args.prompt_bucket, settings.gen_length, max_length, f"a {task} request's prompt")
        return _GenJob(ids, settings, list(gen.until), gen.max_tokens, task)

    def _text(self, output_ids: list[int], tokens: int, job: _GenJob) -> str:
        ids = output_ids[:tokens][: job.max_tokens]
        text = self.lm.tokenizer.decode(ids, skip_special_tokens=False)
        for stop in job.until:
            text = text.split(stop)[0]
        for special in self.lm.tokenizer.all_special_tokens:
            text = text.replace(special, "")
        return text

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        jobs = [self._gen_job(r) for r in requests]  # every request checked before the first decode
        out: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[(job.task, job.settings)].append(i)
        for (task, settings), rows in groups.items():
            for start in range(0, len(rows), self.args.batch_size):
                chunk = rows[start : start + self.args.batch_size]
                results = self.lm.generate(
                    [jobs[i].ids for i in chunk], settings, seed=self.args.seed, prompt_bucket=self.args.prompt_bucket
                )
                self.efficiency.add_generations(task, results)
                for i, g in zip(chunk, results):
                    out[i] = self._text(g.output_ids, g.tokens, jobs[i])
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    # ----------------------------------------------------------------- loglikelihood
    def _counters(self) -> tuple:
        s = self.scorer
        return (s.calls, s.rows, s.seconds, s.compile_seconds)

    def _score(self, preps: list[Prepared], tasks: list, greedy: bool) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = [(0.0, False)] * len(preps)
        by_task: dict[Any, list[int]] = defaultdict(list)
        for i, task in enumerate(tasks):
            by_task[task].append(i)
        for task, rows in by_task.items():
            before = self._counters()
            values = self.scorer.loglikelihoods([preps[i] for i in rows])
            checks = self.scorer.greedy([preps[i] for i in rows], self.args.batch_size) if greedy else None
            self.efficiency.add_scoring(task, len(rows), before, self._counters())
            for j, i in enumerate(rows):
                out[i] = (values[j], bool(checks[j]) if checks else False)
        return out

    def _refuse_without_likelihood(self) -> None:
        """The Monte Carlo estimator masks tokens; DiffusionGemma has no mask token to score with."""
        if self.lm.config.family == ENTROPY_BOUND_FAMILY:
            raise InputError(
                f"{self.args.pretrained}: DiffusionGemma has no likelihood estimate (it re-noises, it does not "
                "mask): run generate_until tasks, not loglikelihood ones"
            )

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._refuse_without_likelihood()
        preps = [self.scorer.prepare(*self._encode_pair(*r.args)) for r in requests]
        out = self._score(preps, [r.task_name for r in requests], self.args.is_check_greedy)
        for r, value in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", r.args, value)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The bound over the whole text, conditioned on one BOS (or EOS) token; a text longer than
        the model's context is an error (no rolling windows)."""
        self._refuse_without_likelihood()
        preps = [self.scorer.prepare(self._prefix_token(), self._encode(r.args[0])) for r in requests]
        out = [ll for ll, _ in self._score(preps, [r.task_name for r in requests], greedy=False)]
        for r, value in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, value)
        return out

    # ----------------------------------------------------------------------- records
    def efficiency_record(self) -> dict[str, Any]:
        return {
            "model": str(self.args.pretrained),
            "settings": dict(vars(self.args.settings)),
            "estimator": dict(vars(self.scorer.est)),
            "tasks": self.efficiency.to_json(),
        }

    def get_model_info(self) -> dict[str, Any]:
        """Added by the harness to its results' ``config``: the settings and the efficiency record."""
        return {"psd_jax": self.efficiency_record()}
