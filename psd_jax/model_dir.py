"""A model directory and the settings a decode on it starts from: the directory checked before any
weight is read (``model_directory``), the lengths it declares it was trained for
(``decode_defaults``), and the settings every front end builds (``model_settings``: a user's fields
over a named setting over those lengths; ``checked_settings``: and checked against the model's
config before the weights load; ``precheck_settings``: as far as they hold whatever the device, for a
front end that starts a cluster first)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convert.orbax_io import is_orbax_dir
from convert.safetensors_dir import INDEX_FILE, SINGLE_FILE, CheckpointError
from models import ModelConfig, load_config

from .core.config import (
    ENTROPY_BOUND_FAMILY,
    DecodeConfig,
    DecodeConfigError,
    check_fields_for_model,
    check_for_model,
    merged_fields,
)
from .recommended import named_settings, settings_on_any_device

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"


def default_model_path() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the shipped default model is missing ({DEFAULT_MODEL_DIR / 'config.json'}); "
            "pass --model PATH to a model directory"
        )
    return DEFAULT_MODEL_DIR


def model_directory(path: str | Path | None) -> Path:
    """The directory ``load_model`` reads (``None``: the shipped model), checked without reading any
    weights: it exists, has a ``config.json`` and has weights (safetensors or a converted
    checkpoint). Front ends call this first, so a wrong path fails before any other work."""
    path = Path(path) if path is not None else default_model_path()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: not a model directory (no config.json)")
    if not (is_orbax_dir(path) or (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()):
        raise CheckpointError(
            f"{path}: no weights: neither a Hugging Face safetensors directory ({SINGLE_FILE} or {INDEX_FILE}) "
            "nor a converted checkpoint"
        )
    return path


DECODE_DEFAULTS_FILE = "decode_defaults.json"
DECODE_DEFAULT_KEYS = ("gen_length", "block_length")


def decode_defaults(path: str | Path) -> dict[str, int]:
    """The generation/block length a model directory declares it was trained for (may be empty).

    A small model trained on fixed-length answers (the shipped one: 48 tokens in blocks of 16)
    decodes well only at that length, so its directory says so and the CLI and benchmark default
    to it.
    """
    file = Path(path) / DECODE_DEFAULTS_FILE
    if not file.is_file():
        return {}
    values = json.loads(file.read_text())
    unknown = sorted(set(values) - set(DECODE_DEFAULT_KEYS))
    if unknown:
        raise ValueError(f"{file}: unknown keys {unknown}; allowed: {', '.join(DECODE_DEFAULT_KEYS)}")
    return {key: int(value) for key, value in values.items()}


def model_settings(
    model_dir: str | Path | None, fields: dict[str, Any] | None = None, base: dict[str, Any] | None = None
) -> DecodeConfig:
    """The settings of a decode on ``model_dir``: ``fields`` (``DecodeConfig`` fields a user set)
    over ``base`` (a named setting: ``recommended.named_settings``) over the directory's
    ``decode_defaults.json`` over ``DecodeConfig``'s own defaults; so a block length in ``base``
    (the one a tuner chose) wins over the directory's but not over a user's. A block length not
    given falls back to min(32, gen_length). ``fields`` apply to ``base`` as
    ``config.settings_from`` does: ``decoder="rps"`` over a PSD base drops the base's depth.

    Every front end (CLI, benchmark, evaluation, server) builds its settings here."""
    fields = {k: v for k, v in (fields or {}).items() if v is not None}
    base = dict(base or {})
    mcfg = _config(model_dir)
    if mcfg is not None:
        check_fields_for_model(fields, mcfg)
    canvas = mcfg.canvas_length if mcfg is not None and mcfg.family == ENTROPY_BOUND_FAMILY else None
    if canvas is not None:  # DiffusionGemma: its release's generation settings, in whole canvases
        base = canvas_fields({**release_settings(model_dir), **base}, canvas)
        fields = canvas_fields(fields, canvas) if "gen_length" in fields else fields
    defaults = decode_defaults(model_dir) if model_dir is not None and Path(model_dir).is_dir() else {}
    lengths = {
        **defaults,
        **{k: base.pop(k) for k in DECODE_DEFAULT_KEYS if k in base},
        **{k: fields.pop(k) for k in DECODE_DEFAULT_KEYS if k in fields},
    }
    if "block_length" not in lengths:
        gen_length = lengths.get("gen_length", DecodeConfig.gen_length)
        if isinstance(gen_length, int) and gen_length > 0:
            lengths["block_length"] = min(DecodeConfig.block_length, gen_length)
    try:
        return DecodeConfig(**merged_fields({**base, **lengths}, fields))
    except TypeError as exc:  # an unknown field name
        raise DecodeConfigError(f"unknown decoding setting: {exc}") from None


GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's keys -> DecodeConfig fields (DiffusionGemma's sampler: upstream's names).
RELEASE_KEYS = {
    "max_new_tokens": "gen_length",
    "max_denoising_steps": "max_denoising_steps",
    "t_min": "t_min",
    "t_max": "t_max",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}


def _config(model_dir: str | Path | None) -> ModelConfig | None:
    """The model directory's config, if it has one."""
    if model_dir is None or not Path(model_dir, "config.json").is_file():
        return None
    return load_config(model_dir)


def release_settings(model_dir: str | Path) -> dict[str, Any]:
    """The sampler settings a DiffusionGemma release ships in ``generation_config.json`` (upstream's
    ``generate`` defaults), as ``DecodeConfig`` fields; adaptive stopping switched off there (null)
    is ``confidence_threshold`` 0. Empty without the file."""
    file = Path(model_dir) / GENERATION_CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise DecodeConfigError(f"{file}: not JSON ({exc})") from None
    out = {field: raw[key] for key, field in RELEASE_KEYS.items() if key in raw}
    bound = (raw.get("sampler_config") or {}).get("entropy_bound")
    if bound is not None:
        out["entropy_bound"] = bound
    if out.get("stability_threshold", 0) is None or out.get("confidence_threshold", 0) is None:
        out.update(stability_threshold=0, confidence_threshold=0.0)
    return out


def canvas_fields(fields: dict[str, Any], canvas: int) -> dict[str, Any]:
    """``fields`` in whole canvases, as upstream's ``generate`` runs ``max_new_tokens``: the
    generation length rounded up to a multiple of ``canvas``, and the canvas as the block (a block
    length given stays, for ``check_for_model`` to refuse if it is not the canvas)."""
    out = dict(fields)
    length = out.get("gen_length")
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        out["gen_length"] = -(-length // canvas) * canvas
    out.setdefault("block_length", canvas)
    return out


def checked_settings(
    model_dir: Path, fields: dict[str, Any] | None = None, name: str | None = None
) -> tuple[DecodeConfig, ModelConfig]:
    """A front end's start: its settings on ``model_dir`` (``model_settings``: ``fields`` over the
    named setting ``name``), checked against the model's config before the weights load (a bad
    length or option is one line, not minutes later); and that config."""
    settings = model_settings(model_dir, fields, named_settings(name, model_dir))
    mcfg = load_config(model_dir)
    check_for_model(settings, mcfg)
    return settings, mcfg


def precheck_settings(
    model_dir: Path, fields: dict[str, Any] | None = None, name: str | None = None
) -> tuple[DecodeConfig, ModelConfig]:
    """``checked_settings``' checks as far as they hold on every device, asking JAX nothing: what a
    front end on several processes checks before the cluster starts (``jax.distributed`` must
    start before anything reads the device kind a recommendation is chosen by). ``fields`` over
    each base the setting ``name`` may give (``recommended.settings_on_any_device``); refused with
    the first base's error when they fail over every one, since they then fail on this device too.
    Returns the settings over the first base they hold over, and the model's config."""
    mcfg = load_config(model_dir)
    first: DecodeConfigError | None = None
    for base in settings_on_any_device(name, model_dir):
        try:
            settings = model_settings(model_dir, fields, base)
            check_for_model(settings, mcfg)
            return settings, mcfg
        except DecodeConfigError as exc:
            first = first or exc
    assert first is not None  # settings_on_any_device gives at least one base
    raise first
