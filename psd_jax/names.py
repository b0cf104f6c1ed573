"""Setting names: the one spelling of a decoder setting that the benchmark, the tuner and the command
lines read and write, so a name printed by one is accepted by the others.

A name is ``[psd-[strict-] | rps- | edit-] POLICY [PSD parts] [RPS parts] [edit parts] [-predmask] [-tT]``, then optionally the
cache and the block length after slashes (``psd-fixed-1-d15-next-conf0.95/dual+v16/b16``):

- POLICY: ``fixed-N`` (N tokens per step: ``steps = gen_length / N``), ``fixed-sS`` and ``dream-sS``
  (S steps in all), ``threshold-T``, ``schedule-T[-sS]`` (LLaDA2.0's threshold schedule, S steps
  per block), ``sequential-sS`` (S steps per block), ``factor-F``;
- PSD: ``-dD`` depth, ``-rR`` draft rate, ``-next`` drafts into the next block, ``-confC`` the
  verifier's confidence gate; ``strict-`` lossless acceptance;
- RPS: ``-kK`` k_max, ``-ratioR``, ``-tauT`` pivot_tau, ``-lamL`` lam (each only when not the default);
- token editing (``edit-schedule-T[-sS]``): ``-eE`` editing_threshold (left out: editing off),
  ``-postP`` max_post_steps, ``-mtM`` minimal_topk (each only when not the default);
- ``-predmask``: LLaDA ``generate.py``'s [MASK] rule (``predict_mask``: [MASK] may be predicted);
- ``-tT``: sampling temperature T.

DiffusionGemma's entropy-bound sampler has names of its own, ``entropy-bound-B[-sN][-stopC]
[-stableK][-tmaxA][-tminZ]`` (``entropy_bound`` B, ``max_denoising_steps`` N, adaptive stopping's
``confidence_threshold`` C, 0 = off, and ``stability_threshold`` K, the temperature schedule from A
down to Z): a part left out is the release's value (``DecodeConfig``'s default), and
``entropy_bound_name`` writes only the parts that differ from it. It has no cache or block length.
"""

from __future__ import annotations

import re
from typing import Any

from .core.config import DecodeConfig, DecodeConfigError, cache_fields

_NUMBER = r"\d+(?:\.\d+)?"
_PATTERN = re.compile(
    rf"""(?:(?P<decoder>psd|rps|edit)-)?(?P<strict>strict-)?
    (?:fixed-(?P<per_step>\d+)|fixed-s(?P<fixed_steps>\d+)|dream-s(?P<dream_steps>\d+)
      |threshold-(?P<threshold>{_NUMBER})|schedule-(?P<schedule>{_NUMBER})(?:-s(?P<schedule_steps>\d+))?
      |sequential-s(?P<sequential_steps>\d+)|factor-(?P<factor>{_NUMBER}))
    (?:-d(?P<depth>\d+))?(?:-r(?P<draft_rate>\d+))?(?P<next>-next)?(?:-conf(?P<gate>{_NUMBER}))?
    (?:-k(?P<k_max>\d+))?(?:-ratio(?P<ratio>{_NUMBER}))?(?:-tau(?P<pivot_tau>{_NUMBER}))?(?:-lam(?P<lam>{_NUMBER}))?
    (?:-e(?P<editing_threshold>{_NUMBER}))?(?:-post(?P<max_post_steps>\d+))?(?:-mt(?P<minimal_topk>\d+))?
    (?P<predict_mask>-predmask)?(?:-t(?P<temperature>{_NUMBER}))?""",
    re.VERBOSE,
)
_ENTROPY_BOUND_PATTERN = re.compile(
    rf"""entropy-bound-(?P<entropy_bound>{_NUMBER})(?:-s(?P<max_denoising_steps>\d+))?
    (?:-stop(?P<confidence_threshold>{_NUMBER}))?(?:-stable(?P<stability_threshold>\d+))?
    (?:-tmax(?P<t_max>{_NUMBER}))?(?:-tmin(?P<t_min>{_NUMBER}))?""",
    re.VERBOSE,
)
# (field, the name's label) after entropy-bound-B, in the order a name writes them
_ENTROPY_BOUND_PARTS = (
    ("max_denoising_steps", "s"),
    ("confidence_threshold", "stop"),
    ("stability_threshold", "stable"),
    ("t_max", "tmax"),
    ("t_min", "tmin"),
)
_PSD_PARTS = ("strict", "depth", "draft_rate", "next", "gate")
_RPS_PARTS = ("k_max", "ratio", "pivot_tau", "lam")
_EDIT_PARTS = ("editing_threshold", "max_post_steps", "minimal_topk")


def setting_name(c: DecodeConfig) -> str:
    """The name of ``c``'s decoder, policy and sampling, without cache or block length:
    ``psd-threshold-0.9-d3``."""
    name = _policy_name(c)
    if c.decoder == "psd":
        strict = "strict-" if c.acceptance == "strict" else ""
        rate = f"-r{c.draft_rate}" if c.draft_rate is not None else ""
        beyond = "-next" if c.draft_next_block else ""
        gate = f"-conf{c.accept_confidence:g}" if c.accept_confidence > 0 else ""
        name = f"psd-{strict}{name}-d{c.depth}{rate}{beyond}{gate}"
    elif c.decoder == "rps":
        defaults = DecodeConfig()
        variant = "".join(
            f"-{label}{getattr(c, field):g}"
            for field, label in (("k_max", "k"), ("ratio", "ratio"), ("pivot_tau", "tau"), ("lam", "lam"))
            if getattr(c, field) != getattr(defaults, field)
        )
        name = f"rps-{name}{variant}"
    elif c.decoder == "edit":
        defaults = DecodeConfig()
        variant = "".join(
            f"-{label}{getattr(c, field):g}"
            for field, label in (("editing_threshold", "e"), ("max_post_steps", "post"), ("minimal_topk", "mt"))
            if getattr(c, field) != getattr(defaults, field)
            and not (field == "editing_threshold" and c.editing_threshold <= 0)
        )
        name = f"edit-{name}{variant}"
    if c.predict_mask:
        name += "-predmask"
    if c.temperature > 0:
        name += f"-t{c.temperature:g}"
    return name


def entropy_bound_name(c: DecodeConfig) -> str:
    """The name of ``c``'s entropy-bound sampler settings (DiffusionGemma): ``entropy-bound-0.1``
    for the release's, ``entropy-bound-1-s24-stop0`` for others."""
    defaults = DecodeConfig()
    parts = "".join(
        f"-{label}{getattr(c, field):g}"
        for field, label in _ENTROPY_BOUND_PARTS
        if getattr(c, field) != getattr(defaults, field)
    )
    return f"entropy-bound-{c.entropy_bound:g}{parts}"


def entropy_bound_fields(name: str) -> dict[str, Any]:
    """Every ``config.ENTROPY_BOUND_FIELDS`` value a name stands for (the parts it leaves out: the
    release's). Raises ``DecodeConfigError`` naming what is wrong."""
    match = _ENTROPY_BOUND_PATTERN.fullmatch(name)
    if match is None:
        raise DecodeConfigError(
            f"unknown DiffusionGemma setting name {name!r}: expected entropy-bound-B[-sN][-stopC][-stableK]"
            "[-tmaxA][-tminZ] (no cache or block length)"
        )
    defaults = DecodeConfig()
    out: dict[str, Any] = {}
    for field, value in match.groupdict().items():
        kind = type(getattr(defaults, field))
        out[field] = getattr(defaults, field) if value is None else kind(float(value) if kind is float else value)
    return out


def full_name(c: DecodeConfig) -> str:
    """``setting_name`` with the cache and block length: ``psd-threshold-0.9-d3/dual/b16``."""
    return f"{setting_name(c)}/{c.cache_name}/b{c.block_length}"


def _policy_name(c: DecodeConfig) -> str:
    if c.policy == "fixed":
        every = c.gen_length % c.total_steps == 0
        return f"fixed-{c.gen_length // c.total_steps}" if every else f"fixed-s{c.total_steps}"
    if c.policy == "dream":
        return f"dream-s{c.total_steps}"
    if c.policy == "threshold":
        return f"threshold-{c.threshold:g}"
    if c.policy == "threshold_schedule":
        return f"schedule-{c.threshold:g}" + (f"-s{c.steps}" if c.steps is not None else "")
    if c.policy == "sequential":
        return f"sequential-s{c.steps_per_block}"
    if c.policy == "factor":
        return f"factor-{c.factor:g}"
    raise ValueError(f"no name for policy {c.policy!r}")


def setting_fields(name: str, gen_length: int) -> dict[str, Any]:
    """The ``DecodeConfig`` fields a name stands for (besides the lengths), cache and block length
    included when the name carries them. Raises ``DecodeConfigError`` naming what is wrong."""
    setting, *rest = name.split("/")
    match = _PATTERN.fullmatch(setting)
    if match is None:
        raise DecodeConfigError(
            f"unknown setting name {setting!r}: expected [psd-|rps-|edit-]POLICY[-dD][-next][-confC]..., "
            "POLICY one of fixed-N, fixed-sS, dream-sS, threshold-T, schedule-T, sequential-sS, factor-F"
        )
    parts = {key: value for key, value in match.groupdict().items() if value is not None}
    decoder = parts.pop("decoder", "plain")
    for owner, names in (("psd", _PSD_PARTS), ("rps", _RPS_PARTS), ("edit", _EDIT_PARTS)):
        misplaced = [part for part in names if part in parts and decoder != owner]
        if misplaced:
            article = "an" if owner == "edit" else "a"
            raise DecodeConfigError(f"{setting!r}: {', '.join(misplaced)} belongs to {article} {owner}- name")
    fields: dict[str, Any] = {"decoder": decoder, **_policy_fields(parts, gen_length, setting)}
    if "strict" in parts:
        fields["acceptance"] = "strict"
    if "next" in parts:
        fields["draft_next_block"] = True
    if "predict_mask" in parts:
        fields["predict_mask"] = True
    if "gate" in parts:
        fields["accept_confidence"] = float(parts["gate"])
    for key in ("depth", "draft_rate", "k_max", "max_post_steps", "minimal_topk"):
        if key in parts:
            fields[key] = int(parts[key])
    for key in ("ratio", "pivot_tau", "lam", "editing_threshold", "temperature"):
        if key in parts:
            fields[key] = float(parts[key])
    return {**fields, **_suffix_fields(rest, name)}


def _policy_fields(parts: dict[str, str], gen_length: int, setting: str) -> dict[str, Any]:
    if "per_step" in parts:
        per_step = int(parts["per_step"])
        if per_step < 1 or gen_length % per_step:
            raise DecodeConfigError(
                f"{setting!r}: gen_length {gen_length} is not a multiple of {per_step} tokens per step"
            )
        return {"policy": "fixed", "steps": gen_length // per_step}
    if "fixed_steps" in parts:
        return {"policy": "fixed", "steps": int(parts["fixed_steps"])}
    if "dream_steps" in parts:
        return {"policy": "dream", "steps": int(parts["dream_steps"])}
    if "threshold" in parts:
        return {"policy": "threshold", "threshold": float(parts["threshold"])}
    if "schedule" in parts:
        steps = {"steps": int(parts["schedule_steps"])} if "schedule_steps" in parts else {}
        return {"policy": "threshold_schedule", "threshold": float(parts["schedule"]), **steps}
    if "sequential_steps" in parts:
        return {"policy": "sequential", "steps": int(parts["sequential_steps"])}
    return {"policy": "factor", "factor": float(parts["factor"])}


def _suffix_fields(rest: list[str], name: str) -> dict[str, Any]:
    """The cache (``dual+v4``) and block length (``b16``) after the slashes, each at most once."""
    fields: dict[str, Any] = {}
    for part in rest:
        if re.fullmatch(r"b\d+", part) and "block_length" not in fields:
            fields["block_length"] = int(part[1:])
        elif "cache" not in fields and not part.startswith("b"):
            fields.update(cache_fields(part))
        else:
            raise DecodeConfigError(f"{name!r}: after the setting come a cache and a block length (/dual+v4/b16)")
    return fields
