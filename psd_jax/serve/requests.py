"""OpenAI request bodies -> checked ``DecodeRequest``s: every problem is a ``RequestError`` (400).

A body is read in two steps. ``protocol.parse`` holds it to the protocol (``protocol``'s models:
OpenAI's fields, the neutral ones, the server's extensions, each field's type), so a malformed
request is refused naming its field. Then ``parse_request`` checks what depends on this server, in
one place: the model's name (404), the neutral values (a setting this server does not implement
is refused rather than ignored, as ``DecodeConfig`` does), ``"settings": "recommended"`` (the model
directory's recommended setting over the server's defaults, under the request's own fields; a
bundle of overrides, so allowed only when every field it changes is one ``--allow-overrides``
names), the ``DecodeConfig`` fields over the server's defaults (``DecodeConfig``'s own checks and
the model's), the prompt, and the server's limits (``limits.ServerLimits``: the prompt's tokens,
the generation positions, PSD depth and RPS branches, which settings a request may change: 400,
``code: "limit_exceeded"`` or ``"override_not_allowed"``). The body's size, nesting, integers and
Unicode are bounded before either, as it is read (``body``). Everything is checked before a
request queues, so a bad request never reaches (or breaks) a batch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Any

from ..api import InputError, LoadedModel
from ..core.config import CONFIDENCE_ALIASES, ENTROPY_BOUND_FAMILY, DecodeConfig, DecodeConfigError
from ..core.lengths import check_context, padded_length
from ..diffusion_gemma_api import SERVED_TRACE
from ..recommended import NAME, check_settings_name
from ..tokenizer import TokenizerError
from . import protocol
from .errors import RequestError
from .limits import LIMIT_CODE, ServerLimits
from .protocol import DECODE_FIELDS, NEUTRAL


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the model, its name, the server's decode defaults and limits."""

    lm: LoadedModel
    name: str
    defaults: DecodeConfig
    prompt_bucket: int
    limits: ServerLimits
    recommended: dict[str, Any] | None = None  # a request's "settings": "recommended" (None: not offered)

    def base(self, name: Any) -> DecodeConfig:
        """The settings a request's fields apply over: the server's defaults, or with ``name``
        (``"settings"`` of the body) that named setting over them."""
        if name is None:
            return self.defaults
        if not isinstance(name, str):
            raise RequestError(f"settings must be a setting's name ({NAME}), got {name!r}", param="settings")
        try:
            check_settings_name(name)
        except DecodeConfigError as exc:
            raise RequestError(_cut(str(exc), [name]), param="settings", code="invalid_settings") from None
        if self.recommended is None:
            raise RequestError(f"this server does not offer the {name} setting", param="settings")
        try:
            return self.lm.settings(self.defaults, self.recommended)
        except DecodeConfigError as exc:
            raise RequestError(f"settings {name}: {exc}", param="settings", code="invalid_settings") from None


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """One checked request: its prompt ids, settings and how the answer is to be returned."""

    endpoint: str  # "completion" or "chat"
    prompt_ids: tuple[int, ...]
    settings: DecodeConfig
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None

    @property
    def sampled(self) -> bool:
        """Whether the answer depends on the PRNG key (then ``seed`` decides it)."""
        return self.settings.temperature > 0 or self.settings.confidence == "random"


def parse_request(body: Any, endpoint: str, served: ServedModel) -> DecodeRequest:
    """Check an OpenAI request body (``endpoint``: "completion" or "chat") against the protocol,
    then against the model and this server."""
    request = protocol.parse(body, endpoint)
    given = {name: getattr(request, name) for name in request.model_fields_set}
    _check_neutral(given)
    _check_model(request.model, served)
    base = served.base(request.settings)
    _check_named(request.settings, base, served)
    decode = {name: value for name, value in given.items() if name in DECODE_FIELDS}
    _check_allowed(decode, served)
    if endpoint == "completion":
        prompt_param, ids = "prompt", completion_ids(request, served)
    else:
        prompt_param, ids = "messages", chat_ids(request, served)
    _check_prompt_limit(ids, served, prompt_param)
    length = _length_field(given)
    settings = request_settings(decode, served, base, length)
    check_length(ids, settings, served, prompt_param, length)
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    include_usage = request.stream_options is not None and bool(request.stream_options.include_usage)
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    return DecodeRequest(endpoint, tuple(ids), settings, stop, bool(request.stream), include_usage, request.seed)


def _check_neutral(given: dict[str, Any]) -> None:
    for name, neutral in NEUTRAL.items():
        value = given.get(name)
        if name in given and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            allowed = " or ".join(json.dumps(v) for v in neutral)
            raise RequestError(
                f"{name}={protocol.shown(value)} is not supported by this server; leave it out or send {allowed}",
                param=name,
            )


def _check_model(model: str | None, served: ServedModel) -> None:
    if model is not None and model != served.name:
        raise RequestError(
            f"model {protocol.shown(model)} is not served here; this server serves {served.name!r}",
            param="model",
            code="model_not_found",
            status=404,
        )


def _check_allowed(decode: dict[str, Any], served: ServedModel) -> None:
    """Only the ``DecodeConfig`` fields ``--allow-overrides`` names may differ from the server's
    value (restating it is accepted). ``temperature`` is the field of that name; ``max_tokens`` is
    the generation length and is governed as ``gen_length`` (checked once rounded, in
    ``request_settings``); ``seed`` sets no setting and is always accepted."""
    allowed = served.limits.overrides
    for name in sorted(decode.keys() - allowed):
        value, default = decode[name], getattr(served.defaults, name)
        if name == "confidence" and isinstance(value, str):
            value = CONFIDENCE_ALIASES.get(value, value)
        if not (value == default and isinstance(value, bool) == isinstance(default, bool)):
            raise _not_allowed(name, default, allowed)


def _check_named(name: str | None, base: DecodeConfig, served: ServedModel) -> None:
    """A named setting may change only the fields ``--allow-overrides`` names, as the fields it
    bundles would if the request sent them one by one."""
    allowed = served.limits.overrides
    for field in sorted(DECODE_FIELDS - allowed):
        if getattr(base, field) != getattr(served.defaults, field):
            shown = ", ".join(sorted(allowed)) or "none"
            raise RequestError(
                f"settings {name} changes {field} ({getattr(served.defaults, field)!r} -> {getattr(base, field)!r}), "
                f"which may not be changed per request on this server (--allow-overrides: {shown})",
                param="settings",
                code="override_not_allowed",
            )


def _not_allowed(param: str, value: Any, allowed: frozenset[str]) -> RequestError:
    shown = ", ".join(sorted(allowed)) or "none"
    return RequestError(
        f"{param} may not be changed per request on this server (--allow-overrides: {shown}); "
        f"leave it out or send the server's value {value!r}",
        param=param,
        code="override_not_allowed",
    )


def _check_prompt_limit(ids: list[int], served: ServedModel, param: str) -> None:
    limit = served.limits.max_prompt_tokens
    if len(ids) > limit:
        raise RequestError(
            f"the prompt is too long: {len(ids)} tokens exceed this server's limit of {limit} (--max-prompt-tokens)",
            param=param,
            code=LIMIT_CODE,
        )


def completion_ids(request: Any, served: ServedModel) -> list[int]:
    """The prompt's token ids: a string (through the chat template by the library's chat rule,
    unless ``chat`` is false) or a list of token ids; one prompt per request (a list of one
    prompt is that prompt)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise RequestError("one prompt per request: send several requests (they are batched)", param="prompt")
        (prompt,) = prompt
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    return _checked_ids(served, prompt, request.chat, "prompt")


def chat_ids(request: Any, served: ServedModel) -> list[int]:
    """The messages through the checkpoint's chat template, with the assistant's turn opened."""
    if not served.lm.has_chat_template:
        raise RequestError(
            "this checkpoint has no chat template; send a prompt to /v1/completions instead",
            param="messages",
            code="no_chat_template",
        )
    turns = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        ids = served.lm.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own checks (jinja raise_exception) land here
        raise RequestError(f"messages do not fit the chat template: {exc}", param="messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return _checked_ids(served, [int(i) for i in ids], False, "messages")


def _checked_ids(served: ServedModel, prompt, chat: bool | None, param: str) -> list[int]:
    try:
        (ids,) = served.lm.prompt_ids([prompt], chat)
    except (InputError, TokenizerError) as exc:
        raise RequestError(str(exc).replace("prompt 0 ", "the prompt "), param=param) from None
    return ids


@dataclasses.dataclass(frozen=True)
class _Length:
    """The generation length a request asks for: ``max_tokens`` or ``max_completion_tokens``
    (``name``, which messages quote), ``value`` positions before rounding."""

    name: str
    value: int


def _length_field(given: dict[str, Any]) -> _Length | None:
    sent = [name for name in ("max_tokens", "max_completion_tokens") if name in given]
    if len(sent) == 2 and given["max_tokens"] != given["max_completion_tokens"]:
        raise RequestError(
            "give max_tokens or max_completion_tokens, not both (they differ)", param="max_completion_tokens"
        )
    return _Length(sent[0], given[sent[0]]) if sent else None


def request_settings(
    decode: dict[str, Any], served: ServedModel, base: DecodeConfig | None = None, length: _Length | None = None
) -> DecodeConfig:
    """``base`` (default: the server's defaults) with the request's ``DecodeConfig`` fields
    ``decode``, and ``length`` (``max_tokens``) as the generation length rounded up to whole
    blocks (a fixed or dream schedule keeps its steps per block)."""
    base = served.defaults if base is None else base
    overrides = dict(decode)
    if length is not None:
        if "gen_length" in overrides:
            raise RequestError(f"give {length.name} or gen_length, not both", param="gen_length")
        overrides.update(_generation_length(length.value, overrides, base))
        if "gen_length" not in served.limits.overrides and overrides["gen_length"] != served.defaults.gen_length:
            raise _not_allowed(length.name, served.defaults.gen_length, served.limits.overrides)
    _check_generation(overrides.get("gen_length"), length, served.limits)
    try:
        settings = served.lm.settings(base, overrides)
    except DecodeConfigError as exc:
        message = _cut(str(exc), overrides.values())
        raise RequestError(message, param=_named(str(exc), overrides), code="invalid_settings") from None
    problem = served.limits.exceeded(settings)
    if problem:
        raise RequestError(problem[1], param=problem[0], code=LIMIT_CODE)
    if settings.trace and served.lm.config.family == ENTROPY_BOUND_FAMILY:
        raise RequestError(SERVED_TRACE, param="trace", code="invalid_settings")
    return settings


def _check_generation(gen: Any, length: _Length | None, limits: ServerLimits) -> None:
    """The generation positions against ``--max-tokens``, before ``DecodeConfig`` sees them (its
    context check would otherwise answer a huge ``max_tokens`` first)."""
    if isinstance(gen, bool) or not isinstance(gen, int) or gen <= limits.max_tokens:
        return
    if length is None:
        raise RequestError(
            limits.past("gen_length", gen, limits.max_tokens, "--max-tokens"), param="gen_length", code=LIMIT_CODE
        )
    rounded = "" if gen == length.value else f" (rounded up to whole blocks: {gen} positions)"
    message = f"{length.name} {length.value}{rounded} exceeds this server's limit of {limits.max_tokens} (--max-tokens)"
    raise RequestError(message, param=length.name, code=LIMIT_CODE)


def _generation_length(max_tokens: int, overrides: dict, defaults: DecodeConfig) -> dict[str, int]:
    block = overrides.get("block_length", defaults.block_length)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        return {"gen_length": max_tokens}  # DecodeConfig names the bad block_length
    gen = -(-max_tokens // block) * block
    scheduled = overrides.get("policy", defaults.policy) in ("fixed", "dream")
    if "steps" in overrides or defaults.steps is None or not scheduled or defaults.block_length != block:
        return {"gen_length": gen}
    return {"gen_length": gen, "steps": defaults.steps_per_block * (gen // block)}


def _named(message: str, overrides: dict) -> str | None:
    """The request field an error message is about (the first one it names)."""
    found = [(m.start(), k) for k in overrides if (m := re.search(rf"\b{k}\b", message))]
    return min(found)[1] if found else None


def _cut(message: str, values: Iterable[Any]) -> str:
    """``message`` (``DecodeConfig``'s, which quotes a bad value whole) with each long value it
    quotes cut short, as ``protocol`` quotes one: a line, not the megabyte a client sent."""
    for value in values:
        whole = repr(value)
        if len(whole) > protocol.SHOWN_CHARS:
            message = message.replace(whole, protocol.shown(value))
    return message


def check_length(
    ids: list[int], settings: DecodeConfig, served: ServedModel, param: str, length: _Length | None
) -> None:
    """The padded prompt and the generation must fit the model's context."""
    cfg = served.lm.config
    try:
        check_context(len(ids), served.prompt_bucket, settings.gen_length, cfg.max_length)
    except InputError as exc:
        if padded_length(len(ids), served.prompt_bucket) + settings.block_length <= cfg.max_length and length:
            message = (
                f"{length.name} {length.value} (rounded up to blocks of {settings.block_length}) is too long: {exc}"
            )
            raise RequestError(message, param=length.name, code="context_length_exceeded") from None
        raise RequestError(f"the prompt is too long: {exc}", param=param, code="context_length_exceeded") from None
