"""The harness model's arguments (``--model_args``): parsed, typed and checked before any model call.

The harness hands ``--model_args a=1,b=x`` over as keyword arguments, values already turned into
``bool``/``int``/``float`` where they look like one (or left as strings by the Python API).
Decoding settings keep their ``DecodeConfig`` field names and kinds (``config.INT_FIELDS`` ...), so
every setting ``python -m psd_jax.generate`` has is a model argument of the same name, and the
settings are built by ``model_dir.model_settings`` exactly as there, over the named setting
``settings=recommended`` (``--settings recommended``) when one is given. Anything else must be one
of ``EVAL_ARGS``; an unknown name is an error that names it.

``mesh=data=1,model=8`` contains the harness's own separators: the harness splits it into
``mesh="data=1"`` and ``model=8``. Mesh axis names left over as arguments are folded back into the
mesh (``data``/``model`` are no other argument's name), and ``mesh=data=1;model=8`` works as well.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from convert.orbax_io import is_orbax_dir, stored_quantize
from convert.safetensors_dir import CheckpointError
from models import ConfigError
from models.quantize import INT4_ON_A_MESH, QUANTIZE

from ..api import DTYPES
from ..cli.startup import FrontEndStart
from ..core.config import (
    BOOL_FIELDS,
    CHOICES,
    FIELD_HELP,
    FLOAT_FIELDS,
    INT_FIELDS,
    DecodeConfig,
    DecodeConfigError,
    check_for_model,
)
from ..core.errors import InputError
from ..model_dir import model_settings
from ..parallel.sharding import AXES
from ..recommended import RECOMMENDED_FILE, named_settings

# Arguments the harness itself passes to every model (from --batch_size, --max_batch_size,
# --device, --trust_remote_code); accepted, see EvalArgs for what each does here.
HARNESS_ARGS = ("batch_size", "max_batch_size", "device", "trust_remote_code")

EVAL_ARGS: dict[str, str] = {
    "pretrained": "model directory: Hugging Face LLaDA/Dream or converted (default: the shipped model)",
    "settings": f"a named setting under the decoding arguments: recommended (the model directory's {RECOMMENDED_FILE}, "
    "else the library's recommendation); default: none",
    "dtype": f"weight dtype: {', '.join(DTYPES)} (default float32)",
    "quantize": f"weight-only quantization of the projections: {', '.join(QUANTIZE)} (default none)",
    "mesh": "device mesh, e.g. data=1,model=8 (or data=1;model=8); default: one device",
    "seed": "PRNG seed of sampling and of the likelihood estimator's masks (default 0)",
    "prompt_bucket": "pad prompt lengths to a multiple of this (default 32)",
    "add_bos_token": "prepend the tokenizer's BOS to prompts that do not start with it (default false)",
    "add_special_tokens": "encode text as tokenizer(text) does, with the special tokens the tokenizer adds itself "
    "(the upstream evaluation scripts' call; default false: exactly the text the harness renders)",
    "mc_num": "loglikelihood: Monte Carlo samples per request (default 128, as LLaDA)",
    "mc_batch": "loglikelihood: samples per stratified draw, must divide mc_num (LLaDA's batch_size; default min(32, mc_num))",
    "cfg": "loglikelihood: classifier-free guidance scale of the estimator (default 0; generation uses cfg_scale)",
    "is_check_greedy": "loglikelihood: also check that greedy one-token-per-step decoding gives the continuation (default false)",
    "batch_size": "prompts per decode for generate_until; draws per model call for loglikelihood (default 1)",
    "max_batch_size": "accepted for the harness; only --batch_size is used",
    "device": "accepted for the harness; JAX runs on its default backend",
    "trust_remote_code": "accepted for the harness; no remote code is run",
}


class EvalArgsError(InputError):
    """Model arguments that cannot run, with the reason (bad input: ``error:`` and exit code 2)."""


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    """The checked model arguments; ``settings`` is the decode's ``DecodeConfig``."""

    pretrained: Path
    settings: DecodeConfig
    decode_fields: dict[str, Any]  # the DecodeConfig fields the user set (gen_length explicit or not)
    start: FrontEndStart = dataclasses.field(repr=False, compare=False)  # the model's start: its config, its load
    dtype: str = "float32"
    quantize: str | None = None
    mesh: str | None = None
    seed: int = 0
    prompt_bucket: int = 32
    add_bos_token: bool = False
    add_special_tokens: bool = False
    mc_num: int = 128
    mc_batch: int = 32
    cfg: float = 0.0
    is_check_greedy: bool = False
    batch_size: int = 1


def as_bool(name: str, value: Any, what: str = "model argument") -> bool:
    """``value`` as the harness or the Python API gives it (bool, 0/1, or text) as a bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise EvalArgsError(f"{what} {name} must be true or false, got {value!r}")


def as_int(name: str, value: Any, optional: bool = False, what: str = "model argument") -> int | None:
    """``value`` as an integer (``None``/``"none"`` too when ``optional``)."""
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
        return None
    if isinstance(value, bool):
        raise EvalArgsError(f"{what} {name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise EvalArgsError(f"{what} {name} must be an integer, got {value!r}") from None


def as_float(name: str, value: Any, what: str = "model argument") -> float:
    """``value`` as a float (a bool is refused: ``temperature=true`` is a mistake, not 1.0)."""
    if isinstance(value, bool):
        raise EvalArgsError(f"{what} {name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise EvalArgsError(f"{what} {name} must be a number, got {value!r}") from None


def decode_field(name: str, value: Any) -> Any:
    """One ``DecodeConfig`` field from a model argument, typed by the field's kind."""
    if name in BOOL_FIELDS:
        return as_bool(name, value)
    if name in INT_FIELDS:
        return as_int(name, value, optional=name in ("steps", "draft_rate"))
    if name in FLOAT_FIELDS:
        return as_float(name, value)
    if name in CHOICES:
        return str(value)
    raise EvalArgsError(f"unknown decoding setting {name}")


def fold_mesh(kwargs: dict[str, Any]) -> str | None:
    """The mesh spec, with axes the harness split off (``model=8``) folded back; removes them."""
    mesh = kwargs.pop("mesh", None)
    loose = {axis: kwargs.pop(axis) for axis in AXES if axis in kwargs}
    if mesh is None and not loose:
        return None
    parts = [p for p in str(mesh or "").replace(";", ",").split(",") if p.strip()]
    parts += [f"{axis}={value}" for axis, value in loose.items()]
    return ",".join(parts)


def _count(name: str, value: Any, low: int = 1) -> int:
    number = as_int(name, value)
    if number is None or number < low:
        raise EvalArgsError(f"model argument {name} must be an integer >= {low}, got {value!r}")
    return number


def _batch_size(value: Any) -> int:
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        raise EvalArgsError("--batch_size auto is not supported: give a number (prompts per decode)")
    return _count("batch_size", value if value is not None else 1)


def _estimator_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    mc_num = _count("mc_num", kwargs.get("mc_num", 128))
    mc_batch = _count("mc_batch", kwargs.get("mc_batch", min(32, mc_num)))
    if mc_num % mc_batch:
        raise EvalArgsError(f"mc_batch {mc_batch} does not divide mc_num {mc_num}")
    cfg = as_float("cfg", kwargs.get("cfg", 0.0))
    if not 0.0 <= cfg < float("inf"):
        raise EvalArgsError(f"model argument cfg must be a finite number >= 0, got {cfg!r}")
    greedy = as_bool("is_check_greedy", kwargs.get("is_check_greedy", False))
    return {"mc_num": mc_num, "mc_batch": mc_batch, "cfg": cfg, "is_check_greedy": greedy}


def _start(value: Any, dtype: str, quantize: str | None, mesh: str | None) -> FrontEndStart:
    """The model's start (``cli.startup.FrontEndStart``): the directory checked to be one
    ``load_model`` can load (its ``config.json`` read, its weights present) without reading any
    weights, so a wrong path fails here, before the harness indexes its tasks, not when the model
    is made; and the weight options it loads with."""
    try:
        return FrontEndStart.of_model_args(value if value not in (None, "") else None, dtype, quantize, mesh)
    except FileNotFoundError:
        raise EvalArgsError(f"pretrained={value}: no such model directory") from None
    except CheckpointError as exc:
        raise EvalArgsError(f"pretrained={exc}") from None
    except (ConfigError, InputError) as exc:
        raise EvalArgsError(f"pretrained={value}: {exc}") from None


def _quantize_checked(pretrained: Path, quantize: str | None, mesh: str | None) -> None:
    """``quantize`` against a checkpoint converted with ``--quantize`` (it loads as it was stored,
    or with the same setting) and int4 not with a mesh (``models.quantize.check_quantize``)."""
    stored = stored_quantize(pretrained) if is_orbax_dir(pretrained) else None
    if stored is not None and quantize not in (None, stored):
        raise EvalArgsError(f"pretrained={pretrained} was converted with --quantize {stored}, got quantize={quantize}")
    if (quantize or stored) == "int4" and mesh is not None:
        what = "quantize=int4" if quantize else f"pretrained={pretrained} (converted with --quantize int4)"
        raise EvalArgsError(f"model arguments {what} and mesh={mesh}: {INT4_ON_A_MESH}")


def _model_checked(start: FrontEndStart, settings: DecodeConfig) -> None:
    """``config.check_for_model`` on the directory's config: gen_length within the context, RPS's
    k_max within the vocabulary, no cfg on block-causal families; its refusal names ``pretrained=``."""
    try:
        check_for_model(settings, start.config)
    except DecodeConfigError as exc:
        raise EvalArgsError(f"{exc} (pretrained={start.model_dir})") from None


def parse_eval_args(raw: dict[str, Any], any_device: bool = False) -> EvalArgs:
    """Check every model argument and build the decode settings against the model directory's
    config (only ``config.json`` is read, no weights): the pre-check before the harness starts and
    the harness model's constructor both call this, so either path refuses the same arguments.
    ``any_device``: ask JAX nothing (the pre-check before a cluster starts), so a named setting is
    checked over every device kind's choice (``model_dir.precheck_settings``) and the settings are
    those of the first it holds over; the model's constructor, after the start, reads this device's."""
    kwargs = dict(raw)
    mesh = fold_mesh(kwargs)
    unknown = sorted(k for k in kwargs if k not in EVAL_ARGS and k not in FIELD_HELP)
    if unknown:
        raise EvalArgsError(
            f"unknown model argument(s) {', '.join(unknown)}; known: DecodeConfig fields "
            f"({', '.join(FIELD_HELP)}) and {', '.join(EVAL_ARGS)}"
        )
    dtype = str(kwargs.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise EvalArgsError(f"model argument dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    quantize = kwargs.get("quantize")
    quantize = None if quantize in (None, "", "none") else str(quantize)
    if quantize is not None and quantize not in QUANTIZE:
        raise EvalArgsError(f"model argument quantize must be one of {', '.join(QUANTIZE)} or none, got {quantize!r}")
    start = _start(kwargs.get("pretrained"), dtype, quantize, mesh)
    pretrained = start.model_dir
    _quantize_checked(pretrained, quantize, mesh)
    fields = {k: decode_field(k, v) for k, v in kwargs.items() if k in FIELD_HELP}
    if fields.get("trace"):  # the harness reports scores, not decodes: a trace would be dropped unseen
        raise EvalArgsError(
            "model argument trace: the harness does not report a decode's trace; record it with python -m "
            "psd_jax.generate --trace (or --show)"
        )
    name = None if kwargs.get("settings") is None else str(kwargs["settings"])
    try:
        if any_device:  # checked against the model (check_for_model) over every device's choice
            settings = start.precheck(fields, name)
        else:  # FrontEndStart.settings' two steps apart: only the model's refusal (_model_checked) names pretrained=
            settings = model_settings(pretrained, fields, named_settings(name, pretrained))
    except DecodeConfigError as exc:
        raise EvalArgsError(f"{exc} (pretrained={pretrained})" if any_device else str(exc)) from None
    if not any_device:
        _model_checked(start, settings)
    seed = as_int("seed", kwargs.get("seed", 0))
    if seed is None or not 0 <= seed < 2**32:
        raise EvalArgsError(f"model argument seed must be an integer in [0, 2**32), got {kwargs.get('seed')!r}")
    return EvalArgs(
        pretrained=pretrained,
        settings=settings,
        decode_fields=fields,
        start=start,
        dtype=dtype,
        quantize=quantize,
        mesh=mesh,
        seed=seed,
        prompt_bucket=_count("prompt_bucket", kwargs.get("prompt_bucket", 32)),
        add_bos_token=as_bool("add_bos_token", kwargs.get("add_bos_token", False)),
        add_special_tokens=as_bool("add_special_tokens", kwargs.get("add_special_tokens", False)),
        batch_size=_batch_size(kwargs.get("batch_size")),
        **_estimator_args(kwargs),
    )
