"""``python -m psd_jax.evaluate``: EleutherAI's lm-evaluation-harness with psd-jax as its model.

The command line is the harness's own, unchanged (``--tasks``, ``--num_fewshot``,
``--include_path``, ``--log_samples``, ``--output_path``, ``--limit``, ``--apply_chat_template``,
...), with ``--model psd_jax`` inserted when no ``--model`` is given. Decoding settings are model
arguments named after the ``DecodeConfig`` fields, over the checkpoint's decode defaults:

    python -m psd_jax.evaluate --tasks gsm8k --num_fewshot 5 --batch_size 8 \\
        --model_args pretrained=ckpt/llada-8b,dtype=bfloat16,gen_length=256,block_length=32,\\
    policy=threshold,threshold=0.9,decoder=psd,depth=3,cache=dual

After the harness's table, a per-task efficiency table (NFE, TPF, tokens, tokens/s, compile
seconds) is printed and, with ``--output_path``, written as ``efficiency_<date>.json`` beside
the harness's ``results_<date>.json``. Bad model arguments, generation kwargs or requests print one
``error:`` line and exit with code 2, as does a missing or too old harness.

The papers' protocols run by name (``protocols``, ``protocol_cli``): ``--list-protocols`` lists
them, ``--protocol NAME`` runs one (the user's flags override its own), ``--dry-run`` prints the
harness command instead of running it. ``--settings recommended`` runs the model directory's
recommended setting (the model argument ``settings=recommended``), not with ``--protocol``.

On several processes (``jax.distributed``) every process runs the same command with psd-jax's
multi-process flags added (``--coordinator HOST:PORT --num-processes N --process-id I``, or
``--distributed``): every process feeds the harness's requests, in the same order, to the same
global batches; only process 0 prints and writes results, samples and the efficiency record.
"""

from __future__ import annotations

import dataclasses
import sys
from importlib import metadata
from pathlib import Path

from ..cli.flags import EXIT_BAD_INPUT, ArgumentParser, add_cluster_flags, cluster_from_flags
from ..parallel import multihost
from . import protocol_cli

MODEL_NAME = "psd_jax"
SUBCOMMANDS = ("run", "ls", "validate")
MIN_LM_EVAL = "0.4.10"  # the first lm-eval with lm_eval._cli.HarnessCLI (pyproject.toml's eval extra)


# The harness's flags that write files, log elsewhere or print per-sample output (with whether each
# takes a value): only process 0 of several passes them on.
REPORTING_FLAGS = {
    "--output_path": True,
    "-o": True,
    "--log_samples": False,
    "-s": False,
    "--use_cache": True,
    "-c": True,
    "--wandb_args": True,
    "--wandb_config_args": True,
    "--hf_hub_log_args": True,
    "--trackio_args": True,
    "--write_out": False,
    "-w": False,
    "--show_config": False,
}


def split_cluster_flags(argv: list[str]) -> tuple[multihost.Cluster | None, list[str]]:
    """psd-jax's multi-process flags (``flags.add_cluster_flags``) out of ``argv``: (the cluster they
    ask for, the harness's arguments)."""
    parser = ArgumentParser(prog="python -m psd_jax.evaluate", add_help=False, allow_abbrev=False)
    add_cluster_flags(parser)
    args, rest = parser.parse_known_args(argv)
    return cluster_from_flags(args), rest


def without_reporting(argv: list[str]) -> list[str]:
    """``argv`` without ``REPORTING_FLAGS`` (and their values): what a process other than 0 runs."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in REPORTING_FLAGS:
            skip = REPORTING_FLAGS[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def with_default_model(argv: list[str]) -> list[str]:
    """``argv`` with ``--model psd_jax`` added to a run that names no model (``ls``/``validate`` as is)."""
    if argv and argv[0] in SUBCOMMANDS[1:]:
        return list(argv)
    named = any(a in ("--model", "-M") or a.startswith("--model=") for a in argv)
    if named:
        return list(argv)
    if argv and argv[0] == "run":
        return ["run", "--model", MODEL_NAME, *argv[1:]]
    return ["--model", MODEL_NAME, *argv]


def output_path(argv: list[str]) -> str | None:
    """The value of the harness's ``--output_path``/``-o`` in ``argv``, if any."""
    for i, arg in enumerate(argv):
        if arg.startswith("--output_path="):
            return arg.split("=", 1)[1]
        if arg in ("--output_path", "-o") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from ..core.config import DecodeConfigError
    from ..core.errors import InputError  # EvalArgsError and TokenizerError are InputErrors
    from ..parallel.sharding import MeshError

    return (InputError, DecodeConfigError, MeshError, FileNotFoundError)


def _harness_missing(exc: ImportError) -> str:
    """The one line for a harness that cannot run this entry point: not installed, or too old."""
    try:
        installed = f"lm-eval {metadata.version('lm-eval')} is installed"
    except metadata.PackageNotFoundError:
        installed = "lm-eval is not installed"
    return (
        f"python -m psd_jax.evaluate needs lm-evaluation-harness >= {MIN_LM_EVAL} ({installed}: {exc}); "
        "pip install -e '.[eval]'"
    )


def precheck(argv: list[str], harness_cli: type, any_device: bool = False) -> None:
    """Check a psd_jax run's model arguments and ``--gen_kwargs`` before the harness starts (it
    indexes every task first): the same parse the harness does (its own parser, ``harness_cli``),
    then ``parse_eval_args`` (the model directory and the settings against its config) and the
    generation kwargs' mapping. ``any_device``: before a cluster starts, asking JAX nothing
    (``parse_eval_args``)."""
    from ..core.config import check_for_model
    from .args import parse_eval_args
    from .gen_kwargs import parse_gen_kwargs, request_settings

    full = argv if argv and argv[0] in SUBCOMMANDS else ["run", *argv]
    if full[0] != "run" or {"-h", "--help"} & set(full):
        return
    args = harness_cli()._parser.parse_args(full)
    if getattr(args, "model", None) != MODEL_NAME or getattr(args, "config", None):
        return  # another model, or model arguments from a YAML config: checked when the model is made
    raw = dict(args.model_args or {})
    if getattr(args, "batch_size", None) is not None:
        raw["batch_size"] = args.batch_size
    parsed = parse_eval_args(raw, any_device)
    if getattr(args, "gen_kwargs", None):
        gen = parse_gen_kwargs(args.gen_kwargs)
        settings = request_settings(parsed.settings, gen, parsed.decode_fields, "--gen_kwargs")
        check_for_model(settings, parsed.start.config)


def report(argv: list[str], models: list) -> None:
    """Print the efficiency table of each model this run made and write its record."""
    from .efficiency import write_report

    for model in models:
        record = model.efficiency_record()
        print(f"\npsd_jax efficiency ({record['model']}):")
        print(model.efficiency.table())
        path = write_report(record, output_path(argv), model.started)
        if path is not None:
            print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    try:
        cluster, argv = split_cluster_flags(list(sys.argv[1:] if argv is None else argv))
    except multihost.ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if protocol_cli.LIST in argv:
        print(protocol_cli.listing())
        return 0
    try:
        argv = protocol_cli.with_settings(argv)  # --settings NAME: the model argument settings=NAME
    except protocol_cli.ProtocolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        from lm_eval.__main__ import cli_evaluate
        from lm_eval._cli import HarnessCLI

        from .harness import CREATED
    except ImportError as exc:
        print(f"error: {_harness_missing(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run = protocol_cli.resolve(argv, HarnessCLI)  # --protocol NAME: its flags under the user's
    except protocol_cli.ProtocolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    argv = with_default_model(run.argv)
    if run.dry_run:
        print(protocol_cli.command(dataclasses.replace(run, argv=argv)))
        return 0
    first = len(CREATED)
    saved, sys.argv = sys.argv, [f"{Path(sys.executable).name} -m psd_jax.evaluate", *argv]
    try:
        precheck(argv, HarnessCLI, any_device=cluster is not None)
        multihost.start(cluster)  # before the model reads the device kind its recommendation is chosen for
        if not multihost.is_main():  # the same requests in the same order; process 0 reports
            sys.argv = [sys.argv[0], *without_reporting(argv)]
        with multihost.quiet_unless_main():
            cli_evaluate()
    except _bad_input_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        sys.argv = saved
    if multihost.is_main():
        report(argv, CREATED[first:])
    return 0
