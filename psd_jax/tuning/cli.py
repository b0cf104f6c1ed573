"""``python -m psd_jax.tune``: the fastest decoding setting whose accuracy stays within ``--max-loss``
points of a base setting, on your development set.

Fastest in seconds on a device (``--objective seconds``, the default): this one, as its decodes
took (``--device this``), or a modeled target priced from the decodes' model calls by shape
(``--device h200:MODEL_DIR@32``); or in model calls (``--objective calls``). The search problems
are compared with the base problem by problem by successive halving over growing prefixes; the
candidates that may be chosen are then confirmed on problems the search never saw (a seeded split
of ``--data``, or a file of their own, ``--confirm-data``), and the first whose paired loss is within
``--max-loss`` by its upper bound, widened for the number of candidates the confirmation may try,
is chosen. ``--final-data`` measures that choice once more on a third set that nothing else reads:
the figure a user can expect. A finished log re-ranks for another objective or device without
decoding again. docs/tuning.md.

On several processes (the cluster flags every front end takes: docs/multi-host.md) every process
runs the same search on the global mesh, each decode a collective call (``tuning.log``); only
process 0 prints, shows the progress and writes (``--out``, the log, ``--write``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from models import load_config

from ..cli.flags import (
    EXIT_BAD_INPUT,
    ArgumentParser,
    add_cluster_flags,
    add_decode_flags,
    add_problem_set_flags,
    decode_fields,
)
from ..cli.startup import FrontEndStart
from ..core.config import ENTROPY_BOUND_FAMILY, DecodeConfig, DecodeConfigError, check_for_model
from ..core.errors import InputError
from ..core.lengths import check_questions
from ..costs import CHIPS
from ..model_dir import model_settings
from ..names import entropy_bound_fields, entropy_bound_name, full_name, setting_fields
from ..parallel import multihost
from ..scoring import load_jsonl
from . import log as tune_log
from .devices import OBJECTIVES, THIS, objective_for, parse_device
from .report import interval, write_reports
from .search import (
    NotEvaluated,
    Objective,
    compare,
    corrected_z,
    default_rungs,
    speedup_interval,
    split,
    successive_halving,
)
from .space import ENTROPY_BOUND_SPACES, SPACES, build_space

BASE_CACHE = "none"  # a named base runs uncached: the reference is the model's own decode
DEFAULT_BASE = "fixed-1"
CONFIRM_FRACTION = 0.3


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m psd_jax.tune", description=__doc__)
    add_problem_set_flags(p)
    p.add_argument("--data", required=True, help="development jsonl with question/answer fields")
    add_decode_flags(p, ("gen_length", "block_length"))
    p.add_argument(
        "--base",
        help="the reference setting: a benchmark name (fixed-1, threshold-0.9, psd-fixed-1-d3, ...; run uncached) "
        'or JSON DecodeConfig fields, e.g. \'{"policy": "threshold", "cache": "dual"}\' (default fixed-1; '
        "DiffusionGemma: an entropy-bound name, default the release's settings)",
    )
    p.add_argument(
        "--max-loss", type=float, default=1.0, help="accuracy loss allowed against the base, in points (default 1.0)"
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--confirm-fraction",
        type=float,
        help=f"share of the problems held out for confirmation (default {CONFIRM_FRACTION})",
    )
    group.add_argument("--confirm", type=int, metavar="N", help="problems held out for confirmation")
    group.add_argument(
        "--confirm-data",
        metavar="FILE",
        help="a jsonl of confirmation problems of its own (then every --data problem is a search problem)",
    )
    p.add_argument(
        "--final-data",
        metavar="FILE",
        help="a third jsonl, decoded once for the choice and the base after the choice holds: the figure to "
        "expect on new data, stored with the choice",
    )
    p.add_argument(
        "--confirm-z",
        type=float,
        help="a confirmation holds when difference - Z*SE >= -max loss (default: --z widened for the "
        f"{MAX_CONFIRMATIONS} candidates a confirmation may try, 2.12 at z 1.64; 0: the point estimate)",
    )
    p.add_argument("--split-seed", type=int, default=0, help="seed of the search/confirmation split (default 0)")
    p.add_argument("--rungs", help="comma-separated, increasing search sizes (default 50, 100, 200, ..., all)")
    p.add_argument("--z", type=float, default=1.64, help="bounds are difference ± z·SE (default 1.64)")
    p.add_argument("--space", choices=list(SPACES), default="default", help="candidate list (docs/tuning.md)")
    p.add_argument("--log", help="resumable JSONL log of every decode (default OUT/tune.jsonl)")
    p.add_argument("--out", default="tune_out", help="directory for tune.json, tune.md, frontier.png")
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="seconds",
        help="what the choice minimises at equal accuracy: seconds per answer on --device, or model calls "
        "(default: seconds)",
    )
    p.add_argument(
        "--device",
        default=THIS,
        metavar="DEVICE",
        help="this: the seconds the decodes took here; or a modeled target CHIP[:MODEL_DIR][@BATCH] "
        f"(chips: {', '.join(CHIPS)}; MODEL_DIR: a config.json to price, default the tuned model's; BATCH: "
        "rows per call, default --batch) priced from the decodes' calls by shape (default: this)",
    )
    p.add_argument(
        "--rerank",
        action="store_true",
        help="decode nothing: rank what --log holds for --objective/--device (a candidate the log lacks at a rung "
        "stops there; the choice is confirmed if the log holds its confirmation)",
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="store the choice in the model directory's recommended.json, as the setting for this device's kind "
        "(or the modeled target's: gpu for h200, tpu for tpu-v5e)",
    )
    add_cluster_flags(p)
    return p


@dataclasses.dataclass
class Plan:
    """Everything checked before the model loads."""

    model_dir: Path
    data: Path
    examples: list[dict]
    base_name: str
    base: DecodeConfig
    candidates: dict[str, DecodeConfig]
    dropped: list
    search_ids: list[int]
    confirm_ids: list[int]
    final_ids: list[int]  # empty without --final-data
    files: dict[str, dict]  # each problem file: path, SHA-256 and the indices of its problems
    rungs: list[int]
    context: dict[str, Any]
    log: Path
    objective: Objective
    device_kind: str  # recommended.json's key for the choice: cpu, gpu or tpu
    start: FrontEndStart  # loads the weights when a decode needs them


def resolve_base(text: str | None, model_dir: Path, lengths: dict[str, Any]) -> tuple[str, DecodeConfig]:
    """A setting name or JSON fields, over the model's lengths: for the mask-token families a
    benchmark name, run uncached (``BASE_CACHE``; default ``fixed-1``); for DiffusionGemma an
    entropy-bound name over the release's settings (default: the release's)."""
    sampler = load_config(model_dir).family == ENTROPY_BOUND_FAMILY
    text = (None if sampler else DEFAULT_BASE) if text is None else text
    over = {} if sampler else {"cache": BASE_CACHE}
    if text is None:
        fields: dict[str, Any] = {}
    elif text.strip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"--base is not JSON ({exc.msg})") from None
        if not isinstance(fields, dict):
            raise InputError("--base JSON must be an object of DecodeConfig fields")
    else:
        try:
            fields = (
                entropy_bound_fields(text)
                if sampler
                else setting_fields(text, model_settings(model_dir, lengths).gen_length)
            )
        except DecodeConfigError as exc:
            raise InputError(f"--base {text}: {exc}; or give JSON fields") from None
    settings = model_settings(model_dir, {**lengths, **fields}, base=over)
    return (entropy_bound_name if sampler else full_name)(settings), settings


def parse_rungs(text: str | None, n_search: int) -> list[int]:
    if text is None:
        return default_rungs(n_search)
    try:
        rungs = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--rungs must be comma-separated integers, got {text!r}") from None
    if not rungs or rungs[0] < 1 or any(b <= a for a, b in zip(rungs, rungs[1:])):
        raise InputError(f"--rungs must be positive and strictly increasing, got {text!r}")
    if rungs[-1] > n_search:
        raise InputError(f"rung {rungs[-1]} is larger than the search split ({n_search} problems)")
    return rungs


def confirm_size(args, n: int) -> int:
    if args.confirm is not None:
        size = args.confirm
    else:
        fraction = CONFIRM_FRACTION if args.confirm_fraction is None else args.confirm_fraction
        if not 0 < fraction < 1:
            raise InputError(f"--confirm-fraction must be in (0, 1), got {fraction:g}")
        size = round(fraction * n)
    if size < 1:
        raise InputError(f"the confirmation split is empty ({n} problems): use more problems or --confirm N")
    if size >= n:
        raise InputError(f"the search split is empty: {size} of {n} problems held out for confirmation")
    return size


def problem_file(flag: str, path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{flag}: no problem file {file}")
    examples = load_jsonl(file)
    if not examples:
        raise InputError(f"{flag}: {file} holds no problems")
    return examples


def check_disjoint(sets: dict[str, list[dict]]) -> None:
    """No question in two of the problem files: a confirmation or final problem the search also read
    would measure the search's luck, not the setting."""
    seen: dict[str, str] = {}
    for flag, examples in sets.items():
        shared = {seen[ex["question"]] for ex in examples if ex["question"] in seen}
        if shared:
            count = sum(ex["question"] in seen for ex in examples)
            raise InputError(f"{flag}: {count} of its questions are also in {', '.join(sorted(shared))}")
        seen.update({ex["question"]: flag for ex in examples})


def confirmation_z(args) -> float:
    return corrected_z(args.z, MAX_CONFIRMATIONS) if args.confirm_z is None else args.confirm_z


def prepare(args) -> Plan:
    """Every check that needs no weights: bad input fails here, before the model loads and before
    the processes of a cluster wait for one another; then the cluster starts (``FrontEndStart.join``),
    before the device kind is read."""
    if args.max_loss < 0:
        raise InputError(f"--max-loss must be >= 0 (accuracy points), got {args.max_loss:g}")
    if not args.z > 0:
        raise InputError(f"--z must be positive, got {args.z:g}")
    if args.confirm_z is not None and not args.confirm_z >= 0:
        raise InputError(f"--confirm-z must be >= 0, got {args.confirm_z:g}")
    start = FrontEndStart.begin(args)
    model_dir = start.model_dir
    sampler = start.entropy_bound  # DiffusionGemma: its own space and names
    if sampler and args.device != THIS:
        raise InputError(
            f"--device {args.device}: DiffusionGemma's decodes are ranked by their own seconds (--device this) or "
            "calls; its calls are not priced for other chips"
        )
    data = Path(args.data)
    if not data.is_file():
        raise InputError(f"no problem file {data}")
    examples = load_jsonl(data)[: args.limit]
    if not examples:
        raise InputError(f"{data} holds no problems")
    sets = {"--data": examples}
    if args.confirm_data:
        sets["--confirm-data"] = problem_file("--confirm-data", args.confirm_data)
    if args.final_data:
        sets["--final-data"] = problem_file("--final-data", args.final_data)
    check_disjoint(sets)
    lengths = decode_fields(args)
    base_name, base = resolve_base(args.base, model_dir, lengths)
    mcfg = start.config
    check_for_model(base, mcfg)
    if args.confirm_data:  # the search reads all of --data, in one seeded order
        search_ids, _ = split(len(examples), 0, args.split_seed)
        confirm_ids = list(range(len(examples), len(examples) + len(sets["--confirm-data"])))
    else:
        search_ids, confirm_ids = split(len(examples), confirm_size(args, len(examples)), args.split_seed)
    final_first = len(examples) + (len(confirm_ids) if args.confirm_data else 0)
    final_ids = list(range(final_first, final_first + len(sets.get("--final-data", []))))
    paths = {"--data": data, "--confirm-data": args.confirm_data, "--final-data": args.final_data}
    files, offset = {}, 0
    for flag, problems in sets.items():
        path = Path(paths[flag])
        files[flag] = {"path": str(path), "sha256": tune_log.file_sha256(path), "first": offset, "n": len(problems)}
        offset += len(problems)
    examples = [ex for problems in sets.values() for ex in problems]
    rungs = parse_rungs(args.rungs, len(search_ids))
    defaults = model_settings(model_dir, lengths)
    if sampler:
        fields = ENTROPY_BOUND_SPACES[args.space](defaults.gen_length, defaults.block_length)
        space = build_space(fields, defaults.gen_length, mcfg, base, entropy_bound_name, over=base)
    else:
        space = build_space(
            SPACES[args.space](defaults.gen_length, defaults.block_length), defaults.gen_length, mcfg, base
        )
    if not space.candidates:
        raise InputError(f"no valid candidate in the {args.space!r} space: {space.dropped[0][1]}")
    context = {
        "model": str(model_dir.resolve()),
        "data_sha256": files["--data"]["sha256"],
        "dtype": args.dtype,
        "quantize": args.quantize,
        "mesh": args.mesh,
        "chat": args.chat,
        "prompt_bucket": args.prompt_bucket,
    }
    if len(files) > 1:  # problem indices run on through the other files: their contents and offsets
        context["problem_files"] = {flag: [f["sha256"], f["first"], f["n"]] for flag, f in files.items()}
    log = Path(args.log) if args.log else Path(args.out) / "tune.jsonl"
    target = parse_device(args.device, model_dir, args.batch)
    objective = objective_for(args.objective, target, defaults.block_length)
    start.join()
    kind = this_device_kind() if target is None else target.kind
    return Plan(
        model_dir, data, examples, base_name, base, space.candidates, space.dropped,
        search_ids, confirm_ids, final_ids, files, rungs, context, log, objective, kind, start,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = prepare(args)
    except (FileNotFoundError, ValueError) as exc:  # InputError, DecodeConfigError, ConfigError, ...
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    main_process = multihost.is_main()
    for fields, why in plan.dropped if main_process else ():
        print(f"skipped {fields}: {why}", file=sys.stderr)
    try:
        return run(plan, args)
    except InputError as exc:  # a prompt that does not fit the context, found when the model loads
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NotEvaluated as exc:  # --rerank of a log that lacks the base
        print(f"error: --rerank: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run(plan: Plan, args) -> int:
    def load():
        lm = plan.start.load()
        lm.max_programs = KEPT_PROGRAMS
        questions = lm.prompt_ids([ex["question"] for ex in plan.examples], args.chat)
        check_questions(questions, args.prompt_bucket, plan.base.gen_length, lm.config.max_length)
        return lm

    main_process = multihost.is_main()  # the others decode alike and say nothing
    bar = tune_log.progress_bar(disable=not main_process)
    evaluator = tune_log.LoggedEvaluator(
        plan.log, plan.context, plan.examples, load, args.batch, args.chat, args.prompt_bucket, bar, not args.rerank
    )
    max_loss = args.max_loss / 100
    result = successive_halving(
        plan.base_name,
        plan.base,
        plan.candidates,
        plan.rungs,
        plan.search_ids,
        evaluator,
        max_loss,
        args.z,
        objective=plan.objective,
    )
    confirmation, failed = confirm(plan, args, evaluator, result)
    final = measure_final(plan, args, evaluator, result.choice) if confirmation is not None else None
    bar.close()
    refused = unwritable(plan, result, confirmation, final) if args.write else None
    if not main_process:
        return 1 if refused else 0
    meta = {
        "model": str(plan.model_dir),
        "data": str(plan.data),
        "data_sha256": plan.context["data_sha256"],
        "n": len(plan.examples),
        "search_size": len(plan.search_ids),
        "confirm_size": len(plan.confirm_ids),
        "final_size": len(plan.final_ids),
        "files": plan.files,
        "split_seed": args.split_seed,
        "splits": {"search": plan.search_ids, "confirmation": plan.confirm_ids, "final": plan.final_ids},
        "rungs": plan.rungs,
        "z": args.z,
        "confirm_z": confirmation_z(args),
        "max_loss": args.max_loss,
        "objective": plan.objective.name,
        "device": plan.objective.device,
        "device_kind": plan.device_kind,
        "processes": multihost.process_count(),
        "base": {"name": plan.base_name, "settings": tune_log.dataclass_fields(plan.base)},
        "space": args.space,
        "candidates": len(plan.candidates),
        "log": str(plan.log),
        "log_entries_read_back": evaluator.read_back,
        "problems_decoded": evaluator.decoded,
        "time": time.strftime("%Y-%m-%d %H:%M"),
    }
    fields = {name: tune_log.dataclass_fields(c) for name, c in plan.candidates.items()}
    print(
        write_reports(Path(args.out), meta, result, plan.base_name, confirmation, plan.dropped, fields, failed, final)
    )
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 1
    if args.write:
        write_choice(plan, args, result, confirmation, final)
    return 0


def unwritable(plan: Plan, result, confirmation: dict | None, final: dict | None) -> str | None:
    """Why ``--write`` stores nothing (None: it may)."""
    if result.choice is None or confirmation is None:
        return "nothing chosen and confirmed, so no recommended setting written"
    if plan.final_ids and final is None:
        return "the choice's final measurement is not in the log, so nothing written"
    return None


MAX_CONFIRMATIONS = 3  # distinct answers tried on the confirmation split before giving up
# A search compiles a program per candidate, batch shape and prompt bucket (hundreds), and each
# XLA:CPU program holds a few hundred memory mappings until dropped: past the kernel's limit per
# process (vm.max_map_count, 65530) the next compile fails. A rung decodes one setting after another,
# so the least recently used programs go (``LoadedModel.max_programs``).
KEPT_PROGRAMS = 32


def confirm(plan: Plan, args, evaluator, result) -> tuple[dict | None, list[dict]]:
    """The choice measured on the confirmation split, which the search never saw. A confirmation
    holds when the paired loss is within ``max_loss`` by its upper bound, ``difference -
    confirm_z * SE >= -max_loss``, with ``confirm_z`` the one-sided bound of ``--z`` widened for the
    ``MAX_CONFIRMATIONS`` candidates this may try (``search.corrected_z``): the fastest candidate of
    many within the loss is selected partly for its luck on the search split, and a point estimate
    at the edge of the loss passes half the time when the true loss is right there. A choice that
    fails gives way to the next candidate that may be chosen (``SearchResult.ranked``), and the first
    to hold becomes the choice (``result.choice``; statuses updated). The search gives up after
    ``MAX_CONFIRMATIONS`` failures with different answers: a candidate that answers every
    confirmation problem as one that failed (the same decoder under another cache often does) fails
    alike and tells nothing new, so it does not count. Returns (the confirmation that held, else
    None: then nothing is chosen; the confirmations that did not hold)."""
    evaluator.phase = "confirm"
    z_confirm = confirmation_z(args)
    failed, answers = [], set()
    for name in result.ranked:
        if len(answers) == MAX_CONFIRMATIONS:
            break
        candidate = plan.candidates[name]
        evaluator.plan([plan.base, candidate], plan.confirm_ids)
        try:
            base_out = evaluator.results(plan.base_name, plan.base, plan.confirm_ids)
            out = evaluator.results(name, candidate, plan.confirm_ids)
        except NotEvaluated:
            print(f"{name}: its confirmation is not in the log (run without --rerank)", file=sys.stderr)
            result.last[name]["status"] = "not confirmed (not in the log)"
            result.choice = None
            return None, failed
        measured = {"name": name, **compare(base_out, out, plan.confirm_ids, args.z, plan.objective)}
        measured["confirm_z"] = z_confirm
        measured["gate"] = measured["difference"] - z_confirm * measured["standard_error"]
        if measured["gate"] >= -args.max_loss / 100:
            result.last[name]["status"] = "chosen"
            result.choice = name
            return measured, failed
        result.last[name]["status"] = "failed confirmation"
        answers.add(tuple(out[i].correct for i in plan.confirm_ids))
        keys = ("name", "difference", "standard_error", "gate", "accuracy", "base_accuracy")
        failed.append({k: measured[k] for k in keys})
    result.choice = None
    return None, failed


def measure_final(plan: Plan, args, evaluator, choice: str) -> dict | None:
    """The confirmed choice and the base on ``--final-data``, once: problems neither the search nor
    the confirmation read, so the figure is free of the selection that both made. With the
    accuracy difference's interval (``--z``) and the tokens/s ratio's (a bootstrap over batches).
    None without a final set, or when a re-rank's log lacks it."""
    if not plan.final_ids:
        return None
    evaluator.phase = "final"
    candidate = plan.candidates[choice]
    evaluator.plan([plan.base, candidate], plan.final_ids)
    try:
        base_out = evaluator.results(plan.base_name, plan.base, plan.final_ids)
        out = evaluator.results(choice, candidate, plan.final_ids)
    except NotEvaluated:
        print(f"{choice}: its final measurement is not in the log (run without --rerank)", file=sys.stderr)
        return None
    measured = {"name": choice, **compare(base_out, out, plan.final_ids, args.z, plan.objective)}
    if plan.objective.name == "seconds" and plan.objective.price is None:
        measured["speedup_interval"] = list(speedup_interval(base_out, out, plan.final_ids))
    return measured


def write_choice(plan: Plan, args, result, confirmation: dict, final: dict | None = None) -> None:
    from ..recommended import write_recommended

    search = result.last[result.choice]

    def paired(s: dict) -> dict:
        keys = ("n", "difference", "standard_error", "lower", "upper", "accuracy", "base_accuracy", "tpf_ratio")
        keys += ("speedup", "cost_per_prompt", "nfe_per_prompt")
        return {k: s[k] for k in keys} | {"summary": interval(s, args.z)}

    provenance = {
        "tool": "psd_jax.tune",
        "name": result.choice,
        "data": str(plan.data),
        "data_sha256": plan.context["data_sha256"],
        "search_size": len(plan.search_ids),
        "confirm_size": len(plan.confirm_ids),
        "split_seed": args.split_seed,
        "files": {flag: {k: f[k] for k in ("path", "sha256", "n")} for flag, f in plan.files.items()},
        "gen_length": plan.base.gen_length,  # the length the setting was tuned at
        "last_rung": plan.rungs[-1],
        "base": {"name": plan.base_name, "settings": plan.base.changed()},
        "max_loss_points": args.max_loss,
        "z": args.z,
        "confirm_z": confirmation["confirm_z"],
        "objective": plan.objective.name,
        "device": chosen_for(plan.objective, plan.device_kind),
        "search": paired(search),
        "confirmation": paired(confirmation),
        **({"final": paired(final) | {k: final[k] for k in ("speedup_interval",) if k in final}} if final else {}),
        "tpf_ratio": (final or confirmation)["tpf_ratio"],
        "speedup": (final or confirmation)["speedup"],
        "date": time.strftime("%Y-%m-%d"),
    }
    frontier = [
        {"name": n, "settings": plan.candidates[n].changed() if n in plan.candidates else plan.base.changed()}
        | {k: result.last.get(n, result.base)[k] for k in ("accuracy", "difference", "cost_per_prompt", "speedup")}
        for n in result.frontier
    ]
    file = write_recommended(
        plan.model_dir, plan.candidates[result.choice], provenance, device=plan.device_kind, frontier=frontier
    )
    print(f"wrote {file}")


def this_device_kind() -> str:
    """The kind of device this process decodes on (jax's default backend): cpu, gpu or tpu."""
    import jax

    return jax.default_backend()


def chosen_for(objective: Objective, kind: str) -> str:
    """How the choice was ranked, for recommended.json and the front ends that show it."""
    if objective.name == "calls":
        return "fewest model calls"
    if objective.device == THIS:
        return f"seconds measured on {kind}"
    return f"seconds modeled for {objective.device}"
