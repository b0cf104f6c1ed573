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
the harness's ``results_<date>.json``. Bad model arguments or requests print one ``error:`` line
and exit with code 2. docs/evaluation.md has the papers' protocols as commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .flags import EXIT_BAD_INPUT

MODEL_NAME = "psd_jax"
SUBCOMMANDS = ("run", "ls", "validate")


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
    from .api import InputError
    from .config import DecodeConfigError
    from .harness_args import EvalArgsError
    from .sharding import MeshError
    from .tokenizer import TokenizerError

    return (InputError, DecodeConfigError, EvalArgsError, MeshError, TokenizerError, FileNotFoundError)


def precheck(argv: list[str]) -> None:
    """Check a psd_jax run's model arguments before the harness starts (it indexes every task
    first): the same parse the harness does (its own parser), then ``parse_eval_args``."""
    from lm_eval._cli import HarnessCLI

    from .harness_args import parse_eval_args

    full = argv if argv and argv[0] in SUBCOMMANDS else ["run", *argv]
    if full[0] != "run" or {"-h", "--help"} & set(full):
        return
    args = HarnessCLI()._parser.parse_args(full)
    if getattr(args, "model", None) != MODEL_NAME or getattr(args, "config", None):
        return  # another model, or model arguments from a YAML config: checked when the model is made
    raw = dict(args.model_args or {})
    if getattr(args, "batch_size", None) is not None:
        raw["batch_size"] = args.batch_size
    parse_eval_args(raw)


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
    argv = with_default_model(list(sys.argv[1:] if argv is None else argv))
    try:
        from lm_eval.__main__ import cli_evaluate

        from .harness import CREATED
    except ImportError as exc:
        print(f"error: lm-evaluation-harness is not installed ({exc}); pip install -e '.[eval]'", file=sys.stderr)
        return EXIT_BAD_INPUT
    first = len(CREATED)
    saved, sys.argv = sys.argv, [f"{Path(sys.executable).name} -m psd_jax.evaluate", *argv]
    try:
        precheck(argv)
        cli_evaluate()
    except _bad_input_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        sys.argv = saved
    report(argv, CREATED[first:])
    return 0


def efficiency_files(root: str | Path) -> list[dict]:
    """The efficiency records written under ``root`` (newest last)."""
    files = sorted(Path(root).rglob("efficiency*.json"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text()) for p in files]


if __name__ == "__main__":
    sys.exit(main())
