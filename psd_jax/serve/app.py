"""The FastAPI application: OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health`` and Prometheus' ``/metrics``.

Requests are authenticated (``--api-key``: every ``/v1/*`` route), read within the body limit,
parsed and checked (``requests``, with the server's ``limits``) before they queue, so a bad one
is a 4xx and never touches a batch; the batcher decodes; ``answers`` turns a request's block
updates into pieces and ``responses`` into OpenAI's bodies or server-sent events. A client that
disconnects has its row stopped at the next block boundary. Every ``/v1/*`` request is counted once
in ``metrics`` by its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..api import LoadedModel
from ..config import DecodeConfig
from ..recommended import NAME, named_settings
from .answers import pieces
from .auth import check_bearer
from .batcher import Batcher, Ticket, default_batch_sizes
from .errors import RequestError, error_body
from .limits import ServerLimits
from .metrics import CONTENT_TYPE, Outcome, ServerMetrics
from .requests import ServedModel, parse_request, read_json
from .responses import DONE, ResponseWriter

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.1


def create_app(
    served: ServedModel, batcher: Batcher, warmup_lengths: Sequence[int] = (), api_key: str | None = None
) -> FastAPI:
    """The server for ``served`` (the default settings are compiled for ``warmup_lengths`` at
    start-up); with ``api_key``, ``/v1/*`` answers only requests that send it as a bearer token."""
    metrics = ServerMetrics(batcher, served.lm)
    batcher.on_batch = metrics.batch

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        batcher.loop = loop  # where a signal handler schedules the drain (cli.DrainingServer)
        if warmup_lengths:
            await loop.run_in_executor(None, batcher.warm_up, served.defaults, warmup_lengths)
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.close()

    app = FastAPI(title="psd-jax", lifespan=lifespan)
    app.state.metrics, app.state.batcher = metrics, batcher
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(HTTPException, _http_error)

    def outcome(request: Request) -> Outcome:
        """The request's metrics record (by route); refused here without the key, before its body is read."""
        record = Outcome(metrics, request.scope["route"].path)
        if api_key is not None:
            try:
                check_bearer(request.headers.get("authorization"), api_key)
            except RequestError as exc:
                record.refused(exc.status)
                raise
        return record

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models(request: Request) -> dict:
        record = outcome(request)
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "psd-jax"}
        record.answered()
        return {"object": "list", "data": [{**card, "max_model_len": served.lm.config.max_length}]}

    @v1.post("/completions")
    async def completions(request: Request):
        return await _answer(request, "completion", served, batcher, outcome(request))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(request, "chat", served, batcher, outcome(request))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, **batcher.stats()}

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)


async def _answer(request: Request, endpoint: str, served: ServedModel, batcher: Batcher, record: Outcome):
    try:
        body = await read_json(request, served.limits.max_body_bytes)
        decode_request = parse_request(body, endpoint, served)
        ticket = batcher.submit(decode_request)
    except RequestError as exc:
        record.refused(exc.status)
        raise
    writer = ResponseWriter(endpoint, served.name)
    if decode_request.stream:
        return StreamingResponse(_stream(request, ticket, writer, served, record), media_type="text/event-stream")
    answer = asyncio.create_task(_whole(ticket, writer, served))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        ticket.cancel()  # no-op once answered; frees the row when the client left first
    if not answer.done():
        answer.cancel()
        record.cancelled()
        return JSONResponse(error_body("the client disconnected", code="client_closed"), status_code=499)
    try:
        response, usage = answer.result()
    except RequestError as exc:
        record.refused(exc.status)
        raise
    record.answered(usage)
    return response


async def _whole(ticket: Ticket, writer: ResponseWriter, served: ServedModel) -> tuple[dict, dict[str, Any]]:
    texts, ids = [], []
    async for piece in pieces(ticket, served.lm):
        texts.append(piece.text)
        ids += piece.token_ids
    return writer.body("".join(texts), ids, piece), piece.usage


async def _stream(
    request: Request, ticket: Ticket, writer: ResponseWriter, served: ServedModel, record: Outcome
) -> AsyncIterator[str]:
    """Server-sent events, one per block; a failed decode ends the stream with an error event.
    A client that leaves frees its row at once (not only when the next block fails to send)."""
    include_usage = ticket.request.include_usage
    gone = asyncio.create_task(_disconnected(request))
    gone.add_done_callback(lambda _: ticket.cancel())
    gone.add_done_callback(lambda task: task.cancelled() or record.cancelled())
    try:
        async for piece in pieces(ticket, served.lm):
            record.chunk()
            yield writer.chunk(piece, include_usage)
        if include_usage:
            yield writer.usage_chunk(piece.usage)
        yield DONE
        record.answered(piece.usage)
    except RequestError as exc:
        record.refused(exc.status)
        yield f"data: {json.dumps(exc.body())}\n\n"
    finally:  # the client left (the response is cancelled) or the answer is complete
        gone.cancel()
        ticket.cancel()
        record.cancelled()  # a no-op once answered or failed


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def build_app(
    lm: LoadedModel,
    defaults: DecodeConfig,
    *,
    name: str,
    max_batch: int = 8,
    batch_sizes: Sequence[int] | None = None,
    max_wait_ms: float = 10.0,
    max_queue: int = 256,
    prompt_bucket: int = 32,
    warmup_lengths: Sequence[int] = (),
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    batching: str = "continuous",
    gen_bucket: int | None = None,
    max_programs: int | None = None,
    request_timeout_s: float | None = None,
    recommended: dict[str, Any] | None = None,
) -> FastAPI:
    """The server of ``lm`` with default settings ``defaults`` (``python -m psd_jax.serve``'s flags);
    batches are padded to ``batch_sizes`` (default: powers of two up to ``max_batch``); ``limits``
    (default: ``ServerLimits.for_model``'s derived ones) bound each request; ``api_key`` guards ``/v1/*``;
    ``recommended`` is what a request's ``"settings": "recommended"`` asks for (default: read from
    the model's directory, ``recommended.named_settings``)."""
    settings = lm.settings(defaults)
    limits = limits if limits is not None else ServerLimits.for_model(lm.config, settings, prompt_bucket)
    problem = limits.exceeded(settings)
    if problem:
        raise ValueError(f"the server's default settings exceed its limits: {problem[1]}")
    if recommended is None:
        recommended = named_settings(NAME, getattr(lm, "path", None))
    served = ServedModel(lm, name, settings, prompt_bucket, limits, recommended)
    sizes = tuple(sorted(set(batch_sizes))) if batch_sizes else default_batch_sizes(max_batch)
    lm.max_programs = max_programs
    batcher = Batcher(
        lm,
        sizes=sizes,
        max_wait_s=max_wait_ms / 1000,
        max_queue=max_queue,
        prompt_bucket=prompt_bucket,
        batching=batching,
        gen_bucket=gen_bucket if gen_bucket is not None else settings.gen_length,
        request_timeout_s=request_timeout_s,
    )
    return create_app(served, batcher, warmup_lengths, api_key)
