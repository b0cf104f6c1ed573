"""A ``generate_until`` request's generation kwargs, mapped onto psd-jax's decode.

The harness hands each request its task's ``generation_kwargs`` with ``--gen_kwargs`` merged over
them (the harness's rule: the command line overrides the task). psd-jax honours what it can
decode: ``until`` (stop strings), ``max_gen_toks`` (or the harness's aliases ``max_new_tokens``,
``max_tokens``, ``max_completion_tokens``, in that priority), and ``do_sample``/``temperature``,
read as the harness's own ``normalize_gen_kwargs`` reads them:

- ``do_sample=False``: greedy (temperature 0), whatever ``temperature`` says;
- ``temperature=T`` with ``do_sample`` true or absent: sampling at ``T`` (0: greedy);
- ``do_sample=True`` without a temperature, or neither key: the model argument's temperature.

A model argument ``temperature`` the user set is a setting of the run; a request that asks for
another temperature is refused (``InputError``) rather than either value being silently dropped.
Any other key (``top_p``, ``top_k``, ``num_beams``, ...) is refused by name too, except at the
values that change nothing (``NEUTRAL``: ``num_beams=1``, ``top_p=1``), which some tasks spell out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..config import DecodeConfig
from ..errors import InputError
from .args import as_bool, as_float, as_int

MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # harness priority
HONOURED = ("until", *MAX_TOKEN_KEYS, "do_sample", "temperature")
NEUTRAL: dict[str, float] = {"num_beams": 1, "top_p": 1.0}
WHAT = "generation kwarg"


@dataclasses.dataclass(frozen=True)
class GenKwargs:
    """What one request asks of the decode."""

    until: tuple[str, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None  # None: the model argument's
    do_sample: bool | None = None
    overridden: float | None = None  # a temperature that do_sample=False turned into greedy


def _until(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(u, str) for u in items):
        raise InputError(f"{WHAT} until must be a string or a list of strings, got {value!r}")
    return tuple(u for u in items if u)


def _temperature(value: Any) -> float:
    t = as_float("temperature", value, what=WHAT)
    if not 0.0 <= t < math.inf:
        raise InputError(f"{WHAT} temperature must be a finite number >= 0, got {value!r}")
    return t


def _refuse_unknown(kwargs: dict[str, Any]) -> None:
    refused = {k: v for k, v in kwargs.items() if k not in HONOURED and not (k in NEUTRAL and v == NEUTRAL[k])}
    if refused:
        named = ", ".join(f"{k}={v!r}" for k, v in sorted(refused.items()))
        raise InputError(
            f"{WHAT}(s) {named} cannot be honoured: psd_jax decodes greedily or by temperature sampling "
            f"and takes only {', '.join(HONOURED)}"
        )


def parse_gen_kwargs(kwargs: dict[str, Any] | None) -> GenKwargs:
    """Check a request's generation kwargs (or ``--gen_kwargs``) and read what the decode needs."""
    kwargs = dict(kwargs or {})
    _refuse_unknown(kwargs)
    given = [k for k in MAX_TOKEN_KEYS if kwargs.get(k) is not None]
    max_tokens = as_int(given[0], kwargs[given[0]], what=WHAT) if given else None
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"{WHAT} {given[0]} must be positive, got {max_tokens}")
    do_sample = kwargs.get("do_sample")
    do_sample = None if do_sample is None else as_bool("do_sample", do_sample, what=WHAT)
    asked = None if kwargs.get("temperature") is None else _temperature(kwargs["temperature"])
    if do_sample is False:
        temperature, overridden = 0.0, asked if asked else None
    else:
        temperature, overridden = asked, None
    return GenKwargs(_until(kwargs.get("until")), max_tokens, temperature, do_sample, overridden)


def request_settings(settings: DecodeConfig, gen: GenKwargs, explicit: bool, source: str) -> DecodeConfig:
    """``settings`` at the request's temperature. ``explicit``: the model arguments set
    ``temperature``, so generation kwargs asking for another one (``source`` names them: a task's,
    or ``--gen_kwargs``) are refused, naming both values."""
    if gen.temperature is None or gen.temperature == settings.temperature:
        return settings
    if explicit:
        why = " (do_sample=false)" if gen.do_sample is False else ""
        mine = f"{settings.temperature:g}"
        raise InputError(
            f"{source} ask for temperature {gen.temperature:g}{why}, but the model argument temperature={mine} was "
            f"set; sampling is a generation kwarg in the harness: drop the model argument and pass --gen_kwargs "
            f"do_sample=true,temperature={mine}"
        )
    return settings.replace(temperature=gen.temperature)
