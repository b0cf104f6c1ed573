"""``--list-protocols``, ``--protocol NAME`` and ``--dry-run`` of ``python -m psd_jax.evaluate``.

``--protocol NAME`` puts the protocol's harness flags (``protocols.Protocol.harness_argv``) before
the user's own; a flag the user gives replaces the protocol's, except ``--model_args`` and
``--gen_kwargs``, which are merged key by key (so ``--model_args pretrained=ckpt/llada-8b,batch...``
overrides just those keys: they are left out of the protocol's flag, and the harness sees no overlap). What the user set is
read with the harness's own parser. ``--dry-run`` prints the resulting command instead of running
it. A protocol names the Hugging Face checkpoint upstream evaluated; without a ``pretrained`` model
argument that is a local directory, the run is refused with the download command, and a directory
of another family than the protocol's is refused by name.

``--settings NAME`` (``recommended``) is the model argument ``settings=NAME``: a named setting under
the user's decoding arguments. A protocol fixes its own settings, so the two are refused together.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from ..core.config import DecodeConfigError
from ..core.errors import InputError
from ..recommended import check_settings_name
from .protocols import PROTOCOLS, Protocol, joined

LIST, PROTOCOL, DRY_RUN, SETTINGS = "--list-protocols", "--protocol", "--dry-run", "--settings"
MERGED = ("model_args", "gen_kwargs")  # the harness merges these flags key by key
_MISSING = object()


class ProtocolError(InputError):
    """A protocol request that cannot run (bad input: ``error:`` and exit code 2)."""


@dataclasses.dataclass(frozen=True)
class ProtocolRun:
    """The harness's arguments for this run and whether only to print them."""

    argv: list[str]
    protocol: Protocol | None = None
    dry_run: bool = False


def listing() -> str:
    """One line per protocol: name, model, task and shots, the decode settings."""
    rows = [("protocol", "model", "task", "settings")]
    for p in PROTOCOLS.values():
        shots = f"{p.task} ({p.shots}-shot{', chat' if p.chat else ''})"
        settings = p.decode if p.generates else p.likelihood
        text = ",".join(f"{k}={v}" for k, v in {**settings, **p.sampling}.items())
        rows.append((p.name, p.model, shots, text))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(" ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + " " + row[3] for row in rows)


def _split(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """(protocol name, dry run, the other arguments)."""
    name, dry_run, rest = None, False, []
    items = iter(argv)
    for arg in items:
        if arg == DRY_RUN:
            dry_run = True
            continue
        if arg == PROTOCOL or arg.startswith(PROTOCOL + "="):
            value = arg.split("=", 1)[1] if "=" in arg else next(items, None)
            if value is None or value.startswith("--"):
                raise ProtocolError(f"{PROTOCOL} needs a name ({LIST} lists them)")
            if name is not None:
                raise ProtocolError(f"{PROTOCOL} given twice ({name}, {value}): one protocol per run")
            name = value
            continue
        rest.append(arg)
    return name, dry_run, rest


def with_settings(argv: list[str]) -> list[str]:
    """``argv`` with ``--settings NAME`` turned into the model argument ``settings=NAME`` (put first,
    so a ``settings`` in the user's own ``--model_args`` wins); refused with ``--protocol``."""
    name, rest, items = None, [], iter(argv)
    for arg in items:
        if arg == SETTINGS or arg.startswith(SETTINGS + "="):
            value = arg.split("=", 1)[1] if "=" in arg else next(items, None)
            if value is None or value.startswith("--"):
                raise ProtocolError(f"{SETTINGS} needs a name (recommended)")
            name = value
            continue
        rest.append(arg)
    if name is None:
        return rest
    try:
        check_settings_name(name)
    except DecodeConfigError as exc:
        raise ProtocolError(f"{SETTINGS}: {exc}") from None
    if any(a == PROTOCOL or a.startswith(PROTOCOL + "=") for a in rest):
        raise ProtocolError(
            f"{SETTINGS} {name} and {PROTOCOL} cannot be combined: a protocol runs its own decoding settings "
            f"(give one or the other; {PROTOCOL} with --model_args changes single settings)"
        )
    at = 1 if rest[:1] == ["run"] else 0
    return [*rest[:at], "--model_args", f"settings={name}", *rest[at:]]


def lookup(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ProtocolError(f"unknown protocol {name!r}; python -m psd_jax.evaluate {LIST} lists them")
    return PROTOCOLS[name]


def _flags(argv: list[str]) -> list[list[str]]:
    """A protocol's argv as [flag, values...] groups (its values never start with --)."""
    groups: list[list[str]] = []
    for arg in argv:
        if arg.startswith("--"):
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return groups


def merged(protocol: Protocol, user: list[str], harness_cli: type) -> list[str]:
    """The protocol's flags that the user did not give, then the user's."""
    parser = harness_cli()._parser
    empty, given = vars(parser.parse_args(["run"])), vars(parser.parse_args(["run", *user]))
    replaced = {dest for dest, value in given.items() if empty.get(dest, _MISSING) != value} - set(MERGED)
    own = {"model_args": protocol.model_args(), "gen_kwargs": protocol.gen_kwargs()}
    kept: list[str] = []
    for group in _flags(protocol.harness_argv()):
        dest = group[0][2:]
        if dest in MERGED:  # the user's keys replace the protocol's here, so the harness merges no overlap
            left = {k: v for k, v in own[dest].items() if k not in (given.get(dest) or {})}
            group = [group[0], joined(left)] if left else []
        if dest not in replaced:
            kept += group
    return kept + user


def _check_model(protocol: Protocol, argv: list[str], harness_cli: type) -> None:
    """The run's ``pretrained`` must be a local directory of the protocol's family."""
    from models import ConfigError, load_config

    args = harness_cli()._parser.parse_args(["run", *argv])
    if args.model != "psd_jax":
        return
    pretrained = str((args.model_args or {}).get("pretrained", ""))
    if not Path(pretrained).is_dir():
        if pretrained == protocol.model:
            raise ProtocolError(
                f"protocol {protocol.name} evaluates {protocol.model}: download it (hf download {protocol.model} "
                "--local-dir DIR) and add --model_args pretrained=DIR"
            )
        return  # the model arguments' own check names it
    try:
        family = load_config(pretrained).family
    except ConfigError:
        return  # ditto
    if family != protocol.family:
        raise ProtocolError(
            f"protocol {protocol.name} is for {protocol.family} checkpoints ({protocol.model}); "
            f"pretrained={pretrained} is a {family} checkpoint"
        )


def resolve(argv: list[str], harness_cli: type) -> ProtocolRun:
    """The run ``argv`` asks for: with ``--protocol``, its flags under the user's."""
    name, dry_run, rest = _split(argv)
    if name is None:
        return ProtocolRun(rest, None, dry_run)
    protocol = lookup(name)
    user = rest[1:] if rest[:1] == ["run"] else rest
    full = merged(protocol, user, harness_cli)
    settings = (harness_cli()._parser.parse_args(["run", *full]).model_args or {}).get("settings")
    if settings is not None:
        raise ProtocolError(
            f"the model argument settings={settings} and {PROTOCOL} {name} cannot be combined: a protocol runs "
            "its own decoding settings"
        )
    if not dry_run:
        _check_model(protocol, full, harness_cli)
    return ProtocolRun(full, protocol, dry_run)


def command(run: ProtocolRun) -> str:
    """The command ``--dry-run`` prints (with the protocol's source and what differs as comments)."""
    lines = []
    if run.protocol is not None:
        p = run.protocol
        lines.append(f"# protocol {p.name}: {p.source}" + (f" (on top of {p.base})" if p.base else ""))
        if p.differs:
            lines.append(f"# differs: {p.differs}")
    groups = _flags(run.argv) if run.argv and run.argv[0].startswith("--") else [run.argv]
    body = " \\\n    ".join(shlex.join(group) for group in groups)
    lines.append(f"python -m psd_jax.evaluate {body}")
    return "\n".join(lines)
