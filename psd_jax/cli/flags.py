"""Command-line flags generated from ``DecodeConfig``: one flag per field, named after it.

Every front end (``generate``, ``bench``, evaluation, serving) adds its decoding flags here, so a
new field appears everywhere at once with the same name (``k_max`` -> ``--k-max``), the same help
text (``config.FIELD_HELP``) and the same validation (``DecodeConfig`` itself). Flags default to
unset; the settings are the set flags over the model directory's defaults (``model_dir.model_settings``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from convert.args import EXIT_BAD_INPUT, ArgumentParser  # noqa: F401  (the front ends' parser, from here)
from models.config import DTYPE_NAMES
from models.quantize import QUANTIZE

from ..core.config import BOOL_FIELDS, CHOICES, FIELD_HELP, FLOAT_FIELDS, INT_FIELDS, DecodeConfig, DecodeConfigError
from ..parallel.multihost import DEFAULT_HEARTBEAT_S, Cluster, ClusterError
from ..recommended import RECOMMENDED_FILE, SETTINGS_NAMES, check_settings_name


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _default_text(field: str) -> str:
    if field in ("gen_length", "block_length"):
        return "the model directory's decode_defaults.json, else " + (
            str(DecodeConfig.gen_length) if field == "gen_length" else f"min({DecodeConfig.block_length}, gen_length)"
        )
    default = getattr(DecodeConfig, field)
    if field == "steps":
        return "gen_length; block_length per block with threshold_schedule and sequential"
    return "policy's own" if default is None else str(default).lower() if isinstance(default, bool) else str(default)


def add_decode_flags(
    parser: argparse.ArgumentParser, fields: Sequence[str] | None = None, defaults: Mapping[str, Any] | None = None
) -> None:
    """Add one flag per ``DecodeConfig`` field (or per field of ``fields``) to ``parser``; ``defaults``
    are the front end's own defaults where they differ from ``DecodeConfig``'s (shown in ``--help``)."""
    group = parser.add_argument_group("decoding settings (DecodeConfig fields; docs/algorithms.md)")
    defaults = defaults or {}
    for f in dataclasses.fields(DecodeConfig):
        if fields is not None and f.name not in fields:
            continue
        default_text = str(defaults[f.name]) if f.name in defaults else _default_text(f.name)
        help_text = f"{FIELD_HELP[f.name]} (default: {default_text})"
        kwargs: dict[str, Any] = {"default": None, "dest": f.name, "help": help_text}
        if f.name in BOOL_FIELDS:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name in INT_FIELDS:
            kwargs.update(type=int, metavar="N")
        elif f.name in FLOAT_FIELDS:
            kwargs.update(type=float, metavar="X")
        elif f.name in CHOICES:
            kwargs["metavar"] = "{" + ",".join(CHOICES[f.name]) + "}"
        group.add_argument(flag_name(f.name), **kwargs)


SETTINGS_HELP = (
    f"a named setting as the base of the decoding flags: recommended (the model directory's {RECOMMENDED_FILE}, "
    "written by python -m psd_jax.tune --write, else the library's recommendation; its block_length wins over "
    "decode_defaults.json); the flags given override it (default: no named setting)"
)


def settings_name(text: str) -> str:
    """argparse type for ``--settings``: a known setting name (``recommended.SETTINGS_NAMES``)."""
    try:
        check_settings_name(text)
    except DecodeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_settings_flag(parser: argparse.ArgumentParser, help_text: str = SETTINGS_HELP) -> None:
    """``--settings NAME``: the base the decoding flags apply over (``recommended.named_settings``)."""
    parser.add_argument("--settings", type=settings_name, metavar="{" + ",".join(SETTINGS_NAMES) + "}", help=help_text)


def decode_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``DecodeConfig`` fields set on the command line."""
    names = {f.name for f in dataclasses.fields(DecodeConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def positive_int(text: str) -> int:
    """argparse type for counts (``--batch``, ``--limit``, ``--prompt-bucket``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type for counts that may be 0 (``--max-depth``: PSD depth 0 is a decode without
    drafts; ``--latency``: off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def add_weight_flags(p: argparse.ArgumentParser) -> None:
    """How the model's weights are held: ``--dtype``, ``--quantize`` and ``--mesh``, the same flags
    on every front end that loads a model."""
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_NAMES))
    p.add_argument(
        "--quantize",
        choices=list(QUANTIZE),
        help="store the layers' projection weights as int8 or int4 with scales (weight-only, through qwix)",
    )
    p.add_argument("--mesh", help='shard over devices, e.g. "data=2,model=4" (default: one device)')


def weight_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_model``'s keyword arguments from ``add_weight_flags``' flags."""
    return {"dtype": args.dtype, "mesh": args.mesh, "quantize": args.quantize}


def add_problem_set_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a run over a problem file (the benchmark and the tuner, ``psd_jax.tune``): the
    model, how its prompts run and its weights, one definition so the two read a run's model the
    same way."""
    p.add_argument("--model", help="model directory (default: the shipped default model)")
    p.add_argument("--limit", type=positive_int, help="use only the first N problems")
    p.add_argument("--batch", type=positive_int, default=50, help="prompts per decode (default 50)")
    p.add_argument(
        "--no-chat",
        action="store_false",
        dest="chat",
        default=None,
        help="do not wrap questions in the chat template (default: when the tokenizer has one)",
    )
    p.add_argument("--prompt-bucket", type=positive_int, default=32, help="pad prompt lengths up to a multiple of this")
    add_weight_flags(p)


# ------------------------------------------------------------------------ several processes
def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The multi-process flags every front end takes."""
    group = parser.add_argument_group(
        "several processes (jax.distributed; docs/multi-host.md): run the same command in every process"
    )
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's address, which every process connects to (with --num-processes and --process-id)",
    )
    group.add_argument("--num-processes", type=int, metavar="N", help="how many processes run the command")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 to N - 1")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="join a cluster JAX detects by itself (Cloud TPU pod slices, SLURM, Open MPI) without the three flags",
    )
    group.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=DEFAULT_HEARTBEAT_S,
        metavar="S",
        help=f"seconds after which a silent process counts as dead and every process stops (default: {DEFAULT_HEARTBEAT_S})",
    )


def cluster_from_flags(args: argparse.Namespace) -> Cluster | None:
    """The cluster the flags ask for (``None``: one process), or ``ClusterError``."""
    explicit = {
        "--coordinator": args.coordinator,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    given = [name for name, value in explicit.items() if value is not None]
    if args.heartbeat_timeout < 1:
        raise ClusterError(f"--heartbeat-timeout must be at least 1 second, got {args.heartbeat_timeout}")
    if not given:
        return Cluster(heartbeat_timeout_s=args.heartbeat_timeout) if args.distributed else None
    if len(given) < len(explicit):
        missing = [name for name in explicit if name not in given]
        raise ClusterError(f"{', '.join(given)} needs {' and '.join(missing)} too: give all three or none")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ClusterError(f"--coordinator must be HOST:PORT with a port from 1 to 65535, got {args.coordinator!r}")
    if args.num_processes < 1:
        raise ClusterError(f"--num-processes must be at least 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise ClusterError(f"--process-id must be from 0 to {args.num_processes - 1}, got {args.process_id}")
    return Cluster(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
