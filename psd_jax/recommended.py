"""The recommended setting of a model directory: what its first run shows and what every front end
runs when asked for ``recommended`` by name.

A model directory may hold ``recommended.json``, written by ``python -m psd_jax.tune --write``:

    {"devices": {"cpu": {"settings": {...}, "provenance": {...}, "frontier": [...]}, "gpu": {...}},
     "settings": {...}, "provenance": {...}}

one choice per device kind (``cpu``, ``gpu``, ``tpu``: the fastest setting within the tuner's loss
for that kind, measured on it or priced for a modeled target of it, with the frontier it was chosen
from), and at the top level the latest choice written, which serves a kind the file has no entry
for (a file of only the top level serves every kind). ``settings`` are ``DecodeConfig`` fields
applied over the directory's ``decode_defaults.json`` (they may set the block length the tuner
searched). Without the file the library's own recommendation (``config.RECOMMENDED``) is used.
Field names are checked when the file is read; values when the settings are made for a decode
(``model_dir.model_settings``), where the lengths are known. The device asked for is the one this process
decodes on (``jax.default_backend()``) unless given; on several processes it is read only once the
cluster has started (``jax.distributed.initialize`` must come before anything starts the backend),
and before that ``settings_on_any_device`` checks every choice the file holds.

Every front end resolves a settings name (``--settings NAME``, ``settings=NAME``, a request's
``"settings"``) with ``named_settings``: ``None`` is the plain defaults, ``recommended`` this
setting; its fields are the base of ``model_dir.model_settings`` (a user's flags over them, they over the
directory's ``decode_defaults.json``: a tuned block length wins over the directory's).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .core.config import ENTROPY_BOUND_FAMILY, PER_BLOCK_STEPS, RECOMMENDED, DecodeConfig, DecodeConfigError

RECOMMENDED_FILE = "recommended.json"
GENERATION_CONFIG_SOURCE = "the model's generation_config.json"  # DiffusionGemma's, without a tuned file
NAME = "recommended"  # the name every front end accepts for it
SETTINGS_NAMES = (NAME,)  # every named setting (``--settings``)
LIBRARY_SOURCE = "psd_jax.core.config.RECOMMENDED"


@dataclasses.dataclass(frozen=True)
class Recommendation:
    settings: dict[str, Any]  # DecodeConfig fields over the directory's decode defaults
    provenance: dict[str, Any]  # how it was chosen (empty for the library default)
    source: str  # the file it was read from, or "psd_jax.core.config.RECOMMENDED"
    device: str | None = None  # the device kind it was chosen for (None: not said, or the library default)
    asked: str | None = None  # the device kind it was read for

    @property
    def tuned(self) -> bool:
        """Read from the directory's file (not the library default)."""
        return self.source not in (LIBRARY_SOURCE, GENERATION_CONFIG_SOURCE)

    def origin(self) -> str:
        """Where the setting came from and the device it was chosen for, for a front end's output."""
        if not self.tuned:
            return f"the {'release' if self.source == GENERATION_CONFIG_SOURCE else 'library'} default " + (
                f"({self.source}; no {RECOMMENDED_FILE} in the model directory)"
            )
        how = self.provenance.get("device")
        chosen = f" for {self.device}" + (f" ({how})" if how else "") if self.device else ""
        other = (
            f"; no choice for {self.asked} in it" if self.device and self.asked and self.asked != self.device else ""
        )
        return f"tuned{chosen}, from {self.source}{other}"


def current_device_kind() -> str:
    """The device kind this process decodes on: cpu, gpu or tpu (``jax.default_backend()``)."""
    import jax

    return jax.default_backend()


def read_recommended(model_dir: str | Path | None, device: str | None = None) -> Recommendation:
    """The directory's tuned setting for ``device`` (default: this process's device kind) if it has
    one, else its latest choice, else the library's ``RECOMMENDED``."""
    file = Path(model_dir) / RECOMMENDED_FILE if model_dir is not None else None
    if file is None or not file.is_file():
        return _untuned(model_dir)
    data = _read(file)
    device = device or current_device_kind()
    entry = data.get("devices", {}).get(device)
    if entry is not None:
        return Recommendation(entry["settings"], dict(entry.get("provenance") or {}), str(file), device, device)
    provenance = dict(data.get("provenance") or {})
    return Recommendation(data["settings"], provenance, str(file), provenance.get("device_kind"), device)


def _untuned(model_dir: str | Path | None) -> Recommendation:
    """The recommendation of a directory without a tuned file: the library's ``RECOMMENDED`` for a
    mask-token family; for DiffusionGemma, whose sampler has none of its fields, the settings its
    release ships (``generation_config.json``, which ``model_dir.model_settings`` reads as defaults)."""
    from models import load_config  # here: the recommendation stays importable without the models

    has_config = model_dir is not None and Path(model_dir, "config.json").is_file()
    if has_config and load_config(model_dir).family == ENTROPY_BOUND_FAMILY:
        return Recommendation({}, {}, GENERATION_CONFIG_SOURCE)
    return Recommendation(dict(RECOMMENDED), {}, LIBRARY_SOURCE)


def _read(file: Path) -> dict[str, Any]:
    """``file``'s content, checked: the top-level entry and each device's hold known fields."""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise DecodeConfigError(f"{file}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise DecodeConfigError(f'{file}: expected {{"settings": {{...}}, "provenance": {{...}}}}')
    devices = data.get("devices", {})
    if not isinstance(devices, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("settings"), dict) for e in devices.values()
    ):
        raise DecodeConfigError(f'{file}: "devices" must map a device kind to {{"settings": {{...}}, ...}}')
    known = {f.name for f in dataclasses.fields(DecodeConfig)}
    for where, entry in [("", data), *((f"devices.{k}: ", e) for k, e in devices.items())]:
        unknown = sorted(set(entry["settings"]) - known)
        if unknown:
            raise DecodeConfigError(f"{file}: {where}unknown decoding setting(s) {unknown}")
    return data


def write_recommended(
    model_dir: str | Path,
    settings: DecodeConfig,
    provenance: dict[str, Any],
    device: str | None = None,
    frontier: list[dict[str, Any]] | None = None,
) -> Path:
    """Store ``settings`` (the fields that differ from ``DecodeConfig``'s defaults, block length
    included; steps only when they are not one per generated token, which holds at any length) as
    the directory's recommended setting for the device kind ``device`` (with the ``frontier`` it
    was chosen from), and as its latest choice; other kinds' choices in the file are kept. Returns
    the file written."""
    fields = settings.changed()
    fields.pop("gen_length", None)  # the generation length is the caller's: only the decoder is recommended
    if settings.policy not in PER_BLOCK_STEPS and settings.steps == settings.gen_length:
        fields.pop("steps")  # one token per step, at any generation length
    fields["block_length"] = settings.block_length
    file = Path(model_dir) / RECOMMENDED_FILE
    devices = _read(file).get("devices", {}) if file.is_file() else {}
    provenance = {**provenance, "device_kind": device} if device else provenance
    if device is not None:
        devices[device] = {"settings": fields, "provenance": provenance, "frontier": frontier or []}
    body = {"settings": fields, "provenance": provenance, **({"devices": devices} if devices else {})}
    file.write_text(json.dumps(body, indent=2) + "\n")
    return file


def check_settings_name(name: str | None) -> None:
    """``None`` or a known setting name; anything else is a ``DecodeConfigError`` naming it."""
    if name is not None and name not in SETTINGS_NAMES:
        raise DecodeConfigError(f"unknown settings {name!r}; choose one of: {', '.join(SETTINGS_NAMES)}")


def named_settings(name: str | None, model_dir: str | Path | None, device: str | None = None) -> dict[str, Any] | None:
    """The ``DecodeConfig`` fields of the setting ``name`` for ``model_dir``, to pass as
    ``model_dir.model_settings``'s ``base``: ``None`` for the plain defaults, the directory's
    recommended setting for ``device`` (default: this process's device kind) for ``recommended``.
    The one resolver of a settings name, so that every front end accepts the same names and refuses
    the same way (``DecodeConfigError``).

    Reading this process's device kind starts JAX's backend: on several processes call it only
    once the cluster has started (``parallel.multihost.start``); before, ``settings_on_any_device``
    checks what needs no device."""
    check_settings_name(name)
    if name is None:
        return None
    recommendation = read_recommended(model_dir, device)
    _check_values(recommendation)
    return dict(recommendation.settings)


def settings_on_any_device(name: str | None, model_dir: str | Path | None) -> list[dict[str, Any] | None]:
    """Every base ``named_settings(name, model_dir, device)`` may give, whatever the device: the
    directory's latest choice first, then each device kind's, each with its values checked. Asks
    JAX nothing, so a front end checks its settings with it before a cluster starts (a named
    setting refused on every device is refused before any process waits for the others)."""
    check_settings_name(name)
    if name is None:
        return [None]
    file = Path(model_dir) / RECOMMENDED_FILE if model_dir is not None else None
    if file is None or not file.is_file():
        return [dict(_untuned(model_dir).settings)]  # whatever the device
    data = _read(file)
    out: list[dict[str, Any] | None] = []
    for device in [None, *sorted(data.get("devices", {}))]:
        entry = data["settings"] if device is None else data["devices"][device]["settings"]
        _check_values(Recommendation(entry, {}, str(file) if device is None else f"{file} (devices.{device})"))
        if entry not in out:
            out.append(dict(entry))
    return out


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
