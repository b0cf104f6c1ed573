"""The FastAPI application: OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
and ``/health``.

Requests are parsed and checked (``requests``) before they queue, so a bad one is a 400 and never
touches a batch; the batcher decodes; ``answers`` turns a request's block updates into pieces and
``responses`` into OpenAI's bodies or server-sent events. A client that disconnects has its row
stopped at the next block boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..api import LoadedModel
from ..config import DecodeConfig
from .answers import pieces
from .batcher import Batcher, Ticket, default_batch_sizes
from .errors import RequestError, error_body
from .requests import ServedModel, parse_request
from .responses import DONE, ResponseWriter

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.1


def create_app(served: ServedModel, batcher: Batcher, warmup_lengths: Sequence[int] = ()) -> FastAPI:
    """The server for ``served`` (the default settings are compiled for ``warmup_lengths`` at start-up)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        if warmup_lengths:
            await loop.run_in_executor(None, batcher.warm_up, served.defaults, warmup_lengths)
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.close()

    app = FastAPI(title="psd-jax", lifespan=lifespan)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(HTTPException, _http_error)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, **batcher.stats()}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "psd-jax"}
        return {"object": "list", "data": [{**card, "max_model_len": served.lm.config.max_length}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(request, "completion", served, batcher)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(request, "chat", served, batcher)

    return app


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)


async def _answer(request: Request, endpoint: str, served: ServedModel, batcher: Batcher):
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    decode_request = parse_request(body, endpoint, served)
    ticket = batcher.submit(decode_request)
    writer = ResponseWriter(endpoint, served.name)
    if decode_request.stream:
        return StreamingResponse(_stream(request, ticket, writer, served), media_type="text/event-stream")
    answer = asyncio.create_task(_whole(ticket, writer, served))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        ticket.cancel()  # no-op once answered; frees the row when the client left first
    if not answer.done():
        answer.cancel()
        return JSONResponse(error_body("the client disconnected", code="client_closed"), status_code=499)
    return answer.result()


async def _whole(ticket: Ticket, writer: ResponseWriter, served: ServedModel) -> dict:
    texts, ids = [], []
    async for piece in pieces(ticket, served.lm):
        texts.append(piece.text)
        ids += piece.token_ids
    return writer.body("".join(texts), ids, piece)


async def _stream(request: Request, ticket: Ticket, writer: ResponseWriter, served: ServedModel) -> AsyncIterator[str]:
    """Server-sent events, one per block; a failed decode ends the stream with an error event.
    A client that leaves frees its row at once (not only when the next block fails to send)."""
    include_usage = ticket.request.include_usage
    gone = asyncio.create_task(_disconnected(request))
    gone.add_done_callback(lambda _: ticket.cancel())
    try:
        async for piece in pieces(ticket, served.lm):
            yield writer.chunk(piece, include_usage)
        if include_usage:
            yield writer.usage_chunk(piece.usage)
        yield DONE
    except RequestError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    finally:  # the client left (the response is cancelled) or the answer is complete
        gone.cancel()
        ticket.cancel()


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
) -> FastAPI:
    """The server of ``lm`` with default settings ``defaults`` (``python -m psd_jax.serve``'s flags);
    batches are padded to ``batch_sizes`` (default: powers of two up to ``max_batch``)."""
    served = ServedModel(lm, name, lm.settings(defaults), prompt_bucket)
    sizes = tuple(sorted(set(batch_sizes))) if batch_sizes else default_batch_sizes(max_batch)
    batcher = Batcher(lm, sizes=sizes, max_wait_s=max_wait_ms / 1000, max_queue=max_queue, prompt_bucket=prompt_bucket)
    return create_app(served, batcher, warmup_lengths)
