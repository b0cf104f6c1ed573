"""``python -m psd_jax.bench``: every decoder's speed against quality on one dataset.

Every decoder setting runs the same prompts in the same batches, interleaved (each batch by every
setting in turn, so a slow phase of the machine falls on all of them); compilation (ahead of time)
is timed separately and excluded, a batch that needed a fresh executable is decoded once untimed
as warm-up, and each batch is timed with ``block_until_ready``. The headline is time: each
setting's tokens/s against the upstream baseline, one token per step without a cache (LLaDA's
``generate.py``: ``fixed-1/none``, always run first), measured in the same run, with the paired
accuracy difference against it beside it; exact-answer accuracy, tokens per forward (TPF, exact and
machine-independent), NFE per prompt and sequence forwards are the secondary columns, and each
setting's model calls by shape (``psd_jax.core.calls``). ``--latency N`` also times the first N problems
one at a time (batch 1): the time per answer, median and 95th percentile. Writes JSON, a Markdown
table and a Pareto plot (accuracy against tokens/s, and against TPF).

A setting's name may carry its cache after a slash (``threshold-0.9/dual``, ``fixed-1/none``), so
one run compares cached and uncached settings on the same batches; a name without one takes
``--cache`` (default dual). Results name every setting with its cache.

``--decoders recommended`` (opt-in) adds the model directory's recommended setting
(``recommended.json``, else ``config.RECOMMENDED``) on the bench's generation length. It is a
whole setting, not a variation of the matrix's base: its own block length and cache win over the
directory's block length and the bench's default ``--cache dual``; ``--block-length`` and
``--cache`` given on the command line still override it.

DiffusionGemma has one sampler and its own setting names (``entropy-bound-0.3``,
``entropy-bound-0.1-s24``: ``psd_jax.names``). Its baseline is the directory's release settings
(``generation_config.json``, with any sampler flag given over them), which upstream's ``generate``
runs; the default matrix varies the entropy bound, the steps and adaptive stopping around it. Its
TPF is upstream's ``tokens_per_forward``: the ids written (pad aside) per denoising pass.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from ..api import LoadedModel
from ..core.config import (
    CACHE_NAME_HELP,
    ENTROPY_BOUND_FIELDS,
    DecodeConfig,
    DecodeConfigError,
    cache_fields,
    check_for_model,
)
from ..core.errors import InputError
from ..core.lengths import check_questions
from ..model_dir import model_settings
from ..names import entropy_bound_fields, entropy_bound_name, setting_fields
from ..parallel import multihost
from ..recommended import NAME as RECOMMENDED_NAME
from ..recommended import read_recommended
from ..scoring import is_correct, load_jsonl
from .flags import (
    EXIT_BAD_INPUT,
    ArgumentParser,
    add_cluster_flags,
    add_decode_flags,
    add_problem_set_flags,
    decode_fields,
    non_negative_int,
)
from .startup import FrontEndStart

BASELINE = "fixed-1/none"  # LLaDA's generate.py: one token per step, no cache; every speedup is against it
SCHEDULE = (
    "schedule-0.95"  # LLaDA2.0's own rule at its generate's defaults (threshold 0.95, block_length steps per block)
)
# Settings of the matrix a default run leaves out, to keep it short on 2 CPU cores (--all or
# --decoders runs them): depth 5 of PSD, which lies between depths 3 and 7 on every base, and RPS
# on one token per step (9% more TPF than fixed-1, a sixth of the whole matrix's time). Measured
# in docs/bench (500 problems, commit 367be3c, before the warm-up decode of each fresh
# executable): all 28 settings 12 min 4 s of decoding and compiling, the default 22 of them 7.4 min.
# LLaDA2.0's threshold_schedule and PSD / RPS on it are opt-in too: the family's settings
# (``--decoders schedule-0.95,psd-schedule-0.95-d3``), not the others'.
OPT_IN = (
    "psd-fixed-1-d5",
    "psd-fixed-2-d5",
    "psd-fixed-4-d5",
    "psd-threshold-0.9-d5",
    "psd-threshold-0.7-d5",
    "rps-fixed-1",
    SCHEDULE,
    *(f"psd-{SCHEDULE}-d{depth}" for depth in (1, 3, 5, 7)),
    f"rps-{SCHEDULE}",
    RECOMMENDED_NAME,
)


@dataclass
class Row:
    name: str
    settings: dict
    nfe: int = 0
    tokens: int = 0
    sequence_forwards: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    correct_by_problem: list[int] = field(default_factory=list)  # 1/0 per problem, in order
    extra: dict = field(default_factory=dict)
    calls: dict[str, dict] = field(default_factory=dict)  # the batches' model calls by shape, summed
    latency: list[float] = field(default_factory=list)  # seconds per answer at batch 1 (--latency)
    batch_tokens: list[int] = field(default_factory=list)  # per batch, in order: what the speed interval resamples
    batch_seconds: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.correct_by_problem)

    def summary(self) -> dict:
        extra = dict(self.extra)
        if "decoder_passes" in extra:  # DiffusionGemma: TPF as upstream's tokens_per_forward, over every row
            extra["tokens_per_forward"] = extra["generated_ids"] / max(extra["decoder_passes"], 1)
        if "answer_blocks" in extra:  # token editing: edits per block of the answers
            extra["edits_per_block"] = extra["edits"] / max(extra["answer_blocks"], 1)
        return {
            "name": self.name,
            "accuracy": sum(self.correct_by_problem) / max(self.n, 1),
            "n": self.n,
            "nfe_per_prompt": self.nfe / max(self.n, 1),
            "tpf": extra.get("tokens_per_forward", self.tokens / max(self.nfe, 1)),
            "tokens": self.tokens,
            "sequence_forwards": self.sequence_forwards,
            "tokens_per_second": self.tokens / self.seconds if self.seconds else float("nan"),
            "seconds": self.seconds,
            "compile_seconds": self.compile_seconds,
            **latency_summary(self.latency),
            "settings": self.settings,
            "correct_by_problem": "".join(map(str, self.correct_by_problem)),
            "batch_tokens": self.batch_tokens,
            "batch_seconds": self.batch_seconds,
            "calls": list(self.calls.values()),
            **extra,
        }

    def add_calls(self, calls: list[dict]) -> None:
        """One batch's call records (``Generation.calls``) into the row's sums by shape and batch."""
        for call in calls:
            key = (call["kind"], call["candidates"], call["positions"], call["batch"])
            total = self.calls.setdefault(str(key), {**call, "count": 0})
            total["count"] += call["count"]


def latency_summary(seconds: list[float]) -> dict:
    """Per-answer seconds at batch 1: how many, the median and the 95th percentile (none when not
    measured)."""
    if not seconds:
        return {}
    return {
        "latency_n": len(seconds),
        "latency_p50": float(np.percentile(seconds, 50)),
        "latency_p95": float(np.percentile(seconds, 95)),
    }


MATRIX_BASES = ("fixed-1", "fixed-2", "fixed-4", "threshold-0.9", "threshold-0.7", SCHEDULE)


def matrix_names() -> list[str]:
    """The matrix's settings: fixed 1/2/4 tokens per step, threshold 0.9/0.7, LLaDA2.0's threshold
    schedule, PSD at depths 1/3/5/7 on each, RPS on four. Any other name of ``psd_jax.names``'
    grammar runs too (``--decoders psd-fixed-1-d15-next-conf0.95/dual+v16``)."""
    names = list(MATRIX_BASES)
    names += [f"psd-{name}-d{depth}" for name in MATRIX_BASES for depth in (1, 3, 5, 7)]
    return names + [f"rps-{name}" for name in ("fixed-1", "threshold-0.9", "threshold-0.7", SCHEDULE)]


def split_name(name: str) -> tuple[str, str | None]:
    """``"threshold-0.9/dual"`` -> ``("threshold-0.9", "dual")``; a name without a cache -> (name, None)."""
    setting, slash, cache = name.partition("/")
    return setting, (cache if slash else None)


def decoder_matrix(base: DecodeConfig, names: list[str] | None = None) -> dict[str, DecodeConfig]:
    """DecodeConfigs of the named settings (default: the matrix, on ``base``'s cache) on ``base``'s
    lengths, each keyed by its name with its cache (``fixed-1/none``, and its block length where the
    name gives one): a name's own cache and block length win over ``base``'s. Only the named ones
    are built, so a setting the lengths do not allow (``fixed-2`` at block length 1) fails only when
    asked for."""
    out = {}
    for name in matrix_names() if names is None else names:
        try:
            fields = setting_fields(name, base.gen_length)
        except DecodeConfigError as exc:
            raise InputError(f"{name}: {exc}; see --list") from None
        settings = base.replace(**{**cache_fields(base.cache_name), **fields})
        block = f"/b{settings.block_length}" if "block_length" in fields else ""
        out[f"{split_name(name)[0]}/{settings.cache_name}{block}"] = settings
    return out


def run_setting(
    lm: LoadedModel,
    name: str,
    settings: DecodeConfig,
    examples: list[dict],
    batch: int,
    chat: bool | None,
    prompt_bucket: int,
    progress=None,
    latency: int = 0,
) -> Row:
    """One decoder setting over every batch, then (``latency``) its first problems one at a time.
    Compilation is ahead of time (``LoadedModel``) and reported apart. A batch that needed a fresh
    executable (the setting's first, or a new prompt bucket) is decoded again and the second run is
    the one timed (``generate(warm=True)``): an executable's first run carries one-off costs, which
    would otherwise be charged to whichever setting runs first in its shapes."""
    row = Row(name, dict(vars(settings)))
    for chunk in batches_of(examples, batch):
        add_batch(lm, row, settings, chunk, chat, prompt_bucket)
        if progress is not None:
            progress.update(len(chunk))
    for ex in examples[:latency]:  # the same decodes at batch 1: time per answer
        add_latency(lm, row, settings, ex, chat, prompt_bucket)
    return row


def batches_of(examples: list[dict], batch: int) -> list[list[dict]]:
    return [examples[i : i + batch] for i in range(0, len(examples), batch)]


def add_batch(
    lm: LoadedModel, row: Row, settings: DecodeConfig, chunk: list[dict], chat: bool | None, prompt_bucket: int
) -> None:
    """One batch of ``chunk`` decoded with ``settings`` and timed, its results added to ``row``."""
    results = _timed_generate(lm, [ex["question"] for ex in chunk], settings, chat, prompt_bucket, row)
    row.batch_seconds.append(results[0].seconds)
    row.batch_tokens.append(sum(r.tokens for r in results))
    row.sequence_forwards += results[0].sequence_forwards
    row.add_calls(results[0].calls)
    for r, ex in zip(results, chunk):
        row.correct_by_problem.append(int(is_correct(r.text or "", ex)))
        row.nfe += r.nfe
        row.tokens += r.tokens
        for key, value in r.stats.items():
            row.extra[key] = (np.asarray(row.extra.get(key, 0)) + np.asarray(value)).tolist()
        if "edits" in r.stats:  # token editing: the blocks the answer (up to its EOS) spans
            spanned = min(-(-(r.tokens + 1) // settings.block_length), settings.num_blocks)
            row.extra["answer_blocks"] = row.extra.get("answer_blocks", 0) + spanned


def add_latency(
    lm: LoadedModel, row: Row, settings: DecodeConfig, example: dict, chat: bool | None, prompt_bucket: int
) -> None:
    """``example`` alone (batch 1) decoded with ``settings``: its time per answer added to ``row``."""
    row.latency.append(_timed_generate(lm, [example["question"]], settings, chat, prompt_bucket, None)[0].seconds)


def _timed_generate(lm: LoadedModel, texts: list[str], settings: DecodeConfig, chat, bucket: int, row: Row | None):
    """``generate`` of a warm executable, its compilation and decode seconds added to ``row``."""
    results = lm.generate(texts, settings, chat=chat, prompt_bucket=bucket, warm=True)
    if row is not None:
        row.compile_seconds += results[0].compile_seconds
        row.seconds += results[0].seconds
    return results


def paired_difference(correct_a: str, correct_b: str) -> dict:
    """Accuracy of B minus A over the same problems (``correct_by_problem`` strings of two runs),
    with the standard error of that paired difference and the discordant counts. Two settings
    that agree on most problems differ far less by chance than their two accuracies' own errors
    suggest, so this is the error to judge a small accuracy change by."""
    if len(correct_a) != len(correct_b) or not correct_a:
        raise InputError(f"the runs scored different problem counts ({len(correct_a)} and {len(correct_b)})")
    a, b = (np.array([c == "1" for c in s], float) for s in (correct_a, correct_b))
    d, n = b - a, len(a)
    se = float(d.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return {
        "n": n,
        "accuracy_a": a.mean(),
        "accuracy_b": b.mean(),
        "difference": float(d.mean()),
        "standard_error": se,
        "only_a": int(((a == 1) & (b == 0)).sum()),
        "only_b": int(((a == 0) & (b == 1)).sum()),
    }


def rate_ratio_interval(
    tokens: np.ndarray, seconds: np.ndarray, base_tokens: np.ndarray, base_seconds: np.ndarray, draws: int = 2000
) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of (sum tokens / sum seconds) over (the base's), from
    paired groups (the same problems decoded by both: a batch, which is the unit whose seconds are
    measured). Each draw resamples the groups with replacement, pairs kept; seeded, so a report is
    reproducible."""
    groups = np.stack([np.asarray(a, np.float64) for a in (tokens, seconds, base_tokens, base_seconds)], axis=1)
    picks = np.random.default_rng(0).integers(0, len(groups), size=(draws, len(groups)))
    totals = groups[picks].sum(axis=1)  # [draws, 4]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (totals[:, 0] / totals[:, 1]) / (totals[:, 2] / totals[:, 3])
    low, high = np.nanpercentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def with_speedups(summaries: list[dict], baseline: str = BASELINE) -> list[dict]:
    """Each summary with its speedups over the baseline (``baseline``, measured in the same run):
    tokens/s with its 95% interval over the interleaved batches (``rate_ratio_interval``: batch i of
    every setting ran the same problems back to back), TPF and, at batch 1, the median latency; and
    its accuracy difference against the baseline on the same problems, paired
    (``paired_difference``: points and their standard error)."""
    base = next((s for s in summaries if s["name"] == baseline), None)
    if base is None:
        return summaries
    for s in summaries:
        s["baseline"] = baseline
        s["speedup_tokens_per_second"] = s["tokens_per_second"] / base["tokens_per_second"]
        if s.get("batch_seconds") and len(s["batch_seconds"]) == len(base.get("batch_seconds", [])):
            s["speedup_tokens_per_second_interval"] = list(
                rate_ratio_interval(s["batch_tokens"], s["batch_seconds"], base["batch_tokens"], base["batch_seconds"])
            )
        s["speedup_tpf"] = s["tpf"] / base["tpf"]
        if "latency_p50" in s and "latency_p50" in base:
            s["speedup_latency"] = base["latency_p50"] / s["latency_p50"]
        pair = paired_difference(base["correct_by_problem"], s["correct_by_problem"])
        s["accuracy_difference"], s["accuracy_standard_error"] = pair["difference"], pair["standard_error"]
    return summaries


def _cell(summary: dict, key: str, form: str) -> str:
    """A cell of ``summary[key]`` in ``form``; "–" where the run did not measure it (no baseline, no
    latency run)."""
    return form.format(summary[key]) if key in summary else "–"


def _speedup(summary: dict) -> str:
    """The tokens/s ratio over the baseline, with its 95% interval over batches where measured."""
    if "speedup_tokens_per_second" not in summary:
        return "–"
    cell = f"{summary['speedup_tokens_per_second']:.2f}x"
    spread = summary.get("speedup_tokens_per_second_interval")
    if spread and summary["name"] != summary.get("baseline"):
        cell += f" ({spread[0]:.2f}–{spread[1]:.2f})"
    return cell


def _difference(summary: dict) -> str:
    if summary["name"] == summary.get("baseline") or "accuracy_difference" not in summary:
        return "–"
    se = summary["accuracy_standard_error"]
    return f"{100 * summary['accuracy_difference']:+.1f} ± {100 * se:.1f}" if se == se else "–"


def markdown_table(summaries: list[dict]) -> str:
    edits = any("edits_per_block" in s for s in summaries)  # a token-editing row: its edits per block
    head = (
        "| decoder | tokens/s | speedup (tok/s, 95% interval) | accuracy | vs baseline (points) | TPF | TPF ratio | NFE/prompt "
        "| latency p50 s | p95 s | compile s |" + (" edits/block |" if edits else "") + "\n"
    )
    head += "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (
        " ---: |" if edits else ""
    )
    head += "\n"
    lines = [
        f"| {s['name']} | {s['tokens_per_second']:.1f} | {_speedup(s)} | "
        f"{100 * s['accuracy']:.1f}% | {_difference(s)} | {s['tpf']:.2f} | {_cell(s, 'speedup_tpf', '{:.2f}x')} | "
        f"{s['nfe_per_prompt']:.1f} | {_cell(s, 'latency_p50', '{:.3f}')} | {_cell(s, 'latency_p95', '{:.3f}')} | "
        f"{s['compile_seconds']:.1f} |" + (f" {_cell(s, 'edits_per_block', '{:.2f}')} |" if edits else "")
        for s in summaries
    ]
    return head + "\n".join(lines) + "\n"


PLOT_AXES = (("tokens_per_second", "tokens/s (warm)"), ("tpf", "tokens per forward (TPF)"))


def pareto_plot(
    summaries: list[dict],
    path: Path,
    title: str,
    axes: tuple[tuple[str, str], ...] = PLOT_AXES,
    frontier: list[str] | None = None,
    chosen: str | None = None,
) -> None:
    """Accuracy against each of ``axes`` (summary key, label), one point per setting coloured by its
    family (the name's first word). ``frontier``: names joined by a line in that order (the tuner's
    Pareto frontier); ``chosen``: a name ringed and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(1, len(axes), figsize=(6.5 * len(axes), 5), squeeze=False)
    families = {"fixed": "tab:blue", "threshold": "tab:orange", "psd": "tab:green", "rps": "tab:red"}
    by_name = {s["name"]: s for s in summaries}
    for ax, (key, label) in zip(axs[0], axes):
        for s in summaries:
            family = s["name"].split("-")[0]
            ax.scatter(s[key], 100 * s["accuracy"], color=families.get(family, "gray"), s=30)
            ax.annotate(s["name"], (s[key], 100 * s["accuracy"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if frontier:
            points = [by_name[name] for name in frontier]
            ax.plot([p[key] for p in points], [100 * p["accuracy"] for p in points], color="black", lw=1, alpha=0.6)
        if chosen is not None:
            c = by_name[chosen]
            ax.scatter(
                c[key], 100 * c["accuracy"], s=160, facecolors="none", edgecolors="black", lw=1.5, label="chosen"
            )
        ax.set_xlabel(label)
        ax.set_ylabel("exact-answer accuracy (%)")
        ax.grid(alpha=0.3)
    for family, color in families.items():
        axs[0][0].scatter([], [], color=color, label=family)
    axs[0][0].legend(loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# The DecodeConfig fields every setting shares, and DiffusionGemma's sampler fields (over its
# release's settings: the baseline; a named setting is whole, its parts left out the release's).
MATRIX_FIELDS = ("gen_length", "block_length", "cache", *ENTROPY_BOUND_FIELDS)
BENCH_DEFAULTS = {"cache": "dual"}  # the fast mode the documentation's tables use, unless asked otherwise


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m psd_jax.bench", description=__doc__)
    add_problem_set_flags(p)
    p.add_argument("--data", help="jsonl with question/answer fields (default: the model directory's test.jsonl)")
    add_decode_flags(p, MATRIX_FIELDS, BENCH_DEFAULTS)
    p.add_argument(
        "--decoders",
        help="comma-separated setting names (default: the matrix but its opt-in ones; --list shows them; any name "
        "the tuner writes works, e.g. psd-fixed-1-d15-next-conf0.95), each with its cache after "
        "a slash if not --cache's (threshold-0.9/none; the cache's name: " + CACHE_NAME_HELP + ") and optionally "
        "a block length (/b8); recommended: the model directory's "
        f"recommended setting, with its own block length and cache; {BASELINE} (the speedups' baseline) always runs. "
        "DiffusionGemma: entropy-bound-B[-sN][-stopC]... names, its release's settings the baseline",
    )
    p.add_argument(
        "--latency",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also decode the first N problems one at a time (batch 1) and report the time per answer, "
        "median and 95th percentile (default: 0, off)",
    )
    p.add_argument("--all", action="store_true", help="every setting of the matrix, the opt-in ones too")
    p.add_argument("--list", action="store_true", help="list the decoder settings and exit")
    p.add_argument("--out", default="bench_out", help="output directory for JSON, Markdown and PNG")
    add_cluster_flags(p)
    return p


def selected_names(args, known: list[str], baseline: str = BASELINE) -> list[str]:
    """The settings asked for (any name of ``psd_jax.names``' grammar, with a cache after a slash
    where one is given; ``decoder_matrix`` reads them), the baseline first whatever was asked."""
    if not args.decoders:
        return [baseline, *(n for n in known if (args.all or n not in OPT_IN) and n != baseline)]
    names = [n.strip() for n in args.decoders.split(",") if n.strip()]
    if not names:
        raise InputError(f"no decoder setting in --decoders {args.decoders!r}; see --list")
    for name in names:
        setting, cache = split_name(name)
        if setting == RECOMMENDED_NAME and cache is not None:
            raise InputError(f"{name}: {RECOMMENDED_NAME} brings its own cache")
    return [baseline, *(n for n in names if n != baseline)]


# DiffusionGemma's settings (``psd_jax.names``' entropy-bound names) a default run compares with the
# release's: a looser entropy bound (more positions kept per step, so adaptive stopping comes
# sooner), half the steps, and no adaptive stopping (every canvas runs all its steps).
ENTROPY_BOUND_MATRIX = ("entropy-bound-0.3", "entropy-bound-1", "entropy-bound-0.1-s24", "entropy-bound-0.1-stop0")


def entropy_bound_matrix(base: DecodeConfig, names: list[str]) -> dict[str, DecodeConfig]:
    """DiffusionGemma's named settings on ``base``'s lengths, by name."""
    out = {}
    for name in names:
        try:
            out[name] = base.replace(**entropy_bound_fields(name))
        except DecodeConfigError as exc:
            raise InputError(f"{exc}; see --list") from None
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        start = FrontEndStart.begin(args)
        model_dir, mcfg = start.model_dir, start.config
        sampler = start.entropy_bound  # DiffusionGemma: its own settings' names
        base = model_settings(model_dir, {**({} if sampler else BENCH_DEFAULTS), **decode_fields(args)})
        baseline = entropy_bound_name(base) if sampler else BASELINE
        known = [*(ENTROPY_BOUND_MATRIX if sampler else matrix_names()), RECOMMENDED_NAME]
        if args.list:
            print("\n".join(f"{name} (only with --all or --decoders)" if name in OPT_IN else name for name in known))
            return 0
        names = selected_names(args, known, baseline)
        if sampler:
            matrix = entropy_bound_matrix(base, [baseline, *(n for n in names if n != RECOMMENDED_NAME)])
        else:
            matrix = decoder_matrix(base, [n for n in names if n != RECOMMENDED_NAME])
        for settings in matrix.values():
            check_for_model(settings, mcfg)
        recommended_fields = {**decode_fields(args), "gen_length": base.gen_length}
        if RECOMMENDED_NAME in names:  # as far as it holds on any device
            start.precheck(recommended_fields, RECOMMENDED_NAME)
        data = Path(args.data) if args.data else model_dir / "test.jsonl"
        if not data.is_file():
            raise InputError(f"no problem file {data}: pass --data FILE.jsonl")
        examples = load_jsonl(data)[: args.limit]
        if not examples:
            raise InputError(f"{data} holds no problems")
        start.join()
        if RECOMMENDED_NAME in names:
            matrix[RECOMMENDED_NAME] = start.settings(recommended_fields, RECOMMENDED_NAME)
        lm = start.load()
        check_questions(
            lm.prompt_ids([ex["question"] for ex in examples], args.chat),
            args.prompt_bucket,
            base.gen_length,
            lm.config.max_length,
        )
    except (FileNotFoundError, ValueError) as exc:  # InputError, DecodeConfigError, ConfigError, ...
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    summaries = run_matrix(lm, matrix, examples, args, baseline)
    if not multihost.is_main():
        return 0  # every process decodes; process 0 writes the report
    meta = {**report_meta(args, model_dir, data, len(examples), base), "baseline": baseline}
    if RECOMMENDED_NAME in names:  # which device the recommended setting was chosen for
        meta["recommended"] = read_recommended(model_dir).origin()
    write_report(
        summaries,
        meta,
        Path(args.out),
        f"{model_dir.name}: {len(examples)} problems, gen {base.gen_length}, "
        f"block {base.block_length}, cache {base.cache}",
    )
    return 0


def report_meta(args, model_dir: Path, data: Path, n: int, base: DecodeConfig) -> dict:
    """What a report says it measured: model, problems, batch, lengths, device and time."""
    return {
        "model": str(model_dir),
        "data": str(data),
        "n": n,
        "batch": args.batch,
        "latency_problems": min(args.latency, n),
        "baseline": BASELINE,
        "gen_length": base.gen_length,
        "block_length": base.block_length,
        "cache": base.cache,
        "backend": jax.default_backend(),
        "devices": str(jax.devices()),
        "processes": jax.process_count(),
        "mesh": args.mesh,
        "time": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_matrix(
    lm: LoadedModel, matrix: dict[str, DecodeConfig], examples: list[dict], args, baseline: str = BASELINE
) -> list[dict]:
    """Every setting over the same batches, interleaved: each batch is decoded by every setting in
    turn before the next batch (and each latency problem likewise), so a slow phase of the machine
    (another process, a clock change) falls on every setting alike instead of on whichever ran
    then; on a 2-core CPU the baseline's own time varied by 1.5x between two sequential runs."""
    from tqdm import tqdm

    rows = {name: Row(name, dict(vars(settings))) for name, settings in matrix.items()}
    total = len(matrix) * len(examples)
    with tqdm(total=total, desc="bench", unit="prompt", file=sys.stderr, disable=not multihost.is_main()) as bar:
        for chunk in batches_of(examples, args.batch):
            for name, settings in matrix.items():
                add_batch(lm, rows[name], settings, chunk, args.chat, args.prompt_bucket)
                bar.update(len(chunk))
    for example in examples[: args.latency]:
        for name, settings in matrix.items():
            add_latency(lm, rows[name], settings, example, args.chat, args.prompt_bucket)
    return with_speedups([row.summary() for row in rows.values()], baseline)


def write_report(summaries: list[dict], meta: dict, out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"meta": meta, "results": summaries}, indent=2) + "\n")
    table = markdown_table(summaries)
    (out / "bench.md").write_text(table)
    pareto_plot(summaries, out / "pareto.png", title)
    print(table)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'pareto.png'}")
