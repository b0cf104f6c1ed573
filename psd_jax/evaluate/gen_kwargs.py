"""A ``generate_until`` request's generation kwargs, mapped onto psd-jax's decode.

The harness hands each request its task's ``generation_kwargs`` with ``--gen_kwargs`` merged over
them (the harness's rule: the command line overrides the task). psd-jax honours what it can
decode: ``until`` (stop strings), ``max_gen_toks`` (or the harness's aliases ``max_new_tokens``,
``max_tokens``, ``max_completion_tokens``, in that priority), and ``do_sample``/``temperature``/
``top_p``/``top_k``, read as the harness's own ``normalize_gen_kwargs`` reads them:

- ``do_sample=False``: greedy (temperature 0) and unfiltered (top_p 1, top_k 0), whatever
  ``temperature``, ``top_p`` and ``top_k`` say;
- ``temperature=T`` / ``top_p=p`` / ``top_k=k`` with ``do_sample`` true or absent: that value
  (temperature 0: greedy; top_p 1, top_k 0: no filter; where the filters apply is the family's
  sampler's rule, ``psd_jax.core.sampling``);
- a key left out (``do_sample`` true or absent): the model argument's value.

A model argument ``temperature``, ``top_p`` or ``top_k`` the user set is a setting of the run; a
request that asks for another value is refused (``InputError``) rather than either value being
silently dropped. Any other key (``num_beams``, ``repetition_penalty``, ...) is refused by name
too, except at the values that change nothing (``NEUTRAL``: ``num_beams=1``), which some tasks
spell out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any

from ..core.config import DecodeConfig
from ..core.errors import InputError
from .args import as_bool, as_float, as_int

MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # harness priority
SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # DecodeConfig fields of the same names
HONOURED = ("until", *MAX_TOKEN_KEYS, "do_sample", *SAMPLING_KEYS)
NEUTRAL: dict[str, float] = {"num_beams": 1}
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}  # what do_sample=False asks for
WHAT = "generation kwarg"


@dataclasses.dataclass(frozen=True)
class GenKwargs:
    """What one request asks of the decode."""

    until: tuple[str, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None  # None: the model argument's
    do_sample: bool | None = None
    overridden: float | None = None  # a temperature that do_sample=False turned into greedy
    top_p: float | None = None  # None: the model argument's
    top_k: int | None = None  # None: the model argument's

    def asked(self) -> dict[str, float | int]:
        """The sampling fields this request sets (``SAMPLING_KEYS``), by name."""
        return {name: getattr(self, name) for name in SAMPLING_KEYS if getattr(self, name) is not None}


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


def _top_p(value: Any) -> float:
    p = as_float("top_p", value, what=WHAT)
    if not 0.0 < p <= 1.0:
        raise InputError(f"{WHAT} top_p must be in (0, 1] (1: no filter), got {value!r}")
    return p


def _top_k(value: Any) -> int:
    k = as_int("top_k", value, what=WHAT)
    if k is None or k < 0:
        raise InputError(f"{WHAT} top_k must be an integer >= 0 (0: no filter), got {value!r}")
    return k


def _refuse_unknown(kwargs: dict[str, Any]) -> None:
    refused = {k: v for k, v in kwargs.items() if k not in HONOURED and not (k in NEUTRAL and v == NEUTRAL[k])}
    if refused:
        named = ", ".join(f"{k}={v!r}" for k, v in sorted(refused.items()))
        raise InputError(
            f"{WHAT}(s) {named} cannot be honoured: psd_jax decodes greedily or by temperature sampling "
            f"(with top-p/top-k filters) and takes only {', '.join(HONOURED)}"
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
    top_p = None if kwargs.get("top_p") is None else _top_p(kwargs["top_p"])
    top_k = None if kwargs.get("top_k") is None else _top_k(kwargs["top_k"])
    if do_sample is False:
        temperature, overridden = 0.0, asked if asked else None
        top_p, top_k = GREEDY["top_p"], GREEDY["top_k"]
    else:
        temperature, overridden = asked, None
    return GenKwargs(_until(kwargs.get("until")), max_tokens, temperature, do_sample, overridden, top_p, top_k)


def request_settings(settings: DecodeConfig, gen: GenKwargs, explicit: Collection[str], source: str) -> DecodeConfig:
    """``settings`` at the request's temperature, top_p and top_k. ``explicit``: the fields the
    model arguments set; generation kwargs asking for another value of one of them (``source``
    names them: a task's, or ``--gen_kwargs``) are refused, naming both values."""
    changes = {name: value for name, value in gen.asked().items() if value != getattr(settings, name)}
    for name in sorted(changes.keys() & set(explicit), key=SAMPLING_KEYS.index):
        why = " (do_sample=false)" if gen.do_sample is False else ""
        mine = f"{getattr(settings, name):g}"
        raise InputError(
            f"{source} ask for {name} {changes[name]:g}{why}, but the model argument {name}={mine} was "
            f"set; sampling is a generation kwarg in the harness: drop the model argument and pass --gen_kwargs "
            f"do_sample=true,{name}={mine}"
        )
    return settings.replace(**changes) if changes else settings
