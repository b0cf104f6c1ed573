"""The OpenAI-compatible server, through the official ``openai`` client against a server started
here on 127.0.0.1: answers equal ``generate``'s, streams send one chunk per block, concurrent
requests batch without mixing rows, and bad requests get their 400 while the server keeps answering;
the request limits, the API key and the metrics of a guarded server.

Few compiled settings on purpose (threshold decoding of the shipped model at gen 48 and 32, batch
sizes 1 and 16), so the whole file runs in a few minutes on two CPU cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from paths import DEFAULT_MODEL as MODEL_DIR
from paths import GOLDENS
from prometheus_client.parser import text_string_to_metric_families
from served import TIMEOUT_S, client, health, running

from psd_jax import DecodeConfig, load_model
from psd_jax.api import BlockDecode
from psd_jax.core.config import MAX_BRANCHES, RECOMMENDED
from psd_jax.model_dir import model_settings
from psd_jax.serve import auth, build_app, protocol
from psd_jax.serve.cli import api_key_from
from psd_jax.serve.cli import main as serve_main
from psd_jax.serve.errors import RequestError
from psd_jax.serve.limits import ALL_FIELDS, MAX_BODY_BYTES, LimitError, ServerLimits
from psd_jax.serve.requests import ServedModel, parse_request
from psd_jax.serve.text import TextStream

QUESTIONS = [json.loads(line)["question"] for line in (MODEL_DIR / "test.jsonl").read_text().splitlines()[:16]]
BUCKET = 64  # every test prompt (chat-templated questions) pads to one bucket
SIZES = (1, 16)


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL_DIR)


@pytest.fixture(scope="module")
def defaults():
    return model_settings(MODEL_DIR, {"policy": "threshold"})


@pytest.fixture(scope="module")
def server(lm, defaults):
    app = build_app(
        lm, defaults, name="default", batch_sizes=SIZES, max_wait_ms=50, prompt_bucket=BUCKET, warmup_lengths=(BUCKET,)
    )
    with running(app) as url:
        yield url


# The guarded server: an API key, tight limits, a small body limit and a few overridable fields.
KEY = "sk-test-0123456789"
GUARD = {
    "max_tokens": 48,
    "max_prompt_tokens": 60,  # every test question (at most 57 tokens) fits
    "max_depth": 2,
    "max_k_max": 4,
    "max_body_bytes": 4096,
    "overrides": frozenset({"decoder", "depth", "k_max", "gen_length", "temperature"}),
}


def guarded_app(lm, defaults):
    limits = ServerLimits.for_model(lm.config, defaults, BUCKET, **GUARD)
    return build_app(
        lm,
        defaults,
        name="default",
        batch_sizes=SIZES,
        max_wait_ms=50,
        prompt_bucket=BUCKET,
        limits=limits,
        api_key=KEY,
    )


@pytest.fixture(scope="module")
def guarded(lm, defaults):
    with running(guarded_app(lm, defaults)) as url:
        yield url


@pytest.fixture
def refusing(lm, defaults):
    """The guarded server's app in process, never started: its batcher never runs, so only requests
    it refuses may be sent (a request that passed would wait forever)."""
    return TestClient(guarded_app(lm, defaults))


def metrics(url: str) -> dict[tuple, float]:
    """The server's ``/metrics`` as ``{(sample name, sorted labels): value}``."""
    return parsed_metrics(httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text)


def parsed_metrics(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(scraped: dict, name: str, **labels) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


def blocks_decoded(row, settings: DecodeConfig) -> int:
    """Blocks a row decodes: up to the one holding its first EOS, or all of them."""
    if row.tokens == settings.gen_length:
        return settings.num_blocks
    return row.tokens // settings.block_length + 1 if settings.eos_early_stop else settings.num_blocks


# --------------------------------------------------------------------------------------- engine
def test_block_decode_equals_generate_with_a_cache():
    """Cached rows move through blocks together: one call per block, the tokens of ``generate``."""
    tiny = load_model(GOLDENS / "llada-tiny")
    prompts = [[474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492], [280, 242, 425, 15, 2, 138, 188]]
    settings = DecodeConfig(gen_length=48, block_length=16, policy="threshold", threshold=0.7, cache="dual")
    expected = tiny.generate(prompts, settings, prompt_bucket=16)
    run: BlockDecode = tiny.start_blocks(prompts, settings, prompt_bucket=16)
    progress = [run.advance().final_blocks.tolist() for _ in range(settings.num_blocks)]
    assert run.done and progress == [[1, 1], [2, 2], [3, 3]]
    for want, got in zip(expected, run.results()):
        assert (got.output_ids, got.nfe, got.stats) == (want.output_ids, want.nfe, want.stats)


def test_text_stream_holds_back_stop_starts_and_split_characters():
    pieces = {(1,): "ab#", (1, 2): "ab##x", (1, 2, 3): "ab##xy\ufffd"}
    text = TextStream(lambda ids: pieces[tuple(ids)], stop=("##x",))
    assert text.update([1], last=False) == "ab"  # '#' may start the stop string
    assert text.update([1, 2], last=False) == "" and text.stopped  # it does: cut before it
    plain = TextStream(lambda ids: pieces[tuple(ids)])
    assert [plain.update(ids, last) for ids, last in (([1], False), ([1, 2, 3], False), ([1, 2, 3], True))] == [
        "ab#",
        "#xy",
        "\ufffd",
    ]


# ------------------------------------------------------------------------------------- answers
def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["default"]
    state = health(server)
    assert state["status"] == "ok" and state["batching"] == "continuous"
    # the defaults' programs, compiled at start-up: start, block call, join and stop per size, the
    # moves between sizes
    assert state["compiles"] == state["compiled_programs"] == 4 * len(SIZES) + len(SIZES) * (len(SIZES) - 1)


def test_greedy_completions_and_chat_equal_generate(server, lm, defaults):
    api = client(server)
    compiles = health(server)["compiles"]
    for question in QUESTIONS[:2]:
        (want,) = lm.generate([question], defaults, prompt_bucket=BUCKET)
        got = api.completions.create(model="default", prompt=question)
        chat = api.chat.completions.create(model="default", messages=[{"role": "user", "content": question}])
        assert got.choices[0].text == want.text == chat.choices[0].message.content
        assert got.choices[0].token_ids == want.output_ids[: want.tokens]
        assert got.usage.completion_tokens == want.tokens and got.usage.model_calls == want.nfe
        assert got.usage.prompt_tokens == len(lm.encode(question)) and chat.usage == got.usage
        assert got.choices[0].finish_reason == "stop"  # EOS before the end
    assert health(server)["compiles"] == compiles, "the default settings must not compile again"


def test_streamed_chunks_join_to_the_answer_one_per_block(server, lm, defaults):
    api = client(server)
    for question in QUESTIONS[2:4]:
        (want,) = lm.generate([question], defaults, prompt_bucket=BUCKET)
        whole = api.completions.create(model="default", prompt=question)
        chunks = list(
            api.completions.create(
                model="default", prompt=question, stream=True, stream_options={"include_usage": True}
            )
        )
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == whole.choices[0].text == want.text
        assert len(texts) == blocks_decoded(want, defaults) and chunks[-1].usage == whole.usage
        deltas = [
            c.choices[0].delta
            for c in api.chat.completions.create(
                model="default", messages=[{"role": "user", "content": question}], stream=True
            )
        ]
        assert deltas[0].role == "assistant" and "".join(d.content for d in deltas) == want.text


def test_rows_of_other_lengths_and_thresholds_share_batches_and_equal_generate(server, lm, defaults):
    """Continuous batching: concurrent requests with max_tokens 16/32/48 and three thresholds run in
    the programs compiled at start-up (runtime values, one canvas of 48), each its own generate's."""
    api = client(server)
    asks = [
        dict(prompt=q, max_tokens=(16, 32, 48)[i % 3], extra_body={"threshold": (0.9, 0.6, 0.75)[i % 4 % 3]})
        for i, q in enumerate(QUESTIONS[:12])
    ]
    programs = health(server)["compiled_programs"]
    ask = lambda kw: api.completions.create(model="default", **kw).choices[0]  # noqa: E731
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, asks))
    assert health(server)["compiled_programs"] == programs
    for kw, choice in zip(asks, got):
        settings = defaults.replace(gen_length=kw["max_tokens"], **kw["extra_body"])
        (want,) = lm.generate([kw["prompt"]], settings, prompt_bucket=BUCKET)
        assert (choice.text, choice.token_ids) == (want.text, want.output_ids[: want.tokens]), kw


def test_editing_requests_share_a_batch_and_stream_only_final_blocks(server, lm, defaults):
    """Token editing asked per request (``decoder="edit"``, each its own editing threshold, one with
    editing off): concurrent requests share one compiled program, each answer is its own
    ``generate``'s, and a stream sends a block only once it is final (a block is rewritten while it
    decodes), so its chunks join to the answer."""
    api = client(server)
    edit = {"decoder": "edit", "policy": "threshold_schedule", "threshold": 0.5}
    asks = [dict(prompt=q, extra_body={**edit, "editing_threshold": e}) for q, e in zip(QUESTIONS[6:9], (0.3, 0.6, 0))]
    ask = lambda kw: api.completions.create(model="default", **kw).choices[0]  # noqa: E731
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, asks))
    edits = 0
    for kw, choice in zip(asks, got):
        (want,) = lm.generate([kw["prompt"]], defaults.replace(**kw["extra_body"]), prompt_bucket=BUCKET)
        assert (choice.text, choice.token_ids) == (want.text, want.output_ids[: want.tokens]), kw
        edits += want.stats["edits"]
    assert edits > 0  # the shipped model is not trained to edit, but does
    chunks = [c.choices[0].text for c in api.completions.create(model="default", stream=True, **asks[0])]
    assert "".join(chunks) == got[0].text


def test_a_request_for_the_trace_gets_generates_trace_whole_and_per_block(server, lm, defaults):
    """``"trace": true`` (the setting, an extension field): the answer's choice holds the trace of its
    blocks from offset 0, ``generate(trace=True)``'s; a stream sends each block's trace with the
    block, and they join to it; a request without it gets no such field (a plain OpenAI answer)."""
    api = client(server)
    asks = [
        dict(prompt=QUESTIONS[9], extra_body={"trace": True}),
        dict(prompt=QUESTIONS[10], extra_body={"trace": True, "decoder": "psd", "depth": 2}),
    ]
    ask = lambda kw: api.completions.create(model="default", **kw).choices[0]  # noqa: E731
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, asks))
    for kw, choice in zip(asks, got):
        (want,) = lm.generate([kw["prompt"]], defaults.replace(**kw["extra_body"]), prompt_bucket=BUCKET)
        trace = choice.model_extra["trace"]
        n = len(trace["step"])
        assert trace["offset"] == 0 and n % defaults.block_length == 0 and n >= want.tokens
        assert {k: trace[k] for k in ("step", "kind", "first", "rewritten")} == {
            k: v[:n] for k, v in want.trace.items()
        }
        assert "".join(trace["pieces"]).startswith(want.text) and len(trace["first_pieces"]) == n
    assert any(k.startswith("draft-") for k in got[1].model_extra["trace"]["kind"])
    chunks = [
        c.choices[0].model_extra["trace"] for c in api.completions.create(model="default", stream=True, **asks[0])
    ]
    assert [c["offset"] for c in chunks] == [b * defaults.block_length for b in range(len(chunks))]
    assert [v for c in chunks for v in c["step"]] == got[0].model_extra["trace"]["step"]
    plain = api.completions.create(model="default", prompt=QUESTIONS[9]).choices[0]
    assert "trace" not in plain.model_extra and plain.text == got[0].text


def test_stop_strings_cut_the_text(server, lm, defaults):
    (want,) = lm.generate([QUESTIONS[0]], defaults, prompt_bucket=BUCKET)
    stop = want.text[5:8]
    got = client(server).completions.create(model="default", prompt=QUESTIONS[0], stop=[stop])
    assert got.choices[0].text == want.text[: want.text.find(stop)] and got.choices[0].finish_reason == "stop"


def test_concurrent_clients_get_their_own_answers_in_fewer_batches(server):
    """16 clients, different prompts and lengths: every answer equals its single-request one."""
    api = client(server)
    asks = [dict(prompt=q, max_tokens=48 if i % 2 else 32) for i, q in enumerate(QUESTIONS)]
    ask = lambda kw: api.completions.create(model="default", **kw).choices[0]  # noqa: E731
    alone = [ask(kw) for kw in asks]
    batches = health(server)["batches"]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(ask, asks))
    assert [(c.text, c.token_ids) for c in together] == [(c.text, c.token_ids) for c in alone]
    assert len({c.text for c in alone}) > 8, "the prompts should get different answers"
    assert health(server)["batches"] - batches < len(asks)


# ---------------------------------------------------------------------------------- the protocol
def test_the_schema_page_shows_the_protocols_models_and_a_wrong_type_is_our_400(server):
    """``/openapi.json`` documents both routes' bodies and answers with ``protocol``'s models (every
    reference resolves); FastAPI never parses a body, so a wrong type is the server's 400 naming
    the field, never a 422."""
    doc = httpx.get(f"{server}/openapi.json", timeout=TIMEOUT_S).json()
    schemas = doc["components"]["schemas"]
    for path, request, answer in (
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
    ):
        route = doc["paths"][path]["post"]
        assert route["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{request}"
        }
        assert route["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(answer)
        assert route["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert {"prompt", "max_tokens", "stop", "threshold", "trace", "decoder", "chat"} <= set(
        schemas["CompletionRequest"]["properties"]
    )
    assert {"messages", "max_completion_tokens", "threshold", "trace", "settings"} <= set(
        schemas["ChatCompletionRequest"]["properties"]
    )
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    assert {"usage", "choices"} <= set(schemas["CompletionResponse"]["properties"])
    assert {"step", "kind", "pieces"} <= set(schemas["Trace"]["properties"])
    text = json.dumps(doc)
    assert set(re.findall(r'"#/components/schemas/([^"]+)"', text)) <= set(schemas), "a reference without a schema"
    assert not [p for p in doc["paths"].values() for r in p.values() if "422" in r["responses"]]
    for path, body, param in (
        ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("completions", {"prompt": "hi", "seed": True}, "seed"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ):
        reply = httpx.post(f"{server}/v1/{path}", json=body, timeout=TIMEOUT_S)
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, param), reply.text


def events(reply: httpx.Response) -> list[str]:
    """A stream's ``data:`` payloads, ``[DONE]`` left out."""
    data = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return data[:-1]


def test_every_answer_is_the_protocols_response_model(server):
    """What the server writes (whole answers, stream chunks, the usage chunk, a trace, the model
    list, an error) is ``protocol``'s response models to the letter: no field they do not declare."""
    url = f"{server}/v1"
    chat = {"messages": [{"role": "user", "content": QUESTIONS[1]}]}
    asks = [
        ("completions", {"prompt": QUESTIONS[9], "trace": True}, protocol.CompletionResponse),
        ("chat/completions", chat, protocol.ChatCompletionResponse),
    ]
    for path, body, model in asks:
        model.model_validate_json(httpx.post(f"{url}/{path}", json=body, timeout=TIMEOUT_S).content)
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for path, body, model in (
        ("completions", {"prompt": QUESTIONS[9], "trace": True, **usage}, protocol.CompletionChunk),
        ("chat/completions", {**chat, **usage}, protocol.ChatCompletionChunk),
    ):
        chunks = [
            model.model_validate_json(e) for e in events(httpx.post(f"{url}/{path}", json=body, timeout=TIMEOUT_S))
        ]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
        assert all(c.usage is None for c in chunks[:-1]) and chunks[0].choices[0].index == 0
    protocol.ModelList.model_validate_json(httpx.get(f"{url}/models", timeout=TIMEOUT_S).content)
    refused = httpx.post(f"{url}/completions", json={"prompt": 5}, timeout=TIMEOUT_S)
    assert protocol.ErrorResponse.model_validate_json(refused.content).error.param == "prompt"


# ------------------------------------------------------------------------------------- refusals
BAD_REQUESTS = [
    ("completions", b"{not json", "not valid JSON"),
    ("completions", [1, 2], "JSON object"),
    ("completions", {"prompt": 5}, "prompt must be"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens must be a positive integer"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ("completions", {"prompt": "hi", "max_tokens": 100_000}, "max_tokens 100000 exceeds this server's limit of 448"),
    ("completions", {"prompt": list(range(3, 103)), "max_tokens": 448}, "model's context of 512"),
    ("completions", {"prompt": list(range(3, 600))}, "the prompt is too long"),
    ("completions", {"prompt": ""}, "prompt is empty"),
    ("completions", {"prompt": [5000]}, "outside the vocabulary"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature must be a number"),
    ("completions", {"prompt": "hi", "decoder": "greedy"}, "unknown decoder 'greedy'"),
    ("completions", {"prompt": "hi", "policy": "best"}, "unknown policy 'best'"),
    ("completions", {"prompt": "hi", "depth": 5}, "depth=5 would be ignored"),
    ("completions", {"prompt": "hi", "min_p": 0.1}, "unknown field 'min_p'"),
    ("completions", {"prompt": "hi", "top_p": 0.9}, "top_p=0.9 would be ignored: at temperature 0"),
    ("completions", {"prompt": "hi", "n": 2}, "n=2 is not supported"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream must be true or false"),
    ("completions", {"prompt": "hi", "seed": -1}, "seed must be an integer"),
    ("chat/completions", {"messages": []}, "messages must be a non-empty list"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "role must be one of"),
]


def test_bad_requests_get_400_and_the_server_keeps_answering(server):
    for path, body, message in BAD_REQUESTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        reply = httpx.post(f"{server}/v1/{path}", timeout=TIMEOUT_S, **kwargs)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error", (body, error)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(server).completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="unknown decoder"):
        client(server).completions.create(model="default", prompt="hi", extra_body={"decoder": "greedy"})
    assert client(server).completions.create(model="default", prompt=QUESTIONS[0]).choices[0].text


def test_checkpoint_without_tokenizer_refuses_text_and_chat():
    tiny = load_model(GOLDENS / "llada-tiny")
    settings = DecodeConfig(gen_length=16, block_length=16, policy="threshold")
    with running(build_app(tiny, settings, name="tiny", batch_sizes=(1,), prompt_bucket=16)) as url:
        api = client(url)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            api.completions.create(model="tiny", prompt="hi")
        (want,) = tiny.generate([[280, 242, 425]], settings, prompt_bucket=16)
        got = api.completions.create(model="tiny", prompt=[280, 242, 425])
        assert got.choices[0].text == "" and got.choices[0].token_ids == want.output_ids[: want.tokens]


# ------------------------------------------------------------------------------- load and faults
def wait_for(url: str, **want) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while any(health(url)[k] != v for k, v in want.items()):
        assert time.monotonic() < deadline, (health(url), want)
        time.sleep(0.02)


def test_full_queue_is_503(lm, defaults, monkeypatch):
    gate, real = threading.Event(), lm.start_rows

    def gated(*args, **kwargs):  # decodes wait until the test has filled the queue
        gate.wait(TIMEOUT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(lm, "start_rows", gated)
    app = build_app(lm, defaults, name="default", batch_sizes=SIZES, max_queue=1, max_wait_ms=0, prompt_bucket=BUCKET)
    with running(app) as url, ThreadPoolExecutor(2) as pool:
        try:
            api = client(url)
            first = pool.submit(api.completions.create, model="default", prompt=QUESTIONS[0])
            wait_for(url, running=1)
            queued = pool.submit(api.completions.create, model="default", prompt=QUESTIONS[1], max_tokens=32)
            wait_for(url, queued=1)
            with pytest.raises(openai.InternalServerError, match="busy"):
                api.completions.create(model="default", prompt=QUESTIONS[2])
            scraped = metrics(url)
            assert sample(scraped, "psd_jax_requests_total", endpoint="/v1/completions", outcome="busy") == 1
            assert (sample(scraped, "psd_jax_queue_depth"), sample(scraped, "psd_jax_running_rows")) == (1, 1)
        finally:
            gate.set()
        assert first.result().choices[0].text and queued.result().choices[0].text


def test_a_failing_decode_fails_only_its_requests(server, lm, monkeypatch):
    fail, real = [7, 8, 9], lm.start_rows

    def failing(prompts, *args, **kwargs):
        if any(list(p) == fail for p in prompts):
            raise RuntimeError("injected failure")
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(lm, "start_rows", failing)
    api = client(server)
    failed = health(server)["failed_batches"]
    counted = sample(metrics(server), "psd_jax_requests_total", endpoint="/v1/completions", outcome="failed")
    other_batch = list(range(3, 3 + BUCKET + 1))  # the next prompt bucket: another compiled program
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(api.completions.create, model="default", prompt=fail)
        good = pool.submit(api.completions.create, model="default", prompt=other_batch, max_tokens=32)
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            bad.result()
        assert good.result().choices[0].finish_reason in ("stop", "length")  # another batch, answered
    assert health(server)["failed_batches"] == failed + 1
    assert sample(metrics(server), "psd_jax_requests_total", endpoint="/v1/completions", outcome="failed") == (
        counted + 1
    )
    assert api.completions.create(model="default", prompt=QUESTIONS[0]).choices[0].text


def test_client_that_leaves_mid_stream_frees_its_row(server, lm, monkeypatch):
    """The row of a client that disconnects is stopped at the next block boundary."""
    real, calls, left = BlockDecode.advance, [], threading.Event()

    def held_advance(run):  # the first block at once; the second once the server has seen the client leave
        calls.append(run)
        if len(calls) > 1:
            assert left.wait(TIMEOUT_S), "the server did not notice the client leave"
        return real(run)

    monkeypatch.setattr(BlockDecode, "advance", held_advance)
    cancelled = health(server)["cancelled"]
    counted = sample(metrics(server), "psd_jax_requests_total", endpoint="/v1/completions", outcome="cancelled")
    body = {"model": "default", "prompt": QUESTIONS[5], "stream": True, "eos_early_stop": False}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT_S) as reply:
        first = next(line for line in reply.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    deadline = time.monotonic() + TIMEOUT_S
    while sample(metrics(server), "psd_jax_requests_total", endpoint="/v1/completions", outcome="cancelled") == counted:
        assert time.monotonic() < deadline, "the request was not counted cancelled"
        time.sleep(0.02)
    left.set()
    wait_for(server, cancelled=cancelled + 1, running=0)
    assert sample(metrics(server), "psd_jax_requests_total", endpoint="/v1/completions", outcome="cancelled") == (
        counted + 1
    )
    monkeypatch.undo()
    assert client(server).completions.create(model="default", prompt=QUESTIONS[0]).choices[0].text


# ------------------------------------------------------------------------- limits, key, metrics
def test_limits_default_to_what_the_model_and_the_settings_allow(lm, defaults):
    settings = lm.settings(defaults)  # gen 48 in a context of 512
    assert ServerLimits.for_model(lm.config, settings, 32) == ServerLimits(
        max_tokens=512 - 32,
        max_prompt_tokens=512 - 48,
        max_depth=MAX_BRANCHES - 1,
        max_k_max=MAX_BRANCHES - 1,
        max_body_bytes=MAX_BODY_BYTES,
        overrides=ALL_FIELDS,
    )
    assert MAX_BODY_BYTES == 1 << 20
    with pytest.raises(LimitError, match=r"default settings exceed its limits: gen_length 48 exceeds .* of 32"):
        ServerLimits.for_model(lm.config, settings, 32, max_tokens=32)
    with pytest.raises(LimitError, match="unknown DecodeConfig field 'tempreature'"):
        ServerLimits(max_tokens=48, max_prompt_tokens=60, overrides=frozenset({"tempreature"}))


LIMITED = [  # (body, status, param, message): each past one of GUARD's limits
    (
        {"prompt": "hi", "max_tokens": 64},
        400,
        "max_tokens",
        "max_tokens 64 exceeds this server's limit of 48 (--max-tokens)",
    ),
    (
        {"prompt": "hi", "max_tokens": 49},
        400,
        "max_tokens",
        "max_tokens 49 (rounded up to whole blocks: 64 positions) exceeds this server's limit of 48 (--max-tokens)",
    ),
    (
        {"prompt": "hi", "gen_length": 64},
        400,
        "gen_length",
        "gen_length 64 exceeds this server's limit of 48 (--max-tokens)",
    ),
    (
        {"prompt": list(range(3, 64))},
        400,
        "prompt",
        "the prompt is too long: 61 tokens exceed this server's limit of 60 (--max-prompt-tokens)",
    ),
    ({"prompt": "hi", "decoder": "psd"}, 400, "depth", "depth 3 exceeds this server's limit of 2 (--max-depth)"),
    (
        {"prompt": "hi", "decoder": "rps", "k_max": 5},
        400,
        "k_max",
        "k_max 5 exceeds this server's limit of 4 (--max-k-max)",
    ),
    (
        {"prompt": "hi", "threshold": 0.5},
        400,
        "threshold",
        "threshold may not be changed per request on this server (--allow-overrides: decoder, depth, gen_length, "
        "k_max, temperature); leave it out or send the server's value 0.9",
    ),
    (
        {"prompt": "x" * 5000},
        413,
        None,
        "the request body exceeds this server's limit of 4096 bytes (--max-body-bytes)",
    ),
]


def test_requests_past_a_limit_are_refused_before_the_queue(refusing):
    auth_header = {"Authorization": f"Bearer {KEY}"}
    for body, status, param, message in LIMITED:
        reply = refusing.post("/v1/completions", json=body, headers=auth_header)
        code = "override_not_allowed" if param == "threshold" else "limit_exceeded"
        assert reply.status_code == status, (body, reply.text)
        assert reply.json() == {
            "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
        }, body
    chat = [{"role": "user", "content": " ".join(["word"] * 80)}]
    reply = refusing.post("/v1/chat/completions", json={"messages": chat}, headers=auth_header)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    assert "exceed this server's limit of 60 (--max-prompt-tokens)" in reply.json()["error"]["message"]
    state = refusing.get("/health").json()
    assert (state["requests"], state["queued"]) == (0, 0), "a refused request must never be queued"


def test_a_chunked_body_is_read_only_up_to_the_limit(refusing):
    """No Content-Length: the body is cut off once past the limit, not read to its end."""
    reads, replies = [], []

    async def receive() -> dict:  # an endless chunked body, 1 KiB at a time
        reads.append(1024)
        return {"type": "http.request", "body": b" " * 1024, "more_body": True}

    async def send(message: dict) -> None:
        replies.append(message)

    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"transfer-encoding", b"chunked")]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(asyncio.wait_for(refusing.app(scope, receive, send), TIMEOUT_S))
    assert replies[0]["status"] == 413 and json.loads(replies[1]["body"])["error"]["code"] == "limit_exceeded"
    assert sum(reads) == 4096 + 1024, "it reads one chunk past the 4096-byte limit, then stops"


def guarded_request_settings(lm, defaults, body: dict, overrides: frozenset[str]):
    limits = ServerLimits.for_model(lm.config, lm.settings(defaults), BUCKET, overrides=overrides)
    served = ServedModel(lm, "default", lm.settings(defaults), BUCKET, limits)
    return parse_request({"prompt": "hi", **body}, "completion", served)


def test_allow_overrides_none_accepts_the_servers_own_values_and_seed(lm, defaults):
    none = frozenset()
    for body in ({"max_tokens": 40}, {"temperature": 0}, {"policy": "threshold", "threshold": 0.9}, {"seed": 3}):
        assert guarded_request_settings(lm, defaults, body, none).settings == lm.settings(defaults), body
    refused = {"max_tokens": 16, "temperature": 0.5, "cache": "dual", "gen_length": 32}
    for name, value in refused.items():
        with pytest.raises(RequestError) as caught:
            guarded_request_settings(lm, defaults, {name: value}, none)
        assert (caught.value.status, caught.value.param, caught.value.code) == (400, name, "override_not_allowed")
        assert "(--allow-overrides: none)" in caught.value.message
    sampled = guarded_request_settings(lm, defaults, {"temperature": 0.5}, frozenset({"temperature"}))
    assert sampled.settings.temperature == 0.5


def test_the_api_key_guards_v1_and_leaves_health_and_metrics_open(refusing, monkeypatch):
    missing = refusing.get("/v1/models")
    wrong = refusing.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-wrong"})
    basic = refusing.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
    for reply, message in (
        (missing, "You didn't provide an API key: send it in the header Authorization: Bearer KEY"),
        (wrong, "Incorrect API key provided"),
        (basic, "You didn't provide an API key: send it in the header Authorization: Bearer KEY"),
    ):
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        assert reply.json() == {
            "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        }
    big = refusing.post("/v1/completions", json={"prompt": "x" * 5000})
    assert big.status_code == 401, "the key is checked before the body is read"
    compared = []
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or a == b)
    assert refusing.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert compared == [(KEY.encode(), KEY.encode())], "keys are compared in constant time"
    assert refusing.get("/health").status_code == 200
    assert refusing.get("/metrics").status_code == 200
    scraped = parsed_metrics(refusing.get("/metrics").text)
    assert sample(scraped, "psd_jax_requests_total", endpoint="/v1/models", outcome="unauthorized") == 2
    assert sample(scraped, "psd_jax_requests_total", endpoint="/v1/completions", outcome="unauthorized") == 2
    assert sample(scraped, "psd_jax_requests_total", endpoint="/v1/models", outcome="ok") == 1


def test_the_official_client_needs_the_key(guarded):
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key provided"):
        client(guarded, "sk-wrong").completions.create(model="default", prompt=QUESTIONS[0])
    got = client(guarded, KEY).completions.create(model="default", prompt=QUESTIONS[0])
    assert got.choices[0].text and got.usage.completion_tokens > 0


def test_metrics_count_what_the_requests_got(guarded, lm):
    """After N answered requests the counters read N, and the tokens and calls are their usage's sums."""
    api = client(guarded, KEY)
    before, calls = metrics(guarded), health(guarded)["block_calls"]
    api.models.list()
    answers = [api.completions.create(model="default", prompt=q) for q in QUESTIONS[:3]]
    answers.append(api.chat.completions.create(model="default", messages=[{"role": "user", "content": QUESTIONS[4]}]))
    stream = api.completions.create(
        model="default", prompt=QUESTIONS[3], stream=True, stream_options={"include_usage": True}
    )
    usages = [a.usage for a in answers] + [list(stream)[-1].usage]
    with pytest.raises(openai.BadRequestError, match="threshold may not be changed"):
        api.completions.create(model="default", prompt=QUESTIONS[0], extra_body={"threshold": 0.5})
    with pytest.raises(openai.AuthenticationError):
        client(guarded, "sk-wrong").completions.create(model="default", prompt=QUESTIONS[0])
    after = metrics(guarded)

    def grew(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    requests = "psd_jax_requests_total"
    assert grew(requests, endpoint="/v1/completions", outcome="ok") == 4
    assert grew(requests, endpoint="/v1/chat/completions", outcome="ok") == 1
    assert grew(requests, endpoint="/v1/models", outcome="ok") == 1
    assert grew(requests, endpoint="/v1/completions", outcome="bad_request") == 1
    assert grew(requests, endpoint="/v1/completions", outcome="unauthorized") == 1
    assert grew("psd_jax_generated_tokens_total") == sum(u.completion_tokens for u in usages) > 0
    assert grew("psd_jax_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("psd_jax_model_calls_total") == sum(u.model_calls for u in usages) > 0
    assert grew("psd_jax_tokens_per_forward_count") == 5
    assert grew("psd_jax_tokens_per_forward_sum") == pytest.approx(sum(u.tokens_per_forward for u in usages))
    assert grew("psd_jax_request_latency_seconds_count", endpoint="/v1/completions") == 4
    assert grew("psd_jax_request_latency_seconds_count", endpoint="/v1/chat/completions") == 1
    assert grew("psd_jax_time_to_first_chunk_seconds_count", endpoint="/v1/completions") == 1
    decoded = health(guarded)["block_calls"] - calls  # one occupancy sample per block call
    assert decoded >= 5 and grew("psd_jax_batch_occupancy_count") == decoded
    assert grew("psd_jax_batch_occupancy_sum") == decoded * 1.0, "one request alone in a batch of size 1"
    assert grew("psd_jax_batch_occupancy_bucket", le="0.875") == 0
    assert (sample(after, "psd_jax_queue_depth"), sample(after, "psd_jax_running_rows")) == (0, 0)
    assert sample(after, "psd_jax_compiled_programs") == lm.compiled_programs > 0


# ------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-batch", "0"], "expected a positive integer"),
        (["--max-wait-ms", "-1"], "expected a finite number >= 0"),
        (["--depth", "5"], "depth=5 would be ignored"),
        (["--warmup-lengths", "600"], "exceeds the model's context"),
        (["--batch-sizes", "1,4", "--max-batch", "8"], "is not the largest"),
        (["--port", "70000"], "argument --port: expected a port number from 1 to 65535, got 70000"),
        (["--port", "0"], "argument --port: expected a port number from 1 to 65535, got 0"),
        (["--gen-length", "4096", "--block-length", "32"], "gen_length 4096 leaves no room for a prompt"),
        (["--allow-overrides", "temperature,tempreature"], "argument --allow-overrides: unknown DecodeConfig field"),
        (["--max-tokens", "0"], "argument --max-tokens: expected a positive integer, got 0"),
        (["--max-depth", "-1"], "argument --max-depth: expected an integer >= 0, got -1"),
        (["--max-tokens", "32"], "default settings exceed its limits: gen_length 48 exceeds this server's limit of 32"),
        (
            ["--decoder", "psd", "--max-depth", "2"],
            "default settings exceed its limits: depth 3 exceeds this server's limit of 2 (--max-depth)",
        ),
        (["--api-key", " "], "--api-key is empty"),
    ],
)
def test_bad_flags_print_one_line_and_exit_2(argv, message, capsys):
    try:
        code = serve_main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_the_api_key_flag_wins_over_the_environment(monkeypatch, capsys):
    assert api_key_from("flag-key", {"PSD_JAX_API_KEY": "env-key"}) == "flag-key"
    assert api_key_from(None, {"PSD_JAX_API_KEY": "env-key"}) == "env-key"
    assert api_key_from(None, {}) is None
    monkeypatch.setenv("PSD_JAX_API_KEY", "")
    assert serve_main([]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: PSD_JAX_API_KEY is empty: give a key, or leave it unset for a server without one"
    )


# --------------------------------------------------------------- static batching, timeout, drain
def test_static_batching_answers_as_generate(lm, defaults):
    """``--batching static`` (a batch decodes until its last row is done) answers as continuous does."""
    app = build_app(
        lm, defaults, name="default", batching="static", batch_sizes=(4,), max_wait_ms=200, prompt_bucket=BUCKET
    )
    with running(app) as url, ThreadPoolExecutor(4) as pool:
        api = client(url)
        asks = [dict(prompt=q, max_tokens=(32, 48)[i % 2]) for i, q in enumerate(QUESTIONS[:4])]
        got = list(pool.map(lambda kw: api.completions.create(model="default", **kw).choices[0], asks))
        assert health(url)["batching"] == "static" and health(url)["batches"] <= 2
    for kw, choice in zip(asks, got):
        (want,) = lm.generate([kw["prompt"]], defaults.replace(gen_length=kw["max_tokens"]), prompt_bucket=BUCKET)
        assert choice.text == want.text


def test_a_request_past_its_timeout_gets_504_and_frees_its_row(lm, defaults, monkeypatch):
    real = BlockDecode.advance

    def slow_advance(run):  # every block call takes longer than the timeout allows
        time.sleep(0.4)
        return real(run)

    app = build_app(lm, defaults, name="default", batch_sizes=SIZES, prompt_bucket=BUCKET, request_timeout_s=0.3)
    with running(app) as url:
        api = client(url)
        monkeypatch.setattr(BlockDecode, "advance", slow_advance)
        with pytest.raises(openai.APIStatusError, match="did not finish within the server's timeout of 0.3 s") as err:
            api.completions.create(model="default", prompt=QUESTIONS[0])
        assert err.value.status_code == 504
        wait_for(url, timed_out=1, running=0)
        monkeypatch.undo()
        assert sample(metrics(url), "psd_jax_requests_total", endpoint="/v1/completions", outcome="timed_out") == 1


def _health_status(url: str) -> int | None:
    """/health's status code, or None once the server no longer listens (refused, or reset by a
    listener that closed while the request was in flight)."""
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return None


def test_sigterm_drains_and_exits_0(tmp_path):
    """SIGTERM: a running request still gets its answer, a new one is refused, the process exits 0."""
    import signal
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # One token per step over 192 positions (seconds of decoding): a request that runs long enough to
    # be caught by the signal, which is sent as soon as the server reports it running.
    args = ["--port", str(port), "--warmup-lengths", "none", "--drain-seconds", "60", "--log-level", "warning"]
    args += ["--gen-length", "192", "--block-length", "48", "--prompt-bucket", str(BUCKET)]
    proc = subprocess.Popen([sys.executable, "-m", "psd_jax.serve", *args], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        body = {"model": "default", "prompt": QUESTIONS[0], "eos_early_stop": False}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
            wait_for(url, running=1)
            proc.send_signal(signal.SIGTERM)
            # Handled on the server's loop: /health says draining, then the port closes.
            deadline = time.monotonic() + TIMEOUT_S
            while (status := _health_status(url)) == 200:
                assert time.monotonic() < deadline, "the server did not start draining"
                time.sleep(0.02)
            assert status in (503, None), status
            try:
                refused = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                pass  # no longer listening: refused, or accepted as the listener closed and reset
            reply = answer.result(timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["model_calls"] == 192  # decoded to the end
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_thread_server_answers_until_its_block_ends_and_a_failed_start_is_one_error():
    """``serving_in_thread``: the app answers on the yielded URL, the port is closed after the block,
    and an app whose start-up fails raises at once (no wait for the start timeout)."""
    from fastapi import FastAPI

    from psd_jax.serve.server import serving_in_thread

    app = FastAPI()
    app.get("/ping")(lambda: {"pong": True})
    with serving_in_thread(app) as url:
        assert httpx.get(f"{url}/ping", timeout=TIMEOUT_S).json() == {"pong": True}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/ping", timeout=5)

    @contextlib.asynccontextmanager
    async def broken(_app):
        raise RuntimeError("no model")
        yield

    began = time.monotonic()
    with pytest.raises(RuntimeError, match="did not start"), serving_in_thread(FastAPI(lifespan=broken)):
        pass
    assert time.monotonic() - began < 60


# ------------------------------------------------------------------ the recommended setting by name
def test_serve_settings_recommended_sets_the_servers_defaults(monkeypatch, tuned_model_dir, tuned_lm):
    """``--settings recommended``: the directory's recommended.json under the flags given is the
    server's default setting; the same fields are what a request's "settings" asks for."""
    import psd_jax.serve.app
    import psd_jax.serve.cli
    import psd_jax.serve.server

    from conftest import TUNED

    built = []
    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: tuned_lm)
    monkeypatch.setattr(psd_jax.serve.app, "build_app", lambda lm, defaults, **kw: built.append((defaults, kw)))
    monkeypatch.setattr(psd_jax.serve.server, "serve", lambda *a, **k: None)
    base = ["--model", str(tuned_model_dir), "--warmup-lengths", "none"]
    assert serve_main([*base, "--settings", "recommended"]) == 0
    assert serve_main([*base, "--settings", "recommended", "--block-length", "16"]) == 0
    assert serve_main(base) == 0
    tuned = DecodeConfig(gen_length=48, **TUNED)
    assert [defaults for defaults, _ in built] == [tuned, tuned.replace(block_length=16), model_settings(MODEL_DIR, {})]
    assert all(kw["recommended"] == TUNED for _, kw in built)
    # The server built with them answers as generate does with those fields.
    (defaults, _), ids = built[0], [280, 242, 425]
    with running(
        build_app(tuned_lm, defaults, name="t", batch_sizes=(1,), prompt_bucket=BUCKET, recommended=TUNED)
    ) as url:
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": ids}, timeout=TIMEOUT_S).json()
    (want,) = tuned_lm.generate([ids], tuned, prompt_bucket=BUCKET)
    assert reply["choices"][0]["token_ids"] == want.output_ids[: want.tokens]
    assert reply["usage"]["model_calls"] == want.nfe


def test_a_request_may_ask_for_the_recommended_setting_where_overrides_allow(lm, defaults):
    from conftest import TUNED

    limits = ServerLimits.for_model(lm.config, lm.settings(defaults), BUCKET)
    served = ServedModel(lm, "default", lm.settings(defaults), BUCKET, limits, TUNED)
    tuned = parse_request({"prompt": "hi", "settings": "recommended"}, "completion", served).settings
    assert tuned == DecodeConfig(gen_length=48, **TUNED)
    deeper = parse_request({"prompt": "hi", "settings": "recommended", "threshold": 0.8}, "completion", served)
    assert deeper.settings == DecodeConfig(gen_length=48, **{**TUNED, "threshold": 0.8})  # its fields on top
    library = dataclasses.replace(served, recommended=RECOMMENDED)
    got = parse_request({"prompt": "hi", "settings": "recommended"}, "completion", library).settings
    assert got == DecodeConfig(gen_length=48, block_length=16, **RECOMMENDED)
    for body, code, message in (
        ({"settings": "fastest"}, "invalid_settings", "unknown settings 'fastest'; choose one of: recommended"),
        ({"settings": 3}, None, "settings must be a setting's name (recommended), got 3"),
    ):
        with pytest.raises(RequestError) as caught:
            parse_request({"prompt": "hi", **body}, "completion", served)
        assert (caught.value.param, caught.value.code, caught.value.message) == ("settings", code, message)
    strict = dataclasses.replace(served, limits=dataclasses.replace(limits, overrides=frozenset({"threshold"})))
    with pytest.raises(RequestError) as caught:
        parse_request({"prompt": "hi", "settings": "recommended"}, "completion", strict)
    assert caught.value.code == "override_not_allowed" and caught.value.message.startswith(
        "settings recommended changes block_length (16 -> 8), which may not be changed per request"
    )


def test_serve_unknown_settings_name_and_bad_file_are_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as caught:
        serve_main(["--settings", "fastest"])
    assert caught.value.code == 2 and "unknown settings 'fastest'" in capsys.readouterr().err
    from conftest import model_with_recommendation

    bad = model_with_recommendation(tmp_path / "bad", MODEL_DIR, "[]")
    assert serve_main(["--model", str(bad), "--settings", "recommended"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f'error: {bad / "recommended.json"}: expected {{"settings": {{...}}, "provenance": {{...}}}}'
