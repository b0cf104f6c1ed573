"""The OpenAI protocol this server speaks, as pydantic models: the one place to read its API.

The request models (``CompletionRequest``, ``ChatCompletionRequest``) hold OpenAI's fields, the
OpenAI fields this server does not implement (accepted only at their neutral value: ``NEUTRAL``),
and the server's extensions: ``chat``, ``settings`` and every ``DecodeConfig`` field by name. The
extension fields are made from ``DecodeConfig``'s dataclass fields (their types and
``FIELD_HELP`` for the schema), so a new setting is a request field without an edit here; they are
checked by ``DecodeConfig`` itself (its messages name the field and its range), not twice. The
response models are the bodies: ``responses.ResponseWriter`` builds each answer and chunk as one,
and ``errors`` each error (``ErrorResponse``). FastAPI shows all of them at ``/docs`` and ``/openapi.json``, but never parses a body
with them: ``requests.parse_request`` does, behind ``body.read_json``'s bounds, and turns every
problem into the server's own 400 (``errors.RequestError``), never FastAPI's 422.

Every field that may fail says what it must be (``expect``), so a refusal is one line naming the
field and what was sent: ``max_tokens must be a positive integer, got 'ten'``, ``param:
"max_tokens"``; a nested field is named by its path (``messages[0].role``).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    WrapValidator,
    create_model,
)
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from ..core.config import CONFIDENCE_ALIASES, FIELD_HELP, DecodeConfig
from ..core.trace import FIELDS as TRACE_FIELDS
from ..prompts import SEED_LIMIT
from ..recommended import SETTINGS_NAMES
from .errors import ErrorResponse, RequestError
from .json_object import JsonObject

MAX_STOP = 4  # stop strings, as OpenAI
ROLES = ("system", "user", "assistant")
SHOWN_CHARS = 60  # what a message quotes of a refused value
_EXPECTED = "expected"  # the error type of a value that is not what its field expects


# ------------------------------------------------------------------------------- field checks
def expect(what: str, *, whole: bool = False) -> WrapValidator:
    """A field's check that refuses with ``what`` the field must be (``must be a positive
    integer``). A failure inside the value (a message of ``messages``) keeps its own, deeper
    error unless ``whole``; the field's type still gives its schema."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            if whole or any(not e["loc"] for e in exc.errors()):
                raise PydanticCustomError(_EXPECTED, what) from None
            raise

    return WrapValidator(check)


def _by_kind(branches: dict[type, TypeAdapter], what: str) -> WrapValidator:
    """A union checked by the JSON kind of its value (a string, a list): only the matching branch,
    so an error names the place inside it (``messages[0].content[1].type``), not every branch."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        for kind, adapter in branches.items():
            if isinstance(value, kind):
                return adapter.validate_python(value)
        raise PydanticCustomError(_EXPECTED, what)

    return WrapValidator(check)


# ------------------------------------------------------------------------------------ requests
class StreamOptions(JsonObject):
    """``stream_options``, allowed with ``stream: true``."""

    include_usage: Annotated[StrictBool, expect("must be true or false")] | None = Field(
        None, description="end the stream with one chunk of no choices and the request's usage"
    )


class TextPart(JsonObject):
    """One part of a message's content; only text parts are taken."""

    type: Annotated[Literal["text"], expect("must be 'text' (only text parts are supported)")]
    text: Annotated[StrictStr, expect("must be a string")]


_PART = '{"type": "text", "text": ...}'
Content = Annotated[
    str | list[TextPart],
    _by_kind(
        {
            str: TypeAdapter(StrictStr),
            list: TypeAdapter(list[Annotated[TextPart, expect(f"must be a text part ({_PART})")]]),
        },
        f"must be a string or a list of text parts ({_PART})",
    ),
]


class ChatMessage(JsonObject):
    """One turn of a conversation; the turns go through the checkpoint's chat template."""

    role: Annotated[Literal[ROLES], expect(f"must be one of {', '.join(ROLES)}")]
    content: Content = Field(description="the turn's text, or its text parts (joined)")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# OpenAI fields not implemented here, and the values that mean "not used": a request may send them
# only at one of those (a setting is refused rather than silently ignored, as ``DecodeConfig``
# does). Both endpoints take all of them, so a client that sends a neutral value of either's is
# answered.
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


def _loose(schema: dict[str, Any], description: str, check: Callable[[Any], Any] | None = None) -> Any:
    """A field taken as sent (``requests`` or ``DecodeConfig`` checks its value), shown with
    ``schema``; ``check`` refuses a value of the wrong kind, passing the others on unchanged.
    ``null`` is also accepted: a field sent as ``null`` is a field not sent."""
    null = {"type": "null"}
    shown = schema if null in schema.get("anyOf", ()) else {"anyOf": [schema, null]}
    checked = [PlainValidator(check)] if check is not None else []
    return (Annotated[(Any, *checked, WithJsonSchema({**shown, "description": description}))], None)


def _neutral_fields() -> dict[str, Any]:
    return {
        name: _loose(
            {"enum": list(NEUTRAL[name])},
            f"not implemented: accepted only at {' or '.join(json.dumps(v) for v in NEUTRAL[name])}",
        )
        for name in NEUTRAL
    }


# The JSON kind of a ``DecodeConfig`` field by its type, as ``config._check_types`` words it: the
# value must be (an integer is a number; ``true`` is neither). A field of choices (a ``Literal``) is
# left to ``DecodeConfig``, whose message lists them.
_KINDS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    int: ("must be an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("must be a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    bool: ("must be true or false", lambda v: isinstance(v, bool)),
}


def _kind_check(hint: Any) -> Callable[[Any], Any] | None:
    kind = next((t for t in (hint, *typing.get_args(hint)) if t in _KINDS), None)
    if kind is None:
        return None
    what, ok = _KINDS[kind]

    def check(value: Any) -> Any:
        if not ok(value):
            raise PydanticCustomError(_EXPECTED, what)
        return value  # as sent: DecodeConfig checks the value itself

    return check


def _decode_fields() -> dict[str, Any]:
    """Every ``DecodeConfig`` field as a request field, shown with its dataclass type and its
    ``FIELD_HELP`` line (the server's value when left out), its value's kind checked here and the
    value itself by ``DecodeConfig``."""
    hints = typing.get_type_hints(DecodeConfig)
    fields = {}
    for field in dataclasses.fields(DecodeConfig):
        hint = hints[field.name]
        schema = TypeAdapter(hint).json_schema()
        if field.name == "confidence":
            schema["enum"] = [*schema["enum"], *CONFIDENCE_ALIASES]
        description = f"{FIELD_HELP[field.name]} (default: the server's)"
        fields[field.name] = _loose(schema, description, _kind_check(hint))
    return fields


DECODE_FIELDS = frozenset(f.name for f in dataclasses.fields(DecodeConfig))
StopString = Annotated[StrictStr, Field(min_length=1)]
PositiveInt = Annotated[StrictInt, Field(gt=0), expect("must be a positive integer")]
Bool = Annotated[StrictBool, expect("must be true or false")]


class _Request(JsonObject):
    """The fields both endpoints share (the order is the order their errors are reported in)."""

    model: Annotated[StrictStr, expect("must be a string")] | None = Field(
        None, description="the served model's id (`GET /v1/models`); another is a 404"
    )
    settings: Annotated[StrictStr, expect(f"must be a setting's name ({', '.join(SETTINGS_NAMES)})")] | None = Field(
        None,
        description="a named setting over the server's defaults, under the request's own decoding fields "
        "(extension; `recommended`: the model directory's recommended setting)",
    )


class _Output(JsonObject):
    """How the answer comes back, after the prompt and its length."""

    stop: (
        Annotated[
            StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)],
            expect(f"must be a non-empty string or a list of up to {MAX_STOP} of them", whole=True),
        ]
        | None
    ) = Field(None, description="text that ends the answer (cut before it)")
    stream: Bool | None = Field(None, description="server-sent events, one chunk per decoded block")
    stream_options: Annotated[StreamOptions, expect('must be an object ({"include_usage": true or false})')] | None = (
        Field(None, description="with `stream: true`")
    )
    seed: Annotated[StrictInt, Field(ge=0, lt=SEED_LIMIT), expect("must be an integer in [0, 2**32)")] | None = Field(
        None, description="the sampling noise of a sampled request (it then decodes alone)"
    )
    user: Annotated[StrictStr, expect("must be a string")] | None = None


TokenId = Annotated[StrictInt, expect("must be a token id (an integer)")]


class _PromptList:
    """A list prompt, read by the kind of its first item: token ids, or a list of one prompt
    (text or token ids), so an error names the item at fault (``prompt[3]``)."""

    ADAPTERS = {
        str: TypeAdapter(list[Annotated[StrictStr, expect("must be text, as the list's first prompt")]]),
        list: TypeAdapter(list[Annotated[list[TokenId], expect("must be a list of token ids")]]),
    }
    IDS = TypeAdapter(list[TokenId])

    @classmethod
    def validate_python(cls, value: list) -> list:
        kind = next((k for k in cls.ADAPTERS if value and isinstance(value[0], k)), None)
        return (cls.IDS if kind is None else cls.ADAPTERS[kind]).validate_python(value)


class _CompletionFields(_Request):
    prompt: Annotated[
        str | list[int] | list[str] | list[list[int]],
        _by_kind({str: TypeAdapter(StrictStr), list: _PromptList}, "must be a string or a list of token ids"),
    ] = Field(description="text (through the chat template, unless `chat` is false) or token ids; one prompt")
    chat: Bool | None = Field(
        None, description="extension: whether a text prompt goes through the chat template (default: when it has one)"
    )
    max_tokens: PositiveInt | None = Field(None, description="the generation length, rounded up to whole blocks")


class _ChatFields(_Request):
    messages: Annotated[
        list[Annotated[ChatMessage, expect("must be an object with role and content")]],
        Field(min_length=1),
        expect("must be a non-empty list of {role, content} objects"),
    ]
    max_tokens: PositiveInt | None = Field(None, description="the generation length, rounded up to whole blocks")
    max_completion_tokens: PositiveInt | None = Field(None, description="as max_tokens")


def _request_model(name: str, fields: type[JsonObject], doc: str) -> type[JsonObject]:
    """OpenAI's fields, then the output's, the neutral ones and ``DecodeConfig``'s (the schema
    page's order)."""
    output = {field: (info.annotation, info) for field, info in _Output.model_fields.items()}
    model = create_model(
        name,
        __base__=fields,
        __doc__=doc,
        **output,
        **_neutral_fields(),
        **_decode_fields(),
    )
    return model


CompletionRequest = _request_model(
    "CompletionRequest",
    _CompletionFields,
    "`POST /v1/completions`: OpenAI's fields, and every decoding setting (`DecodeConfig`) by name.",
)
ChatCompletionRequest = _request_model(
    "ChatCompletionRequest",
    _ChatFields,
    "`POST /v1/chat/completions`: OpenAI's fields, and every decoding setting (`DecodeConfig`) by name.",
)
REQUESTS: dict[str, type[JsonObject]] = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def parse(body: Any, endpoint: str) -> Any:
    """``body`` (parsed JSON) as ``endpoint``'s request model ("completion" or "chat"); a field of
    the model sent as ``null`` counts as not sent (an unknown one is refused all the same). Every
    problem is a ``RequestError`` (400) whose ``param`` is the field's path."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = REQUESTS[endpoint]
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None or k not in model.model_fields})
    except ValidationError as exc:
        raise request_error(exc, model, endpoint) from None


def request_error(exc: ValidationError, model: type[BaseModel], endpoint: str) -> RequestError:
    """The first problem of ``exc`` as one line naming its field: an unknown top-level field before
    any other (as the body's first field in name order), then in the model's field order."""
    errors = exc.errors()
    unknown = sorted((e for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1), key=_path)
    error = unknown[0] if unknown else errors[0]
    where, kind = _path(error), error["type"]
    if kind == "extra_forbidden":
        return RequestError(_unknown(error["loc"], model, endpoint), param=where)
    if kind == "missing":
        return RequestError(f"{where} is required", param=where)
    if kind == _EXPECTED:
        code = "invalid_settings" if where in DECODE_FIELDS else None  # as DecodeConfig's own refusals
        return RequestError(f"{where} {error['msg']}, got {shown(error['input'])}", param=where, code=code)
    return RequestError(f"{where}: {error['msg']}", param=where)


def _unknown(loc: tuple, model: type[BaseModel], endpoint: str) -> str:
    name = loc[-1]
    if len(loc) == 1:
        other = next(e for e in REQUESTS if e != endpoint)
        if name in REQUESTS[other].model_fields:
            return f"{name} is a field of {PATHS[other]}, not of {PATHS[endpoint]}"
        return f"unknown field {name!r} (not an OpenAI or DecodeConfig field)"
    parent, holder = _path({"loc": loc[:-1]}), _model_at(model, loc[:-1])
    known = " and ".join(holder.model_fields) if holder is not None else "its own fields"
    return f"{parent} holds an unknown field {name!r}; it holds only {known}"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model of the object at ``loc`` inside ``model``'s (list indices step into items)."""
    for step in loc:
        if isinstance(step, int):
            continue
        found = _model_in(model.model_fields[step].annotation)
        if found is None:
            return None
        model = found
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _path(error: dict) -> str:
    """A location as a client writes it: ``messages[0].content``."""
    out = ""
    for step in error["loc"]:
        out += f"[{step}]" if isinstance(step, int) else f".{step}" if out else str(step)
    return out


def shown(value: Any) -> str:
    """``value`` as a message quotes it, cut short (a client may send a megabyte in one field)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]} ... ({len(text)} characters)"


# ----------------------------------------------------------------------------------- responses
class Usage(JsonObject):
    """OpenAI's usage, and the diffusion decoder's cost (extension): model calls and tokens per call."""

    prompt_tokens: int
    completion_tokens: int = Field(description="tokens before EOS/EOT")
    total_tokens: int
    model_calls: int = Field(description="extension: the row's model calls (NFE)")
    tokens_per_forward: float = Field(description="extension: completion_tokens / model_calls")


_TRACE_TYPES: dict[str, Any] = {"kind": list[str]}  # the others hold integers
Trace = create_model(
    "Trace",
    __base__=JsonObject,
    __doc__='Extension (`"trace": true`): when and how each generated position was written (docs/trace.md), '
    "from position `offset` of the generation.",
    offset=(int, ...),
    block_length=(int, ...),
    **{name: (_TRACE_TYPES.get(name, list[int]), ...) for name in TRACE_FIELDS},
    pieces=(list[str], Field(description="each position's text as it reads in the answer")),
    first_pieces=(list[str], Field(description="the text of the token first written there")),
)
FinishReason = Literal["stop", "length"]


class _Choice(JsonObject):
    index: int
    finish_reason: FinishReason | None = Field(description="stop (EOS/EOT or a stop string) or length")
    logprobs: None
    token_ids: list[int] = Field(description="extension: the generated ids before EOS/EOT")
    trace: Trace | None = Field(None, description='extension: with `"trace": true`')  # type: ignore[valid-type]


class CompletionChoice(_Choice):
    text: str


class AssistantMessage(JsonObject):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatDelta(JsonObject):
    """A chunk's text; the first chunk of an answer also names the role."""

    role: Literal["assistant"] | None = None
    content: str


class ChatChunkChoice(_Choice):
    delta: ChatDelta


class _Answer(JsonObject):
    id: str
    created: int
    model: str


class CompletionResponse(_Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(_Answer):
    """One server-sent event of a stream: a block's text; with ``include_usage`` the last one has
    no choices and the usage."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Answer):
    """One server-sent event of a stream: a block's text; with ``include_usage`` the last one has
    no choices and the usage."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(JsonObject):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="extension: the model's context in tokens")


class ModelList(JsonObject):
    object: Literal["list"]
    data: list[ModelCard]


# ---------------------------------------------------------------------------------- schema page
REF = "#/components/schemas/{model}"
RESPONSES = (CompletionResponse, ChatCompletionResponse, CompletionChunk, ChatCompletionChunk, ModelList, ErrorResponse)


def schema_components() -> dict[str, Any]:
    """Every model's schema (and the objects inside them) for the OpenAPI document's
    ``components.schemas``: the requests as they are read, the responses as they are written."""
    models = [(m, "validation") for m in REQUESTS.values()] + [(m, "serialization") for m in RESPONSES]
    _, schema = models_json_schema(models, ref_template=REF)
    return schema["$defs"]


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}


def request_body(endpoint: str) -> dict[str, Any]:
    """A route's ``openapi_extra``: its request body is ``endpoint``'s model (read by the server,
    not by FastAPI)."""
    return {"requestBody": {"required": True, "content": _json(REQUESTS[endpoint])}}


_ERRORS = {
    400: "a bad request: `param` names the field at fault",
    401: "no or a wrong API key (`--api-key`)",
    404: "a model this server does not serve",
    413: "a body past `--max-body-bytes`",
    500: "the decode failed, or the server did",
    503: "the queue is full, or the server is shutting down",
    504: "past `--request-timeout`",
}


def responses(endpoint: str | None) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses``: its answer (``None``: ``GET /v1/models``'s), a stream's chunks and
    the errors."""
    if endpoint is None:
        return {200: {"description": "the served model", "content": _json(ModelList)}, 401: _error(401)}
    whole = {"completion": CompletionResponse, "chat": ChatCompletionResponse}[endpoint]
    chunk = {"completion": CompletionChunk, "chat": ChatCompletionChunk}[endpoint]
    events = {"text/event-stream": {"schema": {"$ref": REF.format(model=chunk.__name__)}}}
    answer = {
        "description": f"the answer; with `stream: true` server-sent events `data: <{chunk.__name__}>`, one per "
        "decoded block, then `data: [DONE]`",
        "content": {**_json(whole), **events},
    }
    return {200: answer, **{status: _error(status) for status in _ERRORS}}


def _error(status: int) -> dict[str, Any]:
    return {"description": _ERRORS[status], "content": _json(ErrorResponse)}
