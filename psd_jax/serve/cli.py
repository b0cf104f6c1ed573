"""``python -m psd_jax.serve``: the OpenAI-compatible server (FastAPI + uvicorn, the ``serve`` extra).

Decoding flags are ``generate``'s (one per ``DecodeConfig`` field): they set the server's default
settings, over the model directory's ``decode_defaults.json`` (and over its recommended setting
with ``--settings recommended``); each request may override those ``--allow-overrides`` names
(default: all), and ask for the recommended setting by name (``"settings": "recommended"``). The limit flags cap one request's work (their defaults
derive from the model and the server's settings); ``--api-key`` (or ``PSD_JAX_API_KEY``) guards
``/v1/*``. Bad flags print one ``error:`` line and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from ..api import InputError
from ..cli.flags import (
    EXIT_BAD_INPUT,
    ArgumentParser,
    add_cluster_flags,
    add_decode_flags,
    add_settings_flag,
    add_weight_flags,
    decode_fields,
    non_negative_int,
    positive_int,
)
from ..cli.startup import FrontEndStart
from ..core.config import MAX_BRANCHES, DecodeConfig, DecodeConfigError
from ..core.lengths import check_context
from ..parallel import multihost
from ..parallel.sharding import MeshError
from ..recommended import NAME, named_settings, read_recommended, settings_on_any_device
from ..tokenizer import TokenizerError
from .batcher import BATCHING
from .limits import MAX_BODY_BYTES, LimitError, ServerLimits, overrides_from

DEFAULT_PORT = 8000
MAX_BATCH = 8
API_KEY_ENV = "PSD_JAX_API_KEY"


def non_negative_float(text: str) -> float:
    """argparse type for ``--max-wait-ms``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type for ``--request-timeout``."""
    value = non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def port_number(text: str) -> int:
    """argparse type for ``--port``: a TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {value}")
    return value


def field_set(text: str) -> frozenset[str]:
    """argparse type for ``--allow-overrides``: all, none or comma-separated ``DecodeConfig`` fields."""
    try:
        return overrides_from(text)
    except LimitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key ``/v1/*`` requires: ``--api-key``, else ``PSD_JAX_API_KEY``, else none (open).
    An empty key is refused: it would be a guard that nothing can pass, or one set by mistake."""
    key, source = (flag, "--api-key") if flag is not None else (environ.get(API_KEY_ENV), API_KEY_ENV)
    if key is not None and not key.strip():
        raise LimitError(f"{source} is empty: give a key, or leave it unset for a server without one")
    return key


def length_list(text: str) -> tuple[int, ...]:
    """argparse type for ``--warmup-lengths`` and ``--batch-sizes``: comma-separated positive
    integers, or ``none``."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(positive_int(t) for t in text.split(",") if t.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers or none, got {text!r}") from None


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m psd_jax.serve", description=__doc__)
    p.add_argument("--model", help="HF or converted model directory (default: the shipped default model)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    add_settings_flag(p)
    add_decode_flags(p)
    add_weight_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"TCP port (default: {DEFAULT_PORT})")
    add_batching_flags(p)
    add_limit_flags(p)
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require Authorization: Bearer KEY on /v1/* (default: ${API_KEY_ENV}, else no key; "
        "/health and /metrics stay open)",
    )
    p.add_argument(
        "--no-playground",
        dest="playground",
        action="store_false",
        help="do not serve the browser playground at / (a page that decodes through /v1 with the trace and "
        "animates it; with --api-key it asks for the key)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_cluster_flags(p)
    return p


def add_batching_flags(p: ArgumentParser) -> None:
    """How requests are batched, compiled, timed out and drained."""
    p.add_argument(
        "--batching",
        choices=BATCHING,
        default="continuous",
        help="continuous: finished rows leave and queued requests join a running batch between block calls; "
        "static: a batch decodes until its last row is done (default: continuous)",
    )
    p.add_argument("--max-batch", type=positive_int, help=f"most requests decoded in one batch (default: {MAX_BATCH})")
    p.add_argument(
        "--gen-bucket",
        type=positive_int,
        metavar="N",
        help="requests whose max_tokens round up to the same multiple of N positions share a compiled canvas; "
        "each row decodes its own length (default: the server's gen_length)",
    )
    p.add_argument(
        "--max-programs",
        type=positive_int,
        metavar="N",
        help="compiled decode programs kept, the least recently used dropped beyond it (default: no limit)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive_float,
        metavar="S",
        help="seconds a request may take; past it its row stops at the next block boundary and the client gets "
        "a 504 error (default: none)",
    )
    p.add_argument(
        "--drain-seconds",
        type=non_negative_float,
        default=30.0,
        metavar="S",
        help="on SIGTERM: new requests get 503, running ones get S seconds to finish, then an error; "
        "then the server exits 0 (default: 30)",
    )
    p.add_argument(
        "--batch-sizes",
        type=length_list,
        help="the compiled batch sizes a batch is padded to; the largest is the most in one batch "
        "(default: powers of two up to --max-batch)",
    )
    p.add_argument(
        "--max-wait-ms", type=non_negative_float, default=10.0, help="how long a request waits for others to batch with"
    )
    p.add_argument("--max-queue", type=positive_int, default=256, help="waiting requests beyond this get 503")
    p.add_argument("--prompt-bucket", type=positive_int, default=32, help="pad prompt lengths up to a multiple of this")
    p.add_argument(
        "--warmup-lengths",
        type=length_list,
        help="prompt lengths whose buckets the default settings are compiled for at start-up, at every batch size "
        "(default: one and two prompt buckets; none: compile on first use)",
    )


def add_limit_flags(p: ArgumentParser) -> None:
    """What one request may ask for (docs/serving.md#limits)."""
    limits = p.add_argument_group(
        "request limits (docs/serving.md#limits); a request past one gets 400 (413 for the body)"
    )
    limits.add_argument(
        "--max-tokens",
        type=positive_int,
        metavar="N",
        help="most generation positions a request may ask for, max_tokens rounded up to whole blocks "
        "(default: the model's context less one prompt bucket, and at least the default gen_length)",
    )
    limits.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        metavar="N",
        help="most prompt tokens a request may send (default: the model's context less the default gen_length)",
    )
    limits.add_argument(
        "--max-depth",
        type=non_negative_int,
        metavar="N",
        help=f"deepest PSD depth (default: MAX_BRANCHES - 1 = {MAX_BRANCHES - 1})",
    )
    limits.add_argument(
        "--max-k-max",
        type=positive_int,
        metavar="N",
        help=f"most RPS branches k_max (default: MAX_BRANCHES - 1 = {MAX_BRANCHES - 1})",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=positive_int,
        metavar="N",
        help=f"largest request body; beyond it 413 before parsing (default: {MAX_BODY_BYTES}, 1 MiB)",
    )
    limits.add_argument(
        "--allow-overrides",
        type=field_set,
        metavar="FIELDS",
        help="the DecodeConfig fields a request may change, comma-separated, or all or none (default: all); "
        "max_tokens counts as gen_length, seed is always allowed, restating the server's value always is",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    warmup = args.warmup_lengths if args.warmup_lengths is not None else (args.prompt_bucket, 2 * args.prompt_bucket)
    max_batch = largest_batch(parser, args)
    try:
        from .app import build_app
        from .lockstep import LockstepModel
        from .server import serve
    except ImportError as exc:
        print(
            f"error: the server needs the serve extra ({exc.name} is missing): pip install -e '.[serve]'",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    try:
        start = start_up(args, warmup)
    except (InputError, DecodeConfigError, TokenizerError, MeshError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    lm = start.lm
    if start.cluster is not None and multihost.process_count() > 1:
        from .lockstep import Channel, NotJoined

        channel = Channel(jax_process_index(), multihost.process_count(), start.cluster.heartbeat_timeout_s / 2)
        if not multihost.is_main():
            return follow_process_zero(lm, channel, args.max_programs)
        try:
            channel.wait_for_followers()
        except NotJoined as exc:
            exit_now(f"error: {exc}")
        lm = LockstepModel(lm, channel)
    app = build_app(
        lm,
        start.defaults,
        name=args.served_model_name or start.model_dir.resolve().name,
        max_batch=max_batch,
        batch_sizes=args.batch_sizes,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        prompt_bucket=args.prompt_bucket,
        warmup_lengths=warmup,
        limits=start.limits,
        api_key=start.api_key,
        batching=args.batching,
        gen_bucket=args.gen_bucket,
        max_programs=args.max_programs,
        request_timeout_s=args.request_timeout,
        recommended=start.recommended,
        playground=args.playground,
    )
    if args.settings is not None:  # say which device the named setting was chosen for
        print(f"default settings: {args.settings}, {read_recommended(start.model_dir).origin()}", file=sys.stderr)
    lockstep = lm if isinstance(lm, LockstepModel) else None
    opts = dict(host=args.host, port=args.port, log_level=args.log_level, drain_seconds=args.drain_seconds)
    lost = serve(app, **opts, lockstep=lockstep)
    if lost is not None:
        exit_now(f"error: {lost.message}")
    return 0


def largest_batch(parser: ArgumentParser, args: argparse.Namespace) -> int:
    """The most requests in one batch, from ``--batch-sizes`` or ``--max-batch`` (which must agree)."""
    if args.batch_sizes is not None and not args.batch_sizes:
        parser.error("--batch-sizes needs at least one size")
    if args.batch_sizes and args.max_batch is not None and max(args.batch_sizes) != args.max_batch:
        parser.error(f"--max-batch {args.max_batch} is not the largest of --batch-sizes {args.batch_sizes}")
    return max(args.batch_sizes) if args.batch_sizes else args.max_batch or MAX_BATCH


@dataclasses.dataclass
class StartUp:
    """What the server starts from: the model and the settings and limits its requests get."""

    cluster: Any
    api_key: str | None
    model_dir: Path
    defaults: DecodeConfig
    recommended: dict[str, Any] | None  # a request's "settings": "recommended" (DecodeConfig fields)
    limits: ServerLimits
    lm: Any


def start_up(args: argparse.Namespace, warmup: tuple[int, ...]) -> StartUp:
    """Every check that needs no device and no weights (cluster flags, API key, the settings as far as
    they hold on any device), then the cluster, then what depends on the device kind (the
    recommended settings are chosen per kind) and the limits, then the weights: bad input fails
    before the processes wait for one another and before the long load."""
    start = FrontEndStart.begin(args)
    cluster, model_dir, mcfg = start.cluster, start.model_dir, start.config
    api_key = api_key_from(args.api_key, os.environ)
    start.precheck(decode_fields(args), args.settings)
    settings_on_any_device(NAME, model_dir)  # a request's "settings": "recommended", checked alike
    start.join()
    defaults = start.settings(decode_fields(args), args.settings)
    recommended = named_settings(NAME, model_dir)  # what a request's "settings": "recommended" asks for
    limits = ServerLimits.for_model(
        mcfg,
        defaults,
        args.prompt_bucket,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_depth=args.max_depth,
        max_k_max=args.max_k_max,
        max_body_bytes=args.max_body_bytes,
        overrides=args.allow_overrides,
    )
    lm = start.load()
    defaults = lm.settings(defaults)
    for length in warmup:
        check_context(length, args.prompt_bucket, defaults.gen_length, lm.config.max_length)
    return StartUp(cluster, api_key, model_dir, defaults, recommended, limits, lm)


def jax_process_index() -> int:
    import jax

    return jax.process_index()


def exit_now(message: str) -> NoReturn:
    """Print ``message`` and end the process with code 1 at once: a normal exit would first wait
    at ``jax.distributed``'s shutdown barrier for a process that is gone."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def follow_process_zero(lm, channel, max_programs: int | None) -> int:
    """A process other than 0: no HTTP; make process 0's calls until it stops the server (exit 0)
    or is gone (an error, exit 1). A signal here does not stop it: process 0 drains and stops
    every process."""
    from .lockstep import follow

    lm.max_programs = max_programs  # the same programs kept as process 0 keeps
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: print(FOLLOWER_SIGNAL, file=sys.stderr, flush=True))
    try:
        follow(lm, channel)
    except Exception as exc:
        exit_now(f"error: process 0 of the serving processes is gone ({type(exc).__name__}: {exc})")
    return 0


FOLLOWER_SIGNAL = "this process makes process 0's calls; stop the server on process 0, which stops every process"
