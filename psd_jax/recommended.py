"""The recommended setting of a model directory: what its first run shows and what every front end
runs when asked for ``recommended`` by name.

A model directory may hold ``recommended.json``, written by ``python -m psd_jax.tune --write``:

    {"settings": {<DecodeConfig fields>}, "provenance": {<how it was chosen: data, accuracy, TPF>}}

``settings`` are ``DecodeConfig`` fields applied over the directory's ``decode_defaults.json``
(they may set the block length the tuner searched). Without the file the library's own
recommendation (``config.RECOMMENDED``) is used. Field names are checked when the file is read;
values when the settings are made for a decode (``api.model_settings``), where the lengths are known.

Every front end resolves a settings name (``--settings NAME``, ``settings=NAME``, a request's
``"settings"``) with ``named_settings``: ``None`` is the plain defaults, ``recommended`` this
setting; its fields are the base of ``api.model_settings`` (a user's flags over them, they over the
directory's ``decode_defaults.json``: a tuned block length wins over the directory's).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .config import RECOMMENDED, DecodeConfig, DecodeConfigError

RECOMMENDED_FILE = "recommended.json"
NAME = "recommended"  # the name every front end accepts for it
SETTINGS_NAMES = (NAME,)  # every named setting (``--settings``)
LIBRARY_SOURCE = "psd_jax.config.RECOMMENDED"


@dataclasses.dataclass(frozen=True)
class Recommendation:
    settings: dict[str, Any]  # DecodeConfig fields over the directory's decode defaults
    provenance: dict[str, Any]  # how it was chosen (empty for the library default)
    source: str  # the file it was read from, or "psd_jax.config.RECOMMENDED"

    @property
    def tuned(self) -> bool:
        """Read from the directory's file (not the library default)."""
        return self.source != LIBRARY_SOURCE

    def origin(self) -> str:
        """Where the setting came from, for a front end's output."""
        if self.tuned:
            return f"tuned, from {self.source}"
        return f"the library default ({LIBRARY_SOURCE}; no {RECOMMENDED_FILE} in the model directory)"


def read_recommended(model_dir: str | Path | None) -> Recommendation:
    """The directory's tuned setting if it has one, else the library's ``RECOMMENDED``."""
    file = Path(model_dir) / RECOMMENDED_FILE if model_dir is not None else None
    if file is None or not file.is_file():
        return Recommendation(dict(RECOMMENDED), {}, LIBRARY_SOURCE)
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise DecodeConfigError(f"{file}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise DecodeConfigError(f'{file}: expected {{"settings": {{...}}, "provenance": {{...}}}}')
    settings = data["settings"]
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(DecodeConfig)})
    if unknown:
        raise DecodeConfigError(f"{file}: unknown decoding setting(s) {unknown}")
    return Recommendation(settings, dict(data.get("provenance") or {}), str(file))


def write_recommended(model_dir: str | Path, settings: DecodeConfig, provenance: dict[str, Any]) -> Path:
    """Store ``settings`` (the fields that differ from ``DecodeConfig``'s defaults, block length
    included; steps only when they are not one per generated token, which holds at any length) as
    the directory's recommended setting; returns the file written."""
    fields = settings.changed()
    fields.pop("gen_length", None)  # the generation length is the caller's: only the decoder is recommended
    if settings.policy != "threshold_schedule" and settings.steps == settings.gen_length:
        fields.pop("steps")  # one token per step, at any generation length
    fields["block_length"] = settings.block_length
    file = Path(model_dir) / RECOMMENDED_FILE
    file.write_text(json.dumps({"settings": fields, "provenance": provenance}, indent=2) + "\n")
    return file


def check_settings_name(name: str | None) -> None:
    """``None`` or a known setting name; anything else is a ``DecodeConfigError`` naming it."""
    if name is not None and name not in SETTINGS_NAMES:
        raise DecodeConfigError(f"unknown settings {name!r}; choose one of: {', '.join(SETTINGS_NAMES)}")


def named_settings(name: str | None, model_dir: str | Path | None) -> dict[str, Any] | None:
    """The ``DecodeConfig`` fields of the setting ``name`` for ``model_dir``, to pass as
    ``api.model_settings``'s ``base``: ``None`` for the plain defaults, the directory's
    recommended setting for ``recommended``. The one resolver of a settings name, so that every
    front end accepts the same names and refuses the same way (``DecodeConfigError``)."""
    check_settings_name(name)
    if name is None:
        return None
    recommendation = read_recommended(model_dir)
    _check_values(recommendation)
    return dict(recommendation.settings)


def _check_values(recommendation: Recommendation) -> None:
    """The values of a recommended setting, checked as far as they do not depend on the decode's
    generation length (that check, and the steps', comes with the lengths), so that a bad value is
    an error naming the file rather than a decode's."""
    probe = {k: v for k, v in recommendation.settings.items() if k not in ("gen_length", "steps")}
    block = probe.get("block_length", DecodeConfig.block_length)
    if isinstance(block, int) and not isinstance(block, bool) and block > 0:
        probe["gen_length"] = 8 * block
    try:
        DecodeConfig(**probe)
    except DecodeConfigError as exc:
        raise DecodeConfigError(f"{recommendation.source}: {exc}") from None
