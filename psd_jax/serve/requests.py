"""OpenAI request bodies -> checked ``DecodeRequest``s: every problem is a ``RequestError`` (400).

The bodies of ``/v1/completions`` and ``/v1/chat/completions`` as OpenAI defines them, plus the
decoding settings as extra fields named as ``DecodeConfig``'s (``decoder``, ``policy``, ``depth``,
``cache``, ...) over the server's defaults, and ``"settings": "recommended"``: the model
directory's recommended setting over the server's defaults (its block length and cache included;
the generation length stays the server's or the request's), under the request's own fields. A
named setting is a bundle of overrides, so it is allowed only when every field it changes is one
``--allow-overrides`` names. Everything is checked here, before a request queues,
so a bad request never reaches (or breaks) a batch. OpenAI fields this server does not implement
are accepted only at their neutral value (``n=1``, ``logprobs=0``, ...): a setting is refused rather
than silently ignored, as ``DecodeConfig`` does.

The server's limits (``limits.ServerLimits``) are checked here too (the body's size, nesting,
integers and Unicode before, as it is read: ``body``): the prompt's tokens, the generation positions, PSD depth and RPS branches, and
which settings a request may change (400, ``code: "limit_exceeded"`` or ``"override_not_allowed"``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ..api import InputError, LoadedModel
from ..core.config import CONFIDENCE_ALIASES, ENTROPY_BOUND_FAMILY, DecodeConfig, DecodeConfigError
from ..core.lengths import check_context, padded_length
from ..diffusion_gemma_api import SERVED_TRACE
from ..prompts import check_seed
from ..recommended import NAME, check_settings_name
from ..tokenizer import TokenizerError
from .errors import RequestError
from .limits import LIMIT_CODE, ServerLimits

DECODE_FIELDS = frozenset(f.name for f in dataclasses.fields(DecodeConfig))
COMMON_FIELDS = frozenset({"model", "max_tokens", "seed", "stop", "stream", "stream_options", "user", "settings"})
ENDPOINT_FIELDS = {
    "completion": frozenset({"prompt", "chat", "echo", "best_of", "suffix"}),
    "chat": frozenset({"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}),
}
# OpenAI fields not implemented here, and the values that mean "not used".
NEUTRAL: dict[str, tuple] = {
    "n": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "logprobs": (False, 0),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
}
ROLES = ("system", "user", "assistant")
MAX_STOP = 4  # as OpenAI


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
            raise RequestError(str(exc), param="settings", code="invalid_settings") from None
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
    """Check an OpenAI request body (``endpoint``: "completion" or "chat") against the model."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    allowed = COMMON_FIELDS | ENDPOINT_FIELDS[endpoint] | DECODE_FIELDS | NEUTRAL.keys()
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (not an OpenAI or DecodeConfig field)", param=unknown[0])
    fields = {k: v for k, v in body.items() if v is not None}
    _check_neutral(fields)
    _check_model(fields, served)
    base = served.base(fields.get("settings"))
    _check_named(fields.get("settings"), base, served)
    _check_allowed(fields, served)
    prompt_param = "prompt" if endpoint == "completion" else "messages"
    ids = completion_ids(fields, served) if endpoint == "completion" else chat_ids(fields, served)
    _check_prompt_limit(ids, served, prompt_param)
    settings = request_settings(fields, served, base)
    check_length(ids, settings, served, prompt_param, fields.get("max_tokens", fields.get("max_completion_tokens")))
    stream, include_usage = _stream(fields)
    return DecodeRequest(endpoint, tuple(ids), settings, _stop(fields), stream, include_usage, _seed(fields))


def _check_neutral(fields: dict) -> None:
    for name, neutral in NEUTRAL.items():
        value = fields.get(name)
        if name in fields and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            raise RequestError(f"{name}={value!r} is not supported by this server", param=name)


def _check_model(fields: dict, served: ServedModel) -> None:
    model = fields.get("model")
    if model is not None and model != served.name:
        raise RequestError(
            f"model {model!r} is not served here; this server serves {served.name!r}",
            param="model",
            code="model_not_found",
            status=404,
        )


def _check_allowed(fields: dict, served: ServedModel) -> None:
    """Only the ``DecodeConfig`` fields ``--allow-overrides`` names may differ from the server's
    value (restating it is accepted). ``temperature`` is the field of that name; ``max_tokens`` is
    the generation length and is governed as ``gen_length`` (checked once rounded, in
    ``request_settings``); ``seed`` sets no setting and is always accepted."""
    allowed = served.limits.overrides
    for name in sorted(DECODE_FIELDS & fields.keys() - allowed):
        value, default = fields[name], getattr(served.defaults, name)
        if name == "confidence" and isinstance(value, str):
            value = CONFIDENCE_ALIASES.get(value, value)
        if not (value == default and isinstance(value, bool) == isinstance(default, bool)):
            raise _not_allowed(name, default, allowed)


def _check_named(name: str | None, base: DecodeConfig, served: ServedModel) -> None:
    """A named setting may change only the fields ``--allow-overrides`` names, as the fields it
    bundles would if the request sent them one by one."""
    allowed = served.limits.overrides
    for field in DECODE_FIELDS - allowed:
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


def completion_ids(fields: dict, served: ServedModel) -> list[int]:
    """The prompt's token ids: a string (through the chat template by the library's chat rule,
    unless ``chat`` is false) or a list of token ids; one prompt per request."""
    if "prompt" not in fields:
        raise RequestError("prompt is required", param="prompt")
    prompt = fields["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("one prompt per request: send several requests (they are batched)", param="prompt")
    if not (isinstance(prompt, str) or is_ids):
        raise RequestError("prompt must be a string or a list of token ids", param="prompt")
    chat = fields.get("chat")
    if chat is not None and not isinstance(chat, bool):
        raise RequestError(f"chat must be true or false, got {chat!r}", param="chat")
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    return _checked_ids(served, prompt, chat, "prompt")


def chat_ids(fields: dict, served: ServedModel) -> list[int]:
    """The messages through the checkpoint's chat template, with the assistant's turn opened."""
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    if not served.lm.has_chat_template:
        raise RequestError(
            "this checkpoint has no chat template; send a prompt to /v1/completions instead",
            param="messages",
            code="no_chat_template",
        )
    turns = [_turn(i, m) for i, m in enumerate(messages)]
    try:
        ids = served.lm.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own checks (jinja raise_exception) land here
        raise RequestError(f"messages do not fit the chat template: {exc}", param="messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return _checked_ids(served, [int(i) for i in ids], False, "messages")


def _turn(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or set(message) - {"role", "content"}:
        raise RequestError(f"{where} must be an object with just role and content", param=where)
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    if isinstance(content, list):  # OpenAI's content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"{where}.content: only text parts are supported", param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string", param=f"{where}.content")
    return {"role": role, "content": content}


def _checked_ids(served: ServedModel, prompt, chat: bool | None, param: str) -> list[int]:
    try:
        (ids,) = served.lm.prompt_ids([prompt], chat)
    except (InputError, TokenizerError) as exc:
        raise RequestError(str(exc).replace("prompt 0 ", "the prompt "), param=param) from None
    return ids


def request_settings(fields: dict, served: ServedModel, base: DecodeConfig | None = None) -> DecodeConfig:
    """``base`` (default: the server's defaults) with the request's ``DecodeConfig`` fields, and
    ``max_tokens`` as the generation length rounded up to whole blocks (a fixed or dream schedule
    keeps its steps per block)."""
    base = served.defaults if base is None else base
    overrides = {k: fields[k] for k in DECODE_FIELDS if k in fields}
    max_tokens = fields.get("max_tokens", fields.get("max_completion_tokens"))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
        if "gen_length" in overrides:
            raise RequestError("give max_tokens or gen_length, not both", param="gen_length")
        overrides.update(_generation_length(max_tokens, overrides, base))
        if "gen_length" not in served.limits.overrides and overrides["gen_length"] != served.defaults.gen_length:
            raise _not_allowed("max_tokens", served.defaults.gen_length, served.limits.overrides)
    _check_generation(overrides.get("gen_length"), max_tokens, served.limits)
    try:
        settings = served.lm.settings(base, overrides)
    except DecodeConfigError as exc:
        raise RequestError(str(exc), param=_named(str(exc), overrides), code="invalid_settings") from None
    problem = served.limits.exceeded(settings)
    if problem:
        raise RequestError(problem[1], param=problem[0], code=LIMIT_CODE)
    if settings.trace and served.lm.config.family == ENTROPY_BOUND_FAMILY:
        raise RequestError(SERVED_TRACE, param="trace", code="invalid_settings")
    return settings


def _check_generation(gen: Any, max_tokens: int | None, limits: ServerLimits) -> None:
    """The generation positions against ``--max-tokens``, before ``DecodeConfig`` sees them (its
    context check would otherwise answer a huge ``max_tokens`` first)."""
    if isinstance(gen, bool) or not isinstance(gen, int) or gen <= limits.max_tokens:
        return
    if max_tokens is None:
        raise RequestError(
            limits.past("gen_length", gen, limits.max_tokens, "--max-tokens"), param="gen_length", code=LIMIT_CODE
        )
    rounded = "" if gen == max_tokens else f" (rounded up to whole blocks: {gen} positions)"
    message = f"max_tokens {max_tokens}{rounded} exceeds this server's limit of {limits.max_tokens} (--max-tokens)"
    raise RequestError(message, param="max_tokens", code=LIMIT_CODE)


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


def check_length(ids: list[int], settings: DecodeConfig, served: ServedModel, param: str, max_tokens) -> None:
    """The padded prompt and the generation must fit the model's context."""
    cfg = served.lm.config
    try:
        check_context(len(ids), served.prompt_bucket, settings.gen_length, cfg.max_length)
    except InputError as exc:
        if (
            padded_length(len(ids), served.prompt_bucket) + settings.block_length <= cfg.max_length
            and max_tokens is not None
        ):
            message = f"max_tokens {max_tokens} (rounded up to blocks of {settings.block_length}) is too long: {exc}"
            raise RequestError(message, param="max_tokens", code="context_length_exceeded") from None
        raise RequestError(f"the prompt is too long: {exc}", param=param, code="context_length_exceeded") from None


def _stop(fields: dict) -> tuple[str, ...]:
    stop = fields.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them", param="stop")
    return tuple(stop)


def _seed(fields: dict) -> int | None:
    seed = fields.get("seed")
    if seed is None:
        return None
    try:
        check_seed(seed)
    except InputError as exc:
        raise RequestError(str(exc), param="seed") from None
    return int(seed)


def _stream(fields: dict) -> tuple[bool, bool]:
    stream, options = fields.get("stream", False), fields.get("stream_options")
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", param="stream")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options may hold only include_usage", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError("stream_options.include_usage must be true or false", param="stream_options")
    return stream, include
