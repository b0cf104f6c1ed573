"""The recommended setting of a model directory: what its first run shows and what every front end
runs when asked for ``recommended`` by name.

A model directory may hold ``recommended.json``, written by ``python -m psd_jax.tune --write``:

    {"settings": {<DecodeConfig fields>}, "provenance": {<how it was chosen: data, accuracy, TPF>}}

``settings`` are ``DecodeConfig`` fields applied over the directory's ``decode_defaults.json``
(they may set the block length the tuner searched). Without the file the library's own
recommendation (``config.RECOMMENDED``) is used. Field names are checked when the file is read;
values when the settings are made for a decode (``api.model_settings``), where the lengths are known.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .config import RECOMMENDED, DecodeConfig, DecodeConfigError

RECOMMENDED_FILE = "recommended.json"
NAME = "recommended"  # the name every front end accepts for it


@dataclasses.dataclass(frozen=True)
class Recommendation:
    settings: dict[str, Any]  # DecodeConfig fields over the directory's decode defaults
    provenance: dict[str, Any]  # how it was chosen (empty for the library default)
    source: str  # the file it was read from, or "psd_jax.config.RECOMMENDED"

    @property
    def tuned(self) -> bool:
        return bool(self.provenance)


def read_recommended(model_dir: str | Path | None) -> Recommendation:
    """The directory's tuned setting if it has one, else the library's ``RECOMMENDED``."""
    file = Path(model_dir) / RECOMMENDED_FILE if model_dir is not None else None
    if file is None or not file.is_file():
        return Recommendation(dict(RECOMMENDED), {}, "psd_jax.config.RECOMMENDED")
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
    included) as the directory's recommended setting; returns the file written."""
    fields = settings.changed()
    fields.pop("gen_length", None)  # the generation length is the caller's: only the decoder is recommended
    fields["block_length"] = settings.block_length
    file = Path(model_dir) / RECOMMENDED_FILE
    file.write_text(json.dumps({"settings": fields, "provenance": provenance}, indent=2) + "\n")
    return file
