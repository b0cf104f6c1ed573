"""The server against a hostile client: bodies built to break the parser, clients that leave
mid-upload, a bug inside a handler, a block call longer than the request's deadline, a schema
asked for without the key. Each is answered with its OpenAI-style error (400, never a 500 or a
traceback), counted once in ``/metrics``, and the server keeps answering as ``generate`` does.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient
from served import TIMEOUT_S, client, health, running

import psd_jax.serve.app
from psd_jax.api import BlockDecode
from psd_jax.serve import build_app
from psd_jax.serve.errors import RequestError
from psd_jax.serve.limits import ServerLimits
from psd_jax.serve.requests import ServedModel, parse_request
from psd_jax.serve.responses import ResponseWriter

from test_serve import (  # noqa: F401  (lm and defaults are fixtures)
    BUCKET,
    GUARD,
    KEY,
    QUESTIONS,
    SIZES,
    defaults,
    guarded_app,
    lm,
    metrics,
    sample,
    wait_for,
)

REQUESTS = "psd_jax_requests_total"
PROMPT = "What is 2 + 3?"


def invalid(message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def deep(levels: int) -> bytes:
    return b'{"prompt": ' + b"[" * levels + b"]" * levels + b"}"


# name: (route, raw body, the whole error body of its 400)
HOSTILE = {
    "deep": (
        "completions",
        deep(50_000),
        invalid(
            "the request body nests arrays and objects 50001 levels deep; this server reads at most 64",
            code="limit_exceeded",
        ),
    ),
    "long max_tokens": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "max_tokens": ' + b"9" * 5000 + b"}",
        invalid(
            "max_tokens holds an integer of 5000 digits; this server reads integers of at most 20 digits",
            "max_tokens",
            "limit_exceeded",
        ),
    ),
    "long n": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "n": -' + b"1" * 21 + b"}",
        invalid(
            "n holds an integer of 21 digits; this server reads integers of at most 20 digits", "n", "limit_exceeded"
        ),
    ),
    "long token id": (
        "completions",
        b'{"prompt": [1, 2, ' + b"3" * 40 + b"]}",
        invalid(
            "prompt[2] holds an integer of 40 digits; this server reads integers of at most 20 digits",
            "prompt[2]",
            "limit_exceeded",
        ),
    ),
    "long depth": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "decoder": "psd", "depth": '
        + b"7" * 300
        + b"}",
        invalid(
            "depth holds an integer of 300 digits; this server reads integers of at most 20 digits",
            "depth",
            "limit_exceeded",
        ),
    ),
    "NaN temperature": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "temperature": NaN}',
        invalid("temperature holds NaN, which is not a JSON number", "temperature"),
    ),
    "Infinity top_p": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "top_p": Infinity}',
        invalid("top_p holds Infinity, which is not a JSON number", "top_p"),
    ),
    "-Infinity temperature": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}',
        invalid("temperature holds -Infinity, which is not a JSON number", "temperature"),
    ),
    "infinite max_tokens": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "max_tokens": 1e999}',
        invalid("max_tokens must be a positive integer, got inf", "max_tokens"),
    ),
    "infinite temperature": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "temperature": 1e999}',
        invalid("temperature must be finite, got inf", "temperature", "invalid_settings"),
    ),
    "huge temperature": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "temperature": 1e+308}',
        invalid("temperature must be 0 (greedy) or in [0.0001, 100], got 1e+308", "temperature", "invalid_settings"),
    ),
    "huge cfg_scale": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "cfg_scale": 1e+308}',
        invalid("cfg_scale must be in [0, 100] (0: off), got 1e+308", "cfg_scale", "invalid_settings"),
    ),
    "vicinity past the canvas": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "cache": "dual", "vicinity": 100000}',
        invalid(
            "vicinity 100000 (dual cache) exceeds gen_length - block_length = 32: the positions after a block",
            "vicinity",
            "invalid_settings",
        ),
    ),
    "refresh_every without a cache": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "refresh_every": 2}',
        invalid(
            "refresh_every=2 would be ignored: it is used only with a block KV cache (cache 'prefix' or 'dual') "
            "(here policy='threshold', decoder='plain', cache='none')",
            "refresh_every",
            "invalid_settings",
        ),
    ),
    "surrogate in prompt": (
        "completions",
        b'{"prompt": "What is \\ud800 2 + 3?"}',
        invalid("prompt is not valid Unicode: it holds a lone surrogate (\\ud800)", "prompt"),
    ),
    "surrogate in stop": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "stop": ["a", "\\udfff"]}',
        invalid("stop[1] is not valid Unicode: it holds a lone surrogate (\\udfff)", "stop[1]"),
    ),
    "surrogate in a message": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "What is \\ud800 2 + 3?"}]}',
        invalid("messages[0].content is not valid Unicode: it holds a lone surrogate (\\ud800)", "messages[0].content"),
    ),
    "surrogate in a field name": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "\\ud800": 1}',
        invalid("the field name '\\ud800' is not valid Unicode: it holds a lone surrogate (\\ud800)", "\\ud800"),
    ),
    "bool for an integer": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "max_tokens": true}',
        invalid("max_tokens must be a positive integer, got True", "max_tokens"),
    ),
    "text for a number": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "temperature": "0.5"}',
        invalid("temperature must be a number, got '0.5'", "temperature", "invalid_settings"),
    ),
    "junk inside a message": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": [1, {"b": null}]}}]}]}',
        invalid(
            "messages[0].content[0].text must be a string, got {'a': [1, {'b': None}]}", "messages[0].content[0].text"
        ),
    ),
    "unknown field set to null": (
        "completions",
        b'{"prompt": "What is 2 + 3?", "min_p": null}',
        invalid("unknown field 'min_p' (not an OpenAI or DecodeConfig field)", "min_p"),
    ),
}


@pytest.fixture(scope="module")
def hostile(lm, defaults):  # noqa: F811
    """An open server with the default limits (a 1 MiB body holds a 50,000-deep one)."""
    app = build_app(
        lm, defaults, name="default", batch_sizes=SIZES, max_wait_ms=50, prompt_bucket=BUCKET, warmup_lengths=(BUCKET,)
    )
    with running(app) as url:
        yield url


@pytest.fixture
def server_log(caplog):
    """Every log record of the request's handling: the app's (which propagate to pytest's handler)
    and uvicorn's (whose logger does not propagate), where an unhandled exception is reported."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    try:
        yield caplog
    finally:
        uvicorn_log.removeHandler(caplog.handler)


def assert_quiet(server_log, capfd) -> None:
    """Nothing the client sent reached the log as an error, nor a traceback stderr."""
    errors = [r.getMessage() for r in server_log.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    assert "Traceback" not in server_log.text and "Traceback" not in capfd.readouterr().err


def post(url: str, route: str, raw: bytes, key: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    return httpx.post(f"{url}/v1/{route}", content=raw, headers=headers, timeout=TIMEOUT_S)


# Uploads whose handler has started reading the body, by the X-Upload header their client sent.
READING: dict[str, threading.Event] = {}


@pytest.fixture(autouse=True)
def _reads_are_seen(monkeypatch):
    """The app's body reader marks the upload it starts on (``abandon_upload`` waits for it)."""
    real = psd_jax.serve.app.read_json

    async def read_json(request, limit):
        upload = request.headers.get("x-upload")
        if upload in READING:
            READING[upload].set()
        return await real(request, limit)

    monkeypatch.setattr(psd_jax.serve.app, "read_json", read_json)


def abandon_upload(url: str, key: str | None = None) -> None:
    """Promise a body of 1000 bytes, send part of it, and close the connection once the handler is
    reading the body (so the server has taken the request: it must count it)."""
    where, upload = urlparse(url), uuid.uuid4().hex
    READING[upload] = threading.Event()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {key}\r\n" if key else ""
    head += f"X-Upload: {upload}\r\nContent-Length: 1000\r\n\r\n"
    with socket.create_connection((where.hostname, where.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head.encode() + b'{"prompt": "' + b"x" * 100)
        assert READING[upload].wait(TIMEOUT_S), "the server never started reading the upload"


def requests_total(scraped: dict) -> float:
    return sum(value for (name, _), value in scraped.items() if name == REQUESTS)


def until_counted(url: str, want: float, **labels) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while sample(scraped := metrics(url), REQUESTS, **labels) < want:
        assert time.monotonic() < deadline, (labels, sample(scraped, REQUESTS, **labels), want)
        time.sleep(0.05)
    return scraped


# ------------------------------------------------------------------------------- the body's parse
def check_hostile(url: str, name: str) -> None:
    route, raw, body = HOSTILE[name]
    reply = post(url, route, raw)
    assert (reply.status_code, reply.json()) == (400, body), raw[:80]


def test_a_body_nested_50000_deep_is_400_naming_the_limit(hostile, server_log, capfd):
    assert len(deep(50_000)) < 1 << 20, "under the body limit: the parser, not the size, must refuse it"
    check_hostile(hostile, "deep")
    reply = post(hostile, "completions", deep(64))  # the object and 64 arrays
    assert (reply.status_code, reply.json()["error"]["message"]) == (
        400,
        "the request body nests arrays and objects 65 levels deep; this server reads at most 64",
    )
    reply = post(hostile, "completions", deep(63))  # the deepest body parsed: the prompt's own check answers
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "prompt[0][0]")
    assert reply.json()["error"]["message"].startswith("prompt[0][0] must be a token id (an integer), got [[[")
    assert_quiet(server_log, capfd)


def test_numbers_past_the_parsers_bounds_are_400_naming_their_field(hostile, server_log, capfd):
    """Integers of more than 20 digits and the non-numbers NaN and Infinity are refused as the
    body is parsed, each naming its field (a token id by its index); an infinite float is read
    and refused by its field's own check."""
    for name in ("long max_tokens", "long n", "long token id", "long depth", "infinite max_tokens"):
        check_hostile(hostile, name)
    for name in ("NaN temperature", "Infinity top_p", "-Infinity temperature", "infinite temperature"):
        check_hostile(hostile, name)
    raw = b'{"prompt": "What is 2 + 3?", "max_tokens": NaN, "max_tokens": 16, "temperature": 0}'
    reply = post(hostile, "completions", raw)  # a later duplicate key replaces the refused number
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 16
    assert_quiet(server_log, capfd)


def test_a_lone_surrogate_in_a_string_is_400_naming_its_field(hostile, server_log, capfd):
    for name in ("surrogate in prompt", "surrogate in stop", "surrogate in a message"):
        check_hostile(hostile, name)
    raw = '{"prompt": "What is 2 + 3?", "stop": ["\U0001f600", "\\ud83d\\ude00"]}'.encode()
    assert post(hostile, "completions", raw).status_code == 200, "a surrogate pair is one valid character"
    assert_quiet(server_log, capfd)


def test_a_lone_surrogate_in_a_field_name_is_400_with_the_name_escaped(hostile, server_log, capfd):
    check_hostile(hostile, "surrogate in a field name")
    assert_quiet(server_log, capfd)


# ------------------------------------------------------------------------------------ the protocol
def test_wrong_types_and_junk_are_400_naming_their_field(hostile, server_log, capfd):
    for name in ("bool for an integer", "text for a number", "junk inside a message", "unknown field set to null"):
        check_hostile(hostile, name)
    assert_quiet(server_log, capfd)


CHAT = [{"role": "user", "content": PROMPT}]
# (endpoint, body, (param, code, message)): each refused by the protocol or by the server's checks
# behind it, as ``parse_request`` (the route's own check) answers it.
REFUSED = [
    ("completion", {"prompt": 5}, ("prompt", None, "prompt must be a string or a list of token ids, got 5")),
    ("completion", {"prompt": [1, "a"]}, ("prompt[1]", None, "prompt[1] must be a token id (an integer), got 'a'")),
    ("completion", {"prompt": [True]}, ("prompt[0]", None, "prompt[0] must be a token id (an integer), got True")),
    (
        "completion",
        {"prompt": [[1, 2.0]]},
        ("prompt[0][1]", None, "prompt[0][1] must be a token id (an integer), got 2.0"),
    ),
    (
        "completion",
        {"prompt": ["a", "b"]},
        ("prompt", None, "one prompt per request: send several requests (they are batched)"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "max_tokens": 16.0},
        ("max_tokens", None, "max_tokens must be a positive integer, got 16.0"),
    ),
    ("completion", {"prompt": PROMPT, "seed": "3"}, ("seed", None, "seed must be an integer in [0, 2**32), got '3'")),
    (
        "completion",
        {"prompt": PROMPT, "seed": 2**32},
        ("seed", None, "seed must be an integer in [0, 2**32), got 4294967296"),
    ),
    ("completion", {"prompt": PROMPT, "stream": 1}, ("stream", None, "stream must be true or false, got 1")),
    ("completion", {"prompt": PROMPT, "chat": "no"}, ("chat", None, "chat must be true or false, got 'no'")),
    (
        "completion",
        {"prompt": PROMPT, "stop": [5]},
        ("stop", None, "stop must be a non-empty string or a list of up to 4 of them, got [5]"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "stop": {"a": [{"b": None}]}},
        ("stop", None, "stop must be a non-empty string or a list of up to 4 of them, got {'a': [{'b': None}]}"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": 1}},
        ("stream_options.include_usage", None, "stream_options.include_usage must be true or false, got 1"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True, "x": [[{}]]}},
        ("stream_options.x", None, "stream_options holds an unknown field 'x'; it holds only include_usage"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "stream_options": {"include_usage": True}},
        ("stream_options", None, "stream_options is only allowed with stream: true"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "model": ["default"]},
        ("model", None, "model must be a string, got ['default']"),
    ),
    ("completion", {"prompt": PROMPT, "user": {"id": 1}}, ("user", None, "user must be a string, got {'id': 1}")),
    (
        "completion",
        {"prompt": PROMPT, "n": True},
        ("n", None, "n=True is not supported by this server; leave it out or send 1"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "logit_bias": {"1": 5}},
        ("logit_bias", None, "logit_bias={'1': 5} is not supported by this server; leave it out or send {}"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "messages": CHAT},
        ("messages", None, "messages is a field of /v1/chat/completions, not of /v1/completions"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "depth": True},
        ("depth", "invalid_settings", "depth must be an integer, got True"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "accept_confidence": [0.5]},
        ("accept_confidence", "invalid_settings", "accept_confidence must be a number, got [0.5]"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "decoder": {"name": "psd"}},
        ("decoder", "invalid_settings", "unknown decoder {'name': 'psd'}; choose one of plain, psd, rps, edit"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "policy": "p" * 5000},
        ("policy", "invalid_settings", "unknown policy '" + "p" * 59 + " ... (5002 characters); choose one of"),
    ),
    (
        "completion",
        {"prompt": PROMPT, "max_tokens": 10**19},
        (
            "max_tokens",
            "limit_exceeded",
            "max_tokens 10000000000000000000 exceeds this server's limit of 448 (--max-tokens)",
        ),
    ),
    (
        "completion",
        {"prompt": PROMPT, "settings": ["recommended"]},
        ("settings", None, "settings must be a setting's name (recommended), got ['recommended']"),
    ),
    (
        "chat",
        {"messages": {"role": "user"}},
        ("messages", None, "messages must be a non-empty list of {role, content} objects, got {'role': 'user'}"),
    ),
    (
        "chat",
        {"messages": [None]},
        ("messages[0]", None, "messages[0] must be an object with role and content, got None"),
    ),
    ("chat", {"messages": [{"content": PROMPT}]}, ("messages[0].role", None, "messages[0].role is required")),
    (
        "chat",
        {"messages": [{"role": "user", "content": PROMPT, "name": "bob"}]},
        ("messages[0].name", None, "messages[0] holds an unknown field 'name'; it holds only role and content"),
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        (
            "messages[0].content[0].type",
            None,
            "messages[0].content[0].type must be 'text' (only text parts are supported), got 'image_url'",
        ),
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": None}]},
        (
            "messages[0].content",
            None,
            'messages[0].content must be a string or a list of text parts ({"type": "text", "text": ...}), got None',
        ),
    ),
    (
        "chat",
        {"messages": CHAT, "max_tokens": 16, "max_completion_tokens": 32},
        ("max_completion_tokens", None, "give max_tokens or max_completion_tokens, not both (they differ)"),
    ),
    (
        "chat",
        {"messages": CHAT, "max_completion_tokens": 100_000},
        (
            "max_completion_tokens",
            "limit_exceeded",
            "max_completion_tokens 100000 exceeds this server's limit of 448 (--max-tokens)",
        ),
    ),
    (
        "chat",
        {"messages": CHAT, "prompt": None},
        ("prompt", None, "prompt is a field of /v1/completions, not of /v1/chat/completions"),
    ),
]


def test_the_protocol_refuses_each_field_by_its_path_and_takes_null_as_absent(lm, defaults):  # noqa: F811
    """Wrong types (a bool for an integer, text for a number), nested junk, huge numbers, fields of
    the other endpoint: each is one line naming its field and what was sent (a long value cut
    short), ``param`` its path; a field sent as ``null`` is not sent."""
    settings = lm.settings(defaults)
    served = ServedModel(lm, "default", settings, BUCKET, ServerLimits.for_model(lm.config, settings, BUCKET))
    for endpoint, body, (param, code, message) in REFUSED:
        with pytest.raises(RequestError) as caught:
            parse_request(body, endpoint, served)
        got = caught.value
        assert (got.status, got.param, got.code) == (400, param, code), (body, got.message)
        assert got.message.startswith(message) and "\n" not in got.message and len(got.message) < 300, body
    nulls = dict.fromkeys(("model", "max_tokens", "stop", "stream", "seed", "n", "threshold", "decoder", "chat"))
    assert parse_request({"prompt": PROMPT, **nulls}, "completion", served) == parse_request(
        {"prompt": PROMPT}, "completion", served
    )
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    assert parse_request({"messages": [{"role": "user", "content": parts}]}, "chat", served) == parse_request(
        {"messages": CHAT}, "chat", served
    )


# --------------------------------------------------------------------------- a client that leaves
def test_an_abandoned_upload_is_counted_client_closed_without_a_traceback(hostile, server_log, capfd):
    before, queued = metrics(hostile), health(hostile)["requests"]
    counted = sample(before, REQUESTS, endpoint="/v1/completions", outcome="client_closed")
    abandon_upload(hostile)
    after = until_counted(hostile, counted + 1, endpoint="/v1/completions", outcome="client_closed")
    assert sample(after, REQUESTS, endpoint="/v1/completions", outcome="client_closed") == counted + 1
    assert requests_total(after) == requests_total(before) + 1, "counted once, under client_closed only"
    assert health(hostile)["requests"] == queued, "nothing was queued"
    assert_quiet(server_log, capfd)


def leave_after(url: str, stream: bool, wait: float | None) -> None:
    """Send a whole request and close the connection: at once (``wait`` 0), after ``wait``
    seconds, or (``None``) once the first bytes of the answer came."""
    where = urlparse(url)
    body = json.dumps({"prompt": PROMPT, "stream": stream}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((where.hostname, where.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head.encode() + body)
        if wait is None:
            assert sock.recv(1), "the server closed the connection first"
        elif wait:
            time.sleep(wait)


def read_to_done(url: str) -> int:
    """A stream read to its ``[DONE]``; the connection closed right after. Returns its events."""
    body = {"model": "default", "prompt": PROMPT, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return len(events)


def test_clients_that_leave_at_any_stage_are_each_counted_once(hostile, server_log, capfd):
    """Concurrent clients: whole answers, streams read to [DONE], streams and whole requests left
    at once (queued), after a while (decoding) or after their first bytes, uploads left mid-body.
    ``/metrics`` grows by exactly the requests sent, each under one outcome; a stream read to its
    end is counted ``ok`` by the time its client has read [DONE]; the server compiles nothing."""
    before, programs = metrics(hostile), {k: health(hostile)[k] for k in ("compiled_programs", "compiles")}
    asks = [("whole", None)] * 8 + [("to the end", None)] * 8 + [("mid-body", None)] * 2
    asks += [
        (("leave stream" if stream else "leave whole"), wait) for stream in (True, False) for wait in (0, 0.05, None)
    ]
    asks *= 2
    start = threading.Barrier(len(asks), timeout=TIMEOUT_S)

    def one(kind: str, wait: float | None) -> int:
        start.wait()
        if kind == "whole":
            return post(hostile, "completions", json.dumps({"prompt": PROMPT}).encode()).status_code
        if kind == "to the end":
            return read_to_done(hostile)
        if kind == "mid-body":
            return abandon_upload(hostile)
        return leave_after(hostile, kind == "leave stream", wait)

    with ThreadPoolExecutor(len(asks)) as pool:
        done = list(pool.map(lambda ask: one(*ask), asks))
    read_all = sum(kind == "to the end" for kind, _ in asks)
    answered = sample(metrics(hostile), REQUESTS, endpoint="/v1/completions", outcome="ok")
    ok_before = sample(before, REQUESTS, endpoint="/v1/completions", outcome="ok")
    assert answered - ok_before >= read_all + done.count(200), "a client that read its whole answer is counted"
    deadline = time.monotonic() + TIMEOUT_S
    while requests_total(after := metrics(hostile)) < requests_total(before) + len(asks):
        assert time.monotonic() < deadline, outcomes_grown(before, after)
        time.sleep(0.05)
    time.sleep(2 * psd_jax.serve.app.DISCONNECT_POLL_S)  # nothing is counted twice, however late
    grown = {k: v for k, v in outcomes_grown(before, metrics(hostile)).items() if v}
    left = sum(kind.startswith("leave") for kind, _ in asks)
    assert set(grown) <= {("/v1/completions", o) for o in ("ok", "cancelled", "client_closed")}, grown
    assert grown[("/v1/completions", "client_closed")] == sum(kind == "mid-body" for kind, _ in asks)
    assert grown[("/v1/completions", "ok")] + grown.get(("/v1/completions", "cancelled"), 0) == len(asks) - 4
    assert grown[("/v1/completions", "ok")] >= len(asks) - 4 - left
    wait_for(hostile, running=0, queued=0)
    assert {k: health(hostile)[k] for k in programs} == programs
    assert_quiet(server_log, capfd)


def test_a_stop_string_and_a_client_that_leaves_mid_answer_run_warm_programs(hostile, lm, defaults):  # noqa: F811
    """A row stopped early (a stop string found in an early block, a client gone mid-stream) uses
    the warm-up's programs: ``compiled_programs`` and ``compiles`` do not move."""
    question, want = next(
        (q, w)
        for q in QUESTIONS
        for (w,) in [lm.generate([q], defaults, prompt_bucket=BUCKET)]
        if w.tokens > 2 * defaults.block_length and w.text[5:8].strip()
    )
    stop = want.text[5:8]
    programs = {k: health(hostile)[k] for k in ("compiled_programs", "compiles")}  # generate's own counted
    got = client(hostile).completions.create(model="default", prompt=question, stop=[stop]).choices[0]
    assert (got.text, got.finish_reason) == (want.text[: want.text.find(stop)], "stop")
    cancelled = health(hostile)["cancelled"]
    body = {"model": "default", "prompt": question, "stream": True}
    with httpx.stream("POST", f"{hostile}/v1/completions", json=body, timeout=TIMEOUT_S) as reply:
        assert next(line for line in reply.iter_lines() if line.startswith("data: "))
    wait_for(hostile, running=0, queued=0)
    assert {k: health(hostile)[k] for k in programs} == programs, health(hostile)["cancelled"] - cancelled


# --------------------------------------------------------------------------------- a server's bug
def test_a_bug_in_a_handler_is_a_json_500_logged_once_and_counted_failed(hostile, server_log, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected bug")

    before = metrics(hostile)
    with monkeypatch.context() as patch:
        patch.setattr(psd_jax.serve.app, "parse_request", broken)
        reply = post(hostile, "completions", json.dumps({"prompt": PROMPT}).encode())
    assert reply.status_code == 500
    assert reply.json() == {
        "error": {
            "message": "the server failed to answer this request (an internal error; it is logged)",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    with monkeypatch.context() as patch:  # mid-stream the response has started: an error event ends it
        patch.setattr(ResponseWriter, "chunk", broken)
        body = {"prompt": PROMPT, "stream": True}
        events = httpx.post(f"{hostile}/v1/completions", json=body, timeout=TIMEOUT_S).text.split("\n\n")
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == "internal_error"
    wait_for(hostile, running=0)
    after = metrics(hostile)
    assert sample(after, REQUESTS, endpoint="/v1/completions", outcome="failed") == (
        sample(before, REQUESTS, endpoint="/v1/completions", outcome="failed") + 2
    )
    assert requests_total(after) == requests_total(before) + 2
    logged = [r for r in server_log.records if r.levelno >= logging.ERROR]
    assert [(r.name, r.exc_info[0]) for r in logged] == [("psd_jax.serve.app", RuntimeError)] * 2, logged
    assert "Exception in ASGI application" not in server_log.text


# ------------------------------------------------------------------------------ counted once each
def test_metrics_count_every_v1_request_once_by_outcome(lm, defaults, monkeypatch):  # noqa: F811
    """A known mix to one server: each outcome grows by what was sent, the total by every request."""
    holds: list = []  # what the next block calls wait for, one each, as the test asks
    real_advance, real_parse = BlockDecode.advance, psd_jax.serve.app.parse_request

    def advance(run):
        if holds:
            holds.pop(0)()
        return real_advance(run)

    def parse(body, *args):  # a bug, for one prompt
        if body.get("prompt") == "boom":
            raise RuntimeError("injected bug")
        return real_parse(body, *args)

    guard = {**GUARD, "overrides": GUARD["overrides"] | {"eos_early_stop"}}  # a stream that runs every block
    limits = ServerLimits.for_model(lm.config, lm.settings(defaults), BUCKET, **guard)
    options = dict(name="default", batch_sizes=SIZES, prompt_bucket=BUCKET, warmup_lengths=(BUCKET,))
    app = build_app(lm, defaults, **options, limits=limits, api_key=KEY, request_timeout_s=2.0)
    # The streams' program (eos_early_stop off: every block runs) compiled before serving, as the
    # default's: a compile within a request would run past its 2 s deadline.
    app.state.batcher.warm_up(lm.settings(defaults).replace(eos_early_stop=False), (BUCKET,))
    monkeypatch.setattr(BlockDecode, "advance", advance)
    monkeypatch.setattr(psd_jax.serve.app, "parse_request", parse)
    with running(app) as url:
        api, every_block = client(url, KEY), {"eos_early_stop": False}
        before = metrics(url)
        api.models.list()
        api.completions.create(model="default", prompt=QUESTIONS[0])
        api.chat.completions.create(model="default", messages=[{"role": "user", "content": QUESTIONS[1]}])
        assert list(api.completions.create(model="default", prompt=QUESTIONS[2], stream=True, extra_body=every_block))
        assert refusals(url, holds) == [400, 401, 413, 500, 504, 405, 404]
        wait_for(url, running=0)
        left = threading.Event()  # the first block at once, the second once the server saw the client leave
        holds[:] = [lambda: None, lambda: left.wait(TIMEOUT_S)]
        body = {"model": "default", "prompt": QUESTIONS[5], "stream": True, "eos_early_stop": False}
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S) as reply:
            assert next(line for line in reply.iter_lines() if line.startswith("data: "))
        until_counted(url, 1, endpoint="/v1/completions", outcome="cancelled")
        left.set()
        abandon_upload(url, KEY)
        until_counted(url, 1, endpoint="/v1/completions", outcome="client_closed")
        wait_for(url, running=0, cancelled=1, timed_out=1)
        after = metrics(url)
    grown = outcomes_grown(before, after)
    assert {k: v for k, v in grown.items() if v} == {
        ("/v1/models", "ok"): 1,
        ("/v1/chat/completions", "ok"): 1,
        ("/v1/completions", "ok"): 2,
        ("/v1/completions", "bad_request"): 2,  # 400 and 413
        ("/v1/completions", "unauthorized"): 1,
        ("/v1/completions", "failed"): 1,
        ("/v1/completions", "timed_out"): 1,
        ("/v1/completions", "cancelled"): 1,
        ("/v1/completions", "client_closed"): 1,
        ("other", "bad_request"): 2,  # 405 and 404: no route takes them
    }
    assert requests_total(after) - requests_total(before) == 13


def refusals(url: str, holds: list) -> list[int]:
    """The statuses of a bad setting, a wrong key, a long prompt, an injected bug, a block call
    past the deadline (``holds``: what the next block calls wait for), a wrong method and path."""
    statuses = [
        post(url, "completions", json.dumps({"prompt": PROMPT, "min_p": 0.1}).encode(), KEY).status_code,
        post(url, "completions", json.dumps({"prompt": PROMPT}).encode(), "sk-wrong").status_code,
        post(url, "completions", json.dumps({"prompt": "x" * 5000}).encode(), KEY).status_code,
        post(url, "completions", json.dumps({"prompt": "boom"}).encode(), KEY).status_code,
    ]
    holds[:] = [lambda: time.sleep(3.0)]  # one block call past the 2 s deadline
    statuses.append(post(url, "completions", json.dumps({"prompt": PROMPT}).encode(), KEY).status_code)
    return statuses + [
        httpx.get(f"{url}/v1/completions", headers={"authorization": f"Bearer {KEY}"}).status_code,
        post(url, "nothing", b"{}", KEY).status_code,
    ]


OUTCOMES = ("ok", "bad_request", "unauthorized", "busy", "timed_out", "failed", "cancelled", "client_closed")


def outcomes_grown(before: str, after: str) -> dict[tuple[str, str], float]:
    """How much each (endpoint, outcome) request count grew between two scrapes of /metrics."""
    return {
        (endpoint, outcome): sample(after, REQUESTS, endpoint=endpoint, outcome=outcome)
        - sample(before, REQUESTS, endpoint=endpoint, outcome=outcome)
        for endpoint in ("/v1/models", "/v1/completions", "/v1/chat/completions", "other")
        for outcome in OUTCOMES
    }


# ---------------------------------------------------------------------------------- the deadline
def test_the_timeout_fires_at_the_deadline_during_a_long_block_call(lm, defaults, monkeypatch):  # noqa: F811
    real = BlockDecode.advance

    def slow_advance(run):  # one block call lasts 3 s, the deadline is 0.5 s
        time.sleep(3.0)
        return real(run)

    app = build_app(
        lm,
        defaults,
        name="default",
        batch_sizes=SIZES,
        prompt_bucket=BUCKET,
        warmup_lengths=(BUCKET,),
        request_timeout_s=0.5,
    )
    with running(app) as url:
        monkeypatch.setattr(BlockDecode, "advance", slow_advance)
        began = time.monotonic()
        reply = post(url, "completions", json.dumps({"prompt": PROMPT}).encode())
        waited = time.monotonic() - began
        assert reply.status_code == 504 and waited < 2.0, (reply.status_code, waited)
        assert reply.json() == {
            "error": {
                "message": "the request did not finish within the server's timeout of 0.5 s (--request-timeout)",
                "type": "server_error",
                "param": None,
                "code": "timeout",
            }
        }
        wait_for(url, timed_out=1, running=0)
        monkeypatch.undo()
        assert health(url)["cancelled"] == 0, "a request past its deadline is counted once, as timed out"
        (want,) = lm.generate([QUESTIONS[0]], defaults, prompt_bucket=BUCKET)
        assert client(url).completions.create(model="default", prompt=QUESTIONS[0]).choices[0].text == want.text
        scraped = metrics(url)
        assert sample(scraped, REQUESTS, endpoint="/v1/completions", outcome="timed_out") == 1
        assert sample(scraped, REQUESTS, endpoint="/v1/completions", outcome="ok") == 1


def test_a_drain_ends_a_static_batch_after_drain_seconds(lm, defaults, monkeypatch):  # noqa: F811
    """Static batching: a drain fails the batch's request at once and its decode stops at the block
    call in flight, not at the batch's end (3 blocks of 1.5 s here)."""
    real = BlockDecode.advance

    def slow_advance(run):
        time.sleep(1.5)
        return real(run)

    app = build_app(lm, defaults, name="default", batching="static", batch_sizes=(1,), prompt_bucket=BUCKET)
    batcher = app.state.batcher
    with running(app) as url, ThreadPoolExecutor(1) as pool:
        monkeypatch.setattr(BlockDecode, "advance", slow_advance)
        body = json.dumps({"prompt": PROMPT, "eos_early_stop": False}).encode()
        answer = pool.submit(post, url, "completions", body)
        wait_for(url, running=1)
        drained = time.monotonic()
        batcher.loop.call_soon_threadsafe(batcher.begin_drain, 0.2)
        reply = answer.result(TIMEOUT_S)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"
        drained_health = httpx.get(f"{url}/health", timeout=TIMEOUT_S)  # a load balancer stops sending
        assert (drained_health.status_code, drained_health.json()["status"]) == (503, "draining")
        assert time.monotonic() - drained < 1.4, "failed at the drain's end, not after the batch's blocks"
        deadline = time.monotonic() + 10
        while health(url)["running"]:
            assert time.monotonic() < deadline, "the batch's decode did not stop at the next block boundary"
            time.sleep(0.05)


# ------------------------------------------------------------------------------ the schema's pages
def test_with_a_key_the_docs_and_schema_are_not_served(refusing, lm, defaults):  # noqa: F811
    not_found = {"error": {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": "404"}}
    for path in ("/docs", "/redoc", "/openapi.json"):
        for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
            reply = refusing.get(path, headers=headers)
            assert (reply.status_code, reply.json()) == (404, not_found), (path, headers)
    open_app = TestClient(build_app(lm, defaults, name="default", batch_sizes=SIZES, prompt_bucket=BUCKET))
    assert open_app.get("/docs").status_code == open_app.get("/redoc").status_code == 200
    schema = open_app.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]


@pytest.fixture
def refusing(lm, defaults):  # noqa: F811
    return TestClient(guarded_app(lm, defaults))


# -------------------------------------------------------------------------------- all at once
def test_the_server_survives_a_hostile_mix(hostile, lm, defaults, server_log, capfd):  # noqa: F811
    """Every hostile request above, and abandoned uploads, concurrently with valid requests: each
    gets its own answer, nothing is compiled, and afterwards a request is answered as ``generate``
    does."""
    valid = QUESTIONS[6:10]
    wants = [lm.generate([question], defaults, prompt_bucket=BUCKET)[0].text for question in valid]
    closed = sample(metrics(hostile), REQUESTS, endpoint="/v1/completions", outcome="client_closed")
    programs = {k: health(hostile)[k] for k in ("compiled_programs", "compiles")}
    api = client(hostile)
    start = threading.Barrier(len(HOSTILE) + len(valid) + 2, timeout=TIMEOUT_S)

    def hostile_one(name: str) -> tuple[int, dict]:
        start.wait()
        route, raw, _ = HOSTILE[name]
        reply = post(hostile, route, raw)
        return reply.status_code, reply.json()

    def valid_one(question: str) -> str:
        start.wait()
        return api.completions.create(model="default", prompt=question).choices[0].text

    def abandoned() -> None:
        start.wait()
        abandon_upload(hostile)

    with ThreadPoolExecutor(len(HOSTILE) + len(valid) + 2) as pool:
        refused = [pool.submit(hostile_one, name) for name in HOSTILE]
        answered = [pool.submit(valid_one, q) for q in valid]
        left = [pool.submit(abandoned) for _ in range(2)]
        assert [f.result(TIMEOUT_S) for f in refused] == [(400, body) for _, _, body in HOSTILE.values()]
        assert [f.result(TIMEOUT_S) for f in answered] == wants
        [f.result(TIMEOUT_S) for f in left]
    until_counted(hostile, closed + 2, endpoint="/v1/completions", outcome="client_closed")
    (want,) = lm.generate([QUESTIONS[0]], defaults, prompt_bucket=BUCKET)
    assert api.completions.create(model="default", prompt=QUESTIONS[0]).choices[0].text == want.text
    state = health(hostile)
    assert (state["running"], state["queued"]) == (0, 0)
    assert {k: state[k] for k in programs} == programs, "a refused or warm request compiles nothing"
    assert_quiet(server_log, capfd)
