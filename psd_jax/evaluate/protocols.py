"""The published evaluation protocols, by name: one table of what each upstream run did.

Each ``Protocol`` is one row of an upstream evaluation script (Fast-dLLM's LLaDA and Dream
scripts, Dream-Instruct's and Dream-Base's, LLaDA-Base's lm-eval script, LLaDA-Instruct's
OpenCompass settings in lm-eval form, LLaDA2.0-mini's card, DiffusionGemma's release): its source file, model, harness task,
shots, chat template, lengths, steps, blocks, policy, confidence, sampling, cache, batch size, how
the text is cut and scored, the published number and where it comes from, and what psd-jax cannot
match (``differs``; empty when it matches setting by setting). On top of every generation row of
the mask-token families, ``<name>-psd`` and ``<name>-rps`` run psd-jax's decoders over the same settings.

``harness_argv`` turns a protocol into the harness's command line for ``python -m
psd_jax.evaluate`` (``protocol_cli`` adds the user's own flags on top; ``--dry-run`` prints it);
``scripts/figures/protocol_table.py`` writes docs/evaluation.md's table from this module, so the two
cannot disagree.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # the project's own harness tasks
PACKAGE_TASKS = frozenset(path.stem for path in TASKS_DIR.glob("*.yaml"))
CODE_TASKS = frozenset(
    {"humaneval", "mbpp", "humaneval_fenced", "humaneval_instruct_dream", "mbpp_instruct_dream", "mbpp_fenced"}
)

FAST_DLLM = "NVlabs/Fast-dLLM@24cc59e"
LLADA = "ML-GSAI/LLaDA@b7e6c35"
DREAM = "DreamLM/Dream@fac0a7f"

UPSTREAM_LOOP = {"eos_early_stop": False}  # LLaDA's, Fast-dLLM's and Dream's loops decode every block
PSD = {"decoder": "psd", "depth": 3}  # psd-jax's recommended PSD depth (docs/benchmark.md)
RPS = {"decoder": "rps"}


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One published evaluation run, as its upstream script ran it."""

    name: str
    group: str  # the table section
    source: str  # upstream file(s) the settings come from
    model: str  # the Hugging Face checkpoint upstream evaluated
    family: str  # models' family name: llada, dream, llada2_moe, sdar, diffusion_gemma
    task: str  # harness task (psd_jax/evaluate/tasks holds the project's own)
    shots: int
    chat: bool  # the chat template, the whole prompt in one user turn unless multiturn
    decode: dict[str, Any] = dataclasses.field(default_factory=dict)  # DecodeConfig fields
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # temperature, top_p, top_k (else greedy)
    likelihood: dict[str, Any] = dataclasses.field(default_factory=dict)  # mc_num, mc_batch, cfg (loglikelihood tasks)
    multiturn: bool = False  # few-shot examples as separate chat turns
    batch_size: int = 1
    add_bos_token: bool = False
    add_special_tokens: bool = True  # tokenizer(text), as upstream encodes
    stop: str = "the task's stop strings"
    scoring: str = "the task's metric"
    published: str = "–"
    published_source: str = ""
    differs: str = ""
    base: str = ""  # for -psd / -rps rows: the protocol they run on top of

    @property
    def generates(self) -> bool:
        return not self.likelihood

    def model_args(self) -> dict[str, Any]:
        """The psd_jax model arguments (``pretrained`` is the Hugging Face id: pass a local directory)."""
        args: dict[str, Any] = {"pretrained": self.model, "dtype": "bfloat16"}
        args.update(self.decode if self.generates else {})
        args.update(self.likelihood)
        if self.add_bos_token:
            args["add_bos_token"] = True
        args["add_special_tokens"] = self.add_special_tokens
        return args

    def gen_kwargs(self) -> dict[str, Any]:
        """Generation kwargs over the task's: the protocol's sampling, and the full generation length
        (upstream decodes gen_length whatever the task's max_gen_toks says)."""
        if not self.generates:
            return {}
        if self.sampling:
            return {"do_sample": True, **self.sampling, "max_gen_toks": self.decode["gen_length"]}
        return {"do_sample": False, "max_gen_toks": self.decode["gen_length"]}

    def harness_argv(self) -> list[str]:
        """The harness's command line for this protocol (``psd_jax.evaluate``'s flags)."""
        argv = ["--model", "psd_jax", "--tasks", self.task]
        if self.task in PACKAGE_TASKS:
            argv += ["--include_path", str(TASKS_DIR)]
        argv += ["--num_fewshot", str(self.shots)]
        if self.chat:
            argv += ["--apply_chat_template"]
            if self.shots:
                argv += ["--fewshot_as_multiturn", "true" if self.multiturn else "false"]
        argv += ["--batch_size", str(self.batch_size), "--model_args", joined(self.model_args())]
        if self.gen_kwargs():
            argv += ["--gen_kwargs", joined(self.gen_kwargs())]
        if self.task in CODE_TASKS:
            argv += ["--confirm_run_unsafe_code"]
        return argv


def joined(args: dict[str, Any]) -> str:
    """``key=value,...`` as the harness parses it (booleans lower case)."""
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items())


# ----------------------------------------------------------------------------- Fast-dLLM

FAST_DLLM_COLUMNS = {  # the README's four columns and the scripts' five runs
    "baseline": ("LLaDA", {"policy": "fixed", "steps": 256, "cache": "none"}),
    "prefix": ("+Cache", {"policy": "fixed", "steps": 256, "cache": "prefix"}),
    "parallel": ("+Parallel", {"policy": "threshold", "threshold": 0.9, "cache": "none"}),
    "prefix-parallel": ("+Cache+Parallel", {"policy": "threshold", "threshold": 0.9, "cache": "prefix"}),
    "dual-parallel": ("+Cache+Parallel", {"policy": "threshold", "threshold": 0.9, "cache": "dual"}),
}
FAST_DLLM_README = {  # README.md, LLaDA table, gen length 256: accuracy %, tokens/s
    "gsm8k": {
        "LLaDA": "79.3%, 6.73 tok/s",
        "+Cache": "79.5%, 21.23 tok/s",
        "+Parallel": "79.2%, 16.53 tok/s",
        "+Cache+Parallel": "78.5%, 54.4 tok/s",
    },
    "humaneval": {
        "LLaDA": "41.5%, 30.5 tok/s",
        "+Cache": "42.7%, 40.73 tok/s",
        "+Parallel": "43.9%, 101.53 tok/s",
        "+Cache+Parallel": "43.3%, 114.1 tok/s",
    },
}


def _fast_dllm_llada() -> list[Protocol]:
    rows = []
    for task, shots, script in (("gsm8k", 5, "eval_gsm8k.sh"), ("humaneval", 0, "eval_humaneval.sh")):
        for run, (column, decode) in FAST_DLLM_COLUMNS.items():
            code = task == "humaneval"
            unnamed = (
                " (the README does not name the cache; both runs are in the script)"
                if column == "+Cache+Parallel"
                else ""
            )
            rows.append(
                Protocol(
                    name=f"fastdllm-llada-{task}-{run}",
                    group="Fast-dLLM, LLaDA-8B-Instruct",
                    source=f"{FAST_DLLM} llada/{script}, llada/eval_llada.py"
                    + (", llada/postprocess_code.py" if code else ""),
                    model="GSAI-ML/LLaDA-8B-Instruct",
                    family="llada",
                    task="humaneval_fenced" if code else task,
                    shots=shots,
                    chat=True,
                    decode={"gen_length": 256, "block_length": 32, **decode, **UPSTREAM_LOOP},
                    stop="none: the whole answer" if code else "the task's stop strings",
                    scoring="prompt + the answer's first fenced python block, sanitized (postprocess_code.py)"
                    if code
                    else "the task's metric",
                    published=FAST_DLLM_README[task][column],
                    published_source=f"{FAST_DLLM} README.md, LLaDA table, column {column!r}{unnamed}",
                )
            )
    return rows


def _fast_dllm_dream() -> list[Protocol]:
    first_position = (
        "Fast-dLLM's cached Dream path (generation_utils_block.py) commits each block's first position "
        "from the block-start forward whatever its confidence, then runs the block's policy; psd-jax's "
        "cached decode runs the policy from the block's first call"
    )
    runs = {
        "baseline": ({"policy": "dream", "confidence": "entropy", "steps": 256, "block_length": 256}, ""),
        "prefix": (
            {"policy": "dream", "confidence": "entropy", "steps": 256, "block_length": 32, "cache": "prefix"},
            first_position + " (its entropy schedule counts the block's other 31 steps)",
        ),
        "parallel": (
            {"policy": "threshold", "threshold": 0.9, "block_length": 256},
            "Fast-dLLM's uncached threshold path (generation_utils.py alg=confidence_threshold) has no blocks "
            "and commits at most 32 positions a step (gen_length / steps), carrying those under 0.9 to later "
            "steps; psd-jax commits every position >= 0.9 (and the most confident) over one 256-position block",
        ),
        "prefix-parallel": (
            {"policy": "threshold", "threshold": 0.9, "block_length": 32, "cache": "prefix"},
            first_position,
        ),
        "dual-parallel": (
            {"policy": "threshold", "threshold": 0.9, "block_length": 32, "cache": "dual"},
            first_position,
        ),
    }
    rows = []
    for task, shots, script in (("gsm8k", 5, "eval_gsm8k.sh"), ("humaneval", 0, "eval_humaneval.sh")):
        code = task == "humaneval"
        for run, (decode, differs) in runs.items():
            rows.append(
                Protocol(
                    name=f"fastdllm-dream-{task}-{run}",
                    group="Fast-dLLM, Dream-v0-Base-7B",
                    source=f"{FAST_DLLM} dream/{script}, dream/eval.py, dream/model/generation_utils"
                    + ("_block.py" if "cache" in decode else ".py")
                    + (", dream/postprocess_code.py" if code else ""),
                    model="Dream-org/Dream-v0-Base-7B",
                    family="dream",
                    task="humaneval_fenced" if code else task,
                    shots=shots,
                    chat=False,
                    decode={"gen_length": 256, **decode, **UPSTREAM_LOOP},
                    add_bos_token=True,
                    stop="none: the whole answer (escape_until=true)" if code else "the task's stop strings",
                    scoring="prompt + the answer's first fenced python block, sanitized (postprocess_code.py)"
                    if code
                    else "the task's metric",
                    published_source="no stored source: the README's table is LLaDA's",
                    differs=differs,
                )
            )
    return rows


# ---------------------------------------------------------------------------------- Dream


def _dream_instruct() -> list[Protocol]:
    source = f"{DREAM} eval_instruct/eval.sh, eval_instruct/lm_eval/models/diffllm.py"
    rows = []
    for name, task, length, task_file, differs in (
        ("gsm8k-cot", "gsm8k_cot", 256, "", ""),
        (
            "minerva-math",
            "minerva_math",
            512,
            "",
            "the answer check is the installed harness's minerva_math (math_verify against the solution, "
            "its newer normalisation); Dream's fork checks against the answer field with the older one",
        ),
        ("humaneval", "humaneval_instruct_dream", 768, "humaneval/humaneval_instruct.yaml", ""),
        ("mbpp", "mbpp_instruct_dream", 1024, "mbpp/mbpp_instruct.yaml", ""),
    ):
        code = task in CODE_TASKS
        rows.append(
            Protocol(
                name=f"dream-instruct-{name}",
                group="Dream-v0-Instruct-7B",
                source=source + (f", eval_instruct/lm_eval/tasks/{task_file}" if task_file else ""),
                model="Dream-org/Dream-v0-Instruct-7B",
                family="dream",
                task=task,
                shots=0,
                chat=True,
                decode={
                    "gen_length": length,
                    "block_length": length,
                    "steps": length,
                    "policy": "dream",
                    "confidence": "entropy",
                    **UPSTREAM_LOOP,
                },
                sampling={"temperature": 0.1, "top_p": 0.9},
                stop="the task's stop strings" + (" (the answer after the assistant prefix)" if code else ""),
                scoring={
                    "humaneval_instruct_dream": "prompt + fenced code, sanitized (build_predictions_instruct)",
                    "mbpp_instruct_dream": "the answer up to the closing fence, as is",
                }.get(task, "the task's metric"),
                published_source="no stored source: Dream's README gives no table",
                differs=differs,
            )
        )
    return rows


def _dream_base() -> list[Protocol]:
    rows = []
    for name, task, shots, length, temperature in (
        ("gsm8k-cot", "gsm8k_cot", 8, 256, 0.0),
        ("mbpp", "mbpp", 3, 512, 0.2),
        ("minerva-math", "minerva_math", 4, 512, 0.0),
        ("bbh", "bbh", 3, 512, 0.0),
        ("humaneval", "humaneval_fenced", 0, 512, 0.2),
    ):
        code = task == "humaneval_fenced"
        rows.append(
            Protocol(
                name=f"dream-base-{name}",
                group="Dream-v0-Base-7B",
                source=f"{DREAM} eval/eval_dream_gen.sh, eval/eval.py" + (", eval/postprocess_code.py" if code else ""),
                model="Dream-org/Dream-v0-Base-7B",
                family="dream",
                task=task,
                shots=shots,
                chat=False,
                decode={
                    "gen_length": length,
                    "block_length": length,
                    "steps": length,
                    "policy": "dream",
                    "confidence": "entropy",
                    **UPSTREAM_LOOP,
                },
                sampling={"temperature": temperature, "top_p": 0.95},
                add_bos_token=True,
                stop="none: the whole answer (escape_until=true)" if code else "the task's stop strings",
                scoring="prompt + the answer's first fenced python block, sanitized (postprocess_code.py)"
                if code
                else "the task's metric",
                published_source="no stored source: Dream's README gives no table",
                differs=(
                    "the answer check is the installed harness's minerva_math (newer than Dream's)"
                    if task == "minerva_math"
                    else "the installed harness's bbh puts no space before few-shot answers (its v4.0 config)"
                    if task == "bbh"
                    else ""
                ),
            )
        )
    return rows


# ---------------------------------------------------------------------------------- LLaDA

LLADA_BASE_GEN = (  # EVAL.md, "gen tasks of LLaDA-8B-Base", gen_length = steps = block_length = 1024
    ("bbh", "bbh", 3, "49.7%"),
    ("gsm8k", "gsm8k", 5, "70.3%"),
    ("minerva-math", "minerva_math", 4, "31.4%"),
    ("humaneval", "humaneval", 0, "35.4%"),
    ("mbpp", "mbpp", 3, "40.0%"),
)
LLADA_BASE_PPL = (  # eval_llada_lm_eval.sh (cfg, mc_num, batch size) and EVAL.md's ppl table
    ("gpqa", "gpqa_main_n_shot", 5, 0.5, 128, 8, "26.1%", "w/ CFG"),
    ("truthfulqa", "truthfulqa_mc2", 0, 2.0, 128, 8, "46.4%", "w/ CFG"),
    ("arc-challenge", "arc_challenge", 0, 0.5, 128, 8, "47.9%", "w/ CFG"),
    ("hellaswag", "hellaswag", 0, 0.5, 128, 8, "72.5%", "w/ CFG"),
    ("winogrande", "winogrande", 5, 0.0, 128, 8, "74.8%", "w/o CFG"),
    ("piqa", "piqa", 0, 0.5, 128, 8, "74.4%", "w/ CFG"),
    ("mmlu", "mmlu", 5, 0.0, 1, 1, "65.9%", "w/o CFG"),
    ("cmmlu", "cmmlu", 5, 0.0, 1, 1, "69.9%", "w/o CFG"),
    ("ceval", "ceval-valid", 5, 0.0, 1, 1, "70.5%", "w/o CFG"),
)


def _llada_base() -> list[Protocol]:
    source = f"{LLADA} eval_llada_lm_eval.sh, eval_llada.py"
    rows = []
    for name, task, shots, published in LLADA_BASE_GEN:
        rows.append(
            Protocol(
                name=f"llada-base-{name}",
                group="LLaDA-8B-Base (lm-eval)",
                source=source,
                model="GSAI-ML/LLaDA-8B-Base",
                family="llada",
                task=task,
                shots=shots,
                chat=False,
                decode={"gen_length": 1024, "block_length": 1024, "steps": 1024, "policy": "fixed", **UPSTREAM_LOOP},
                published=published,
                published_source=f"{LLADA} EVAL.md, LLaDA-8B-Base gen tasks, gen_length = steps = block_length = 1024",
                differs=(
                    "the installed harness's bbh puts no space before few-shot answers (its v4.0 config; LLaDA ran lm-eval 0.4.8)"
                    if task == "bbh"
                    else "the installed harness's minerva_math answer check is newer than lm-eval 0.4.8's"
                    if task == "minerva_math"
                    else ""
                ),
            )
        )
    for name, task, shots, cfg, mc_num, batch, published, column in LLADA_BASE_PPL:
        rows.append(
            Protocol(
                name=f"llada-base-{name}",
                group="LLaDA-8B-Base (lm-eval)",
                source=source,
                model="GSAI-ML/LLaDA-8B-Base",
                family="llada",
                task=task,
                shots=shots,
                chat=False,
                likelihood={"mc_num": mc_num, "mc_batch": batch, "cfg": cfg, "is_check_greedy": False},
                stop="–",
                scoring="LLaDA's Monte Carlo likelihood (accuracy)",
                published=published,
                published_source=f"{LLADA} EVAL.md, LLaDA-8B-Base ppl tasks, row {column!r}",
            )
        )
    return rows


OPENCOMPASS = "OpenCompass only: prompt, shots and scoring are lm-eval's here"


# LLaDA-8B-Instruct's OpenCompass rows: (name, task, shots, multiturn, decode, published, config file,
# how this protocol differs).
_LLADA_INSTRUCT_ROWS = (
    (
        "gsm8k-block8",
        "gsm8k_cot",
        4,
        True,
        {"gen_length": 256, "block_length": 8, "steps": 256},
        "78.9% (internal toolkit: 78.6%)",
        "llada_instruct_gen_gsm8k_length256_block8.py",
        "OpenCompass's gsm8k_gen_1d7fe4 (its own 4 exemplars as chat turns, last number scored); "
        "here the harness's gsm8k_cot with its first 4 exemplars as chat turns",
    ),
    (
        "gsm8k-512",
        "gsm8k_cot",
        4,
        True,
        {"gen_length": 512, "block_length": 512, "steps": 512, "confidence_eos_eot_inf": True},
        "68.8% (internal toolkit: 69.4%)",
        "llada_instruct_gen_gsm8k_length512_block512_confidence.py",
        "OpenCompass's gsm8k_gen_1d7fe4 (its own 4 exemplars as chat turns, last number scored); "
        "here the harness's gsm8k_cot with its first 4 exemplars as chat turns",
    ),
    (
        "math-block64",
        "minerva_math",
        0,
        False,
        {"gen_length": 512, "block_length": 64, "steps": 512},
        "42.7% (internal toolkit: 42.2%)",
        "llada_instruct_gen_math_length512_block64.py",
        "OpenCompass's math_0shot_gen_11c4b5 (\\boxed{} instruction, MATHEvaluator v2); here the harness's "
        "minerva_math prompt and answer check, 0-shot",
    ),
    (
        "math-512",
        "minerva_math",
        0,
        False,
        {"gen_length": 512, "block_length": 512, "steps": 512, "confidence_eos_eot_inf": True},
        "29.6% (internal toolkit: 31.9%)",
        "llada_instruct_gen_math_length512_block512_confidence.py",
        "OpenCompass's math_0shot_gen_11c4b5 (\\boxed{} instruction, MATHEvaluator v2); here the harness's "
        "minerva_math prompt and answer check, 0-shot",
    ),
    (
        "humaneval-512",
        "humaneval_fenced",
        0,
        False,
        {"gen_length": 512, "block_length": 512, "steps": 512, "logits_eos_inf": True},
        "47.0% (internal toolkit: 49.4%)",
        "llada_instruct_gen_humaneval_length512_block512_logits.py",
        "OpenCompass's humaneval_gen_8e312c ('Complete the following python code:' + prompt, "
        "humaneval_postprocess_v2); here the bare prompt and Fast-dLLM's fenced-code post-processing",
    ),
    (
        "mbpp-256",
        "mbpp_fenced",
        0,
        False,
        {"gen_length": 256, "block_length": 256, "steps": 256, "confidence_eos_eot_inf": True},
        "39.6% (internal toolkit: 41.0%)",
        "llada_instruct_gen_mbpp_length256_block256_confidence.py",
        "OpenCompass's mbpp_gen (its few-shot prompt and extraction); here Dream-Instruct's MBPP prompt, "
        "0-shot, with the answer's fenced code tested",
    ),
)


def _llada_instruct() -> list[Protocol]:
    examples = f"{LLADA} EVAL.md (LLaDA-8B-Instruct tables), opencompass/examples/"
    rows = []
    for name, task, shots, multiturn, decode, published, config, differs in _LLADA_INSTRUCT_ROWS:
        code = task in CODE_TASKS
        rows.append(
            Protocol(
                name=f"llada-instruct-{name}",
                group="LLaDA-8B-Instruct (OpenCompass settings in lm-eval form)",
                source=examples + config,
                model="GSAI-ML/LLaDA-8B-Instruct",
                family="llada",
                task=task,
                shots=shots,
                chat=True,
                multiturn=multiturn,
                decode={"policy": "fixed", **decode, **UPSTREAM_LOOP},
                stop="none: the whole answer" if code else "the task's stop strings",
                scoring="the answer's fenced code" + (", sanitized" if task == "humaneval_fenced" else "")
                if code
                else "the task's metric",
                published=published,
                published_source=f"{LLADA} EVAL.md, LLaDA-8B-Instruct, row 'OpenCompass'",
                differs=f"{OPENCOMPASS}: {differs}",
            )
        )
    return rows


def _chat_settings_rows(prefix: str, **fields: Any) -> list[Protocol]:
    """Zero-shot chat rows of a checkpoint that publishes generation settings, not an evaluation
    protocol: GSM8K and HumanEval (the whole answer, its first fenced block scored), the prompt the
    chat template encoded without added special tokens. ``fields``: the rest of each ``Protocol``."""
    rows = []
    for name, task, code in (("gsm8k", "gsm8k", False), ("humaneval", "humaneval_fenced", True)):
        rows.append(
            Protocol(
                name=f"{prefix}-{name}",
                task=task,
                shots=0,
                chat=True,
                add_special_tokens=False,
                stop="none: the whole answer" if code else "the task's stop strings",
                scoring="prompt + the answer's first fenced python block, sanitized" if code else "the task's metric",
                **fields,
            )
        )
    return rows


def _llada2_mini() -> list[Protocol]:
    card = {
        "gen_length": 512,
        "block_length": 32,
        "steps": 32,
        "policy": "threshold_schedule",
        "threshold": 0.95,
        "eos_early_stop": True,
    }
    # The card encodes with apply_chat_template(tokenize=True): no added special tokens.
    return _chat_settings_rows(
        "llada2-mini",
        group="LLaDA2.0-mini (the card's generation settings)",
        source="inclusionAI/LLaDA2.0-mini model card (usage: gen_length 512, block_length 32, steps 32, "
        "temperature 0, eos_early_stop) and LLaDA2MoeModelLM.generate's defaults (threshold 0.95)",
        model="inclusionAI/LLaDA2.0-mini",
        family="llada2_moe",
        decode=card,
        published_source="no stored source",
        differs="the card gives generation settings, not an evaluation protocol: task, shots and prompt "
        "are this table's choice; the card itself is not stored here (its settings as quoted in stored code)",
    )


def _llada21_mini() -> list[Protocol]:
    """LLaDA2.1-mini's two decoding modes (token editing, ``decoder="edit"``) at diffusers'
    ``LLaDA2Pipeline`` usage lengths."""
    lengths = {"gen_length": 256, "block_length": 32, "steps": 32, "policy": "threshold_schedule", "decoder": "edit"}
    modes = {
        "quality": {"threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 16},
        "speed": {"threshold": 0.5},
    }
    rows = []
    for mode, fields in modes.items():
        rows += _chat_settings_rows(
            f"llada21-mini-{mode}",
            group="LLaDA2.1-mini (the release's two modes)",
            source="inclusionAI/LLaDA2.1-mini's modes (quality: threshold 0.7, editing_threshold 0.5; speed: "
            "threshold 0.5, editing off) as the goldens of diffusers' LLaDA2Pipeline quote them, and the "
            "pipeline's usage example (gen_length 256, block_length 32, num_inference_steps 32, max_post_steps 16, "
            "temperature 0)",
            model="inclusionAI/LLaDA2.1-mini",
            family="llada2_moe",
            decode={**lengths, **fields, "eos_early_stop": True},
            published_source="the card's table (S and Q mode, score and TPF per benchmark) is not stored here",
            differs="the card gives modes, not an evaluation protocol: task, shots, prompt and lengths are "
            "this table's choice",
        )
    return rows


def _sdar_chat() -> list[Protocol]:
    reported = {
        "gen_length": 512,
        "block_length": 4,
        "steps": 4,
        "policy": "threshold_schedule",
        "threshold": 1.0,
        "eos_early_stop": True,
    }
    # generate.py encodes the templated text without added special tokens.
    return _chat_settings_rows(
        "sdar-8b",
        group="SDAR-8B-Chat (the reported inference settings)",
        source="JetAstra/SDAR README ('block_length = 4, denoising_steps = 4, greedy decoding') and "
        "generate.py (chat template, add_special_tokens=False, stop list from generation_config.json)",
        model="JetLM/SDAR-8B-Chat",
        family="sdar",
        decode=reported,
        published_source="the README's table is an image; its numbers are not stored here",
        differs="SDAR reports OpenCompass runs; task, shots, prompt and gen_length are this table's choice",
    )


def _diffusion_gemma() -> list[Protocol]:
    release = {
        "gen_length": 256,
        "entropy_bound": 0.1,
        "max_denoising_steps": 48,
        "t_min": 0.4,
        "t_max": 0.8,
        "stability_threshold": 1,
        "confidence_threshold": 0.005,
    }
    return _chat_settings_rows(
        "diffusiongemma-26b",
        group="DiffusionGemma-26B-A4B (the release's generation settings)",
        source="google/diffusiongemma-26B-A4B-it generation_config.json (max_new_tokens 256, entropy bound 0.1, "
        "48 steps, t 0.8 -> 0.4, stability 1, confidence 0.005) and transformers 5.23's "
        "DiffusionGemmaForBlockDiffusion.generate",
        model="google/diffusiongemma-26B-A4B-it",
        family="diffusion_gemma",
        decode=release,
        published_source="no stored source",
        differs="the release gives generation settings, not an evaluation protocol: task, shots and prompt are "
        "this table's choice; the sampler draws from psd-jax's own PRNG, so scores agree with upstream's in "
        "distribution, not sample by sample",
    )


# ----------------------------------------------------------------------------- the table


def on_top(base: Protocol, decoder: dict[str, Any], suffix: str) -> Protocol:
    """``base`` decoded by psd-jax's PSD or RPS over the same settings."""
    return dataclasses.replace(
        base,
        name=f"{base.name}-{suffix}",
        decode={**base.decode, **decoder},
        published="–",
        published_source="",
        differs="",
        base=base.name,
    )


def _table() -> dict[str, Protocol]:
    published = [
        *_fast_dllm_llada(),
        *_fast_dllm_dream(),
        *_dream_instruct(),
        *_dream_base(),
        *_llada_base(),
        *_llada_instruct(),
        *_llada2_mini(),
        *_llada21_mini(),
        *_sdar_chat(),
        *_diffusion_gemma(),
    ]
    rows = list(published)
    for base in published:
        # DiffusionGemma's one sampler and token editing's own block end: no PSD or RPS on top.
        if base.generates and base.family != "diffusion_gemma" and base.decode.get("decoder") != "edit":
            rows += [on_top(base, PSD, "psd"), on_top(base, RPS, "rps")]
    table = {p.name: p for p in rows}
    if len(table) != len(rows):
        raise AssertionError("protocol names must be unique")
    return table


PROTOCOLS: dict[str, Protocol] = _table()

GROUP_NOTES: dict[str, str] = {
    "Fast-dLLM, LLaDA-8B-Instruct": (
        "eval_llada.py wraps the harness's plain prompt (few-shot examples included) in one user turn of "
        "the chat template and encodes it with tokenizer(text): here --apply_chat_template "
        "--fewshot_as_multiturn false and add_special_tokens=true give the same ids. It decodes gen_length "
        "tokens whatever the task's max_gen_toks, at temperature 0, one prompt at a time, every block (no "
        "early stop; its steps = gen_length / block_length with a threshold is unused). It cuts GSM8K's "
        "text at the stop strings and then drops special tokens, keeping any text after an end-of-turn "
        "token (LLaDA-Instruct writes EOS padding there); psd-jax cuts at the first EOS/EOT."
    ),
    "Fast-dLLM, Dream-v0-Base-7B": (
        "dream/eval.py prepends the BOS token to the plain prompt (add_bos_token=true), decodes gen_length "
        "tokens at temperature 0 with alg=entropy (Dream's entropy confidence and schedule, one block "
        "without a cache) or alg=confidence_threshold, and cuts the text at EOS. Only the baseline runs "
        "the same algorithm here; each other row says what differs."
    ),
    "Dream-v0-Instruct-7B": (
        "diffllm.py decodes max_new_tokens = diffusion_steps positions in one block with Dream's entropy "
        "schedule at temperature 0.1 and top_p 0.9 (sample_tokens: the confidence is scored on the "
        "tempered, filtered distribution; psd_jax.core.sampling does the same), ignoring the tasks' "
        "generation kwargs: here they are set by --gen_kwargs. Sampling draws from psd-jax's own PRNG, "
        "so scores agree in distribution, not sample by sample. Its text is cut at EOS, keeping special "
        "tokens; psd-jax cuts at the first EOS/EOT and removes them."
    ),
    "Dream-v0-Base-7B": (
        "eval/eval.py prepends the BOS token, decodes max_new_tokens = diffusion_steps in one block with "
        "Dream's entropy schedule and top_p 0.95 (applied at temperature 0 too, as sample_tokens does), "
        "and cuts at EOS; HumanEval keeps the whole answer (escape_until) for postprocess_code.py. "
        "Sampled rows draw from psd-jax's own PRNG."
    ),
    "LLaDA-8B-Base (lm-eval)": (
        "eval_llada.py encodes the plain prompt with tokenizer(text), decodes with LLaDA's generate "
        "(one token per step, one 1024-position block, temperature 0), cuts at the stop strings and drops "
        "special tokens; likelihood tasks use its Monte Carlo estimator (mc_batch = its --batch_size). "
        "Upstream ran lm-eval 0.4.8; the task prompts used here are unchanged in the installed harness "
        "except where a row says. Monte Carlo masks are psd-jax's own draws (keyed by the seed)."
    ),
    "LLaDA-8B-Instruct (OpenCompass settings in lm-eval form)": (
        "LLaDA-8B-Instruct's generation scores were produced with OpenCompass (EVAL.md: 'Both LLaDA-8B-Instruct "
        "and LLaDA 1.5 are evaluated ... OpenCompass'). These rows run its decoding settings (lengths, blocks, "
        "steps = gen_length, logits_eos_inf, confidence_eos_eot_inf, batch 1) on the closest lm-eval tasks; "
        "the prompts and answer checks are not OpenCompass's, so the published numbers are a reference, "
        "not a target."
    ),
    "LLaDA2.0-mini (the card's generation settings)": (
        "LLaDA2.0's generate (threshold_schedule: steps per block, threshold 0.95) at the card's usage "
        "settings; the prompt is the chat template encoded without added special tokens, as "
        "apply_chat_template(tokenize=True) does."
    ),
    "DiffusionGemma-26B-A4B (the release's generation settings)": (
        "The entropy-bound sampler (transformers' generate: random canvases re-noised each step, self-conditioning, "
        "adaptive stopping) at the release's settings, 256 new tokens in one canvas; the prompt is the chat "
        "template encoded without added special tokens. The family has one sampler (no PSD or RPS rows) and no "
        "likelihood (no loglikelihood tasks)."
    ),
    "LLaDA2.1-mini (the release's two modes)": (
        "LLaDA2.1's token editing (decoder edit, exact against diffusers' LLaDA2Pipeline): threshold_schedule fills "
        "the block, every call also rewrites written tokens the model now prefers with probability above the editing "
        "threshold, and a filled block is re-run while it edits (at most max_post_steps + 1 calls). Quality mode edits "
        "at 0.5 over a 0.7 fill; speed mode fills at 0.5 without editing. The prompt is the chat template encoded "
        "without added special tokens."
    ),
    "SDAR-8B-Chat (the reported inference settings)": (
        "SDAR's evaluation decoder at its reported settings (threshold_schedule with threshold 1: the "
        "static schedule, 4 steps per block of 4, greedy), stopping after the block that holds a stop id "
        "(<|im_end|> or <|endoftext|>); the prompt is the chat template encoded without added special tokens."
    ),
}


def published() -> list[Protocol]:
    """The upstream rows (no -psd / -rps), in table order."""
    return [p for p in PROTOCOLS.values() if not p.base]


def derived(base: Protocol) -> list[Protocol]:
    return [p for p in PROTOCOLS.values() if p.base == base.name]
