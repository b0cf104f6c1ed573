"""The FastAPI application: OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health`` and Prometheus' ``/metrics``.

Requests are authenticated (``--api-key``: every ``/v1/*`` route), read within the body limit,
parsed and checked (``requests``, through ``protocol``'s models and with the server's ``limits``;
the schema page shows those models) before they queue, so a bad one
is a 4xx and never touches a batch; the batcher decodes; ``answers`` turns a request's block
updates into pieces and ``responses`` into OpenAI's bodies or server-sent events. A client that
disconnects has its row stopped at the next block boundary. Every ``/v1/*`` request is counted once
in ``metrics`` by its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..api import LoadedModel
from ..core.config import DecodeConfig
from ..recommended import NAME, named_settings
from . import protocol
from .answers import joined_trace, pieces
from .auth import check_bearer
from .batcher import Batcher, Ticket, default_batch_sizes
from .body import read_json
from .errors import InternalError, RequestError, error_body
from .limits import ServerLimits
from .metrics import CONTENT_TYPE, Outcome, ServerMetrics
from .requests import ServedModel, parse_request
from .responses import DONE, ResponseWriter, event

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.1
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer
UNROUTED = "other"  # the metrics' endpoint of a /v1/ request no route takes (a label per path would be unbounded)


def create_app(
    served: ServedModel,
    batcher: Batcher,
    warmup_lengths: Sequence[int] = (),
    api_key: str | None = None,
    playground: bool = True,
) -> FastAPI:
    """The server for ``served`` (the default settings are compiled for ``warmup_lengths`` at
    start-up); with ``api_key``, ``/v1/*`` answers only requests that send it as a bearer token;
    ``playground``: the browser playground at ``/`` (``add_playground``)."""
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

    # With a key, the schema and its interactive pages are not served: a browser page cannot send
    # the bearer key, and a guarded server should not publish its surface to whoever asks.
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if api_key is not None else {}
    app = FastAPI(title="psd-jax", lifespan=lifespan, **docs)
    app.openapi = lambda: _schema(app)
    app.state.metrics, app.state.batcher = metrics, batcher
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(v1_routes(served, batcher, counted_by(metrics, api_key)))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the server takes requests; 503 once it is draining (SIGTERM) or can no longer
        decode (a serving process lost), so a load balancer stops sending before requests get 503s."""
        status = "failed" if batcher.failure is not None else "draining" if batcher.draining else "ok"
        body = {"status": status, "model": served.name, **batcher.stats()}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if playground:
        add_playground(app, served, api_key is not None)
    return app


PLAYGROUND = Path(__file__).parent / "playground"  # static files shipped in the package, no build step
PLAYGROUND_FILES = {"playground.js": "text/javascript", "playground.css": "text/css"}


def add_playground(app: FastAPI, served: ServedModel, key_required: bool) -> None:
    """The browser playground at ``/`` (docs/trace.md): a page that asks this server's
    ``/v1/chat/completions`` with the trace and animates it. The page and its files load without
    the key; with ``--api-key`` the page asks the user for it and sends it on every API call."""

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(PLAYGROUND / "index.html", media_type="text/html")

    shown = ("decoder", "policy", "threshold", "cache", "block_length", "gen_length")
    # What the page shows of the server's defaults and, if it offers it, of the recommended setting.
    defaults = {name: getattr(served.defaults, name) for name in shown}
    recommended = None
    if served.recommended is not None:
        recommended = {name: getattr(served.base(NAME), name) for name in shown}

    @app.get("/playground/config", include_in_schema=False)
    async def config() -> JSONResponse:
        body = {"model": served.name, "key_required": key_required, "defaults": defaults, "recommended": recommended}
        return JSONResponse(body)

    @app.get("/playground/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in PLAYGROUND_FILES:
            raise HTTPException(404, f"no playground file {name!r}")
        return FileResponse(PLAYGROUND / name, media_type=PLAYGROUND_FILES[name])


Answer = Callable[[Outcome], Awaitable[Response]]


def counted_by(metrics: ServerMetrics, api_key: str | None) -> Callable[[Request, Answer], Awaitable[Response]]:
    """How every ``/v1/*`` route answers: ``counted(request, answer)``."""

    async def counted(request: Request, answer: Answer) -> Response:
        """A ``/v1/*`` route's ``answer``, with the key checked first (before the body is read) and
        the request counted once by its outcome whatever happens: a refusal is its OpenAI error, a
        client gone mid-body is ``client_closed``, and a bug is a logged 500 that fails only this
        request."""
        record = Outcome(metrics, request.scope["route"].path)
        try:
            if api_key is not None:
                check_bearer(request.headers.get("authorization"), api_key)
            return await answer(record)
        except RequestError as exc:
            record.refused(exc.status)
            return _error_response(exc)
        except ClientDisconnect:
            record.client_closed()
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            record.failed()
            return _error_response(InternalError())
        except asyncio.CancelledError:  # the server cancelled the handler (a shutdown's deadline)
            record.cancelled()
            raise

    return counted


def v1_routes(served: ServedModel, batcher: Batcher, counted) -> APIRouter:
    """The OpenAI routes, each answered through ``counted`` (``counted_by``)."""
    v1 = APIRouter(prefix="/v1")

    card = protocol.ModelCard(
        id=served.name, object="model", created=0, owned_by="psd-jax", max_model_len=served.lm.config.max_length
    )
    listing = protocol.ModelList(object="list", data=[card]).model_dump()

    @v1.get("/models", responses=protocol.responses(None))
    async def models(request: Request) -> Response:
        """The served model (one)."""

        async def listed(record: Outcome) -> Response:
            record.answered()
            return JSONResponse(listing)

        return await counted(request, listed)

    # The bodies are read by ``_answer`` (within the body limit, after the key) and checked by
    # ``parse_request``: FastAPI only shows them on the schema page, so its 422 never answers.
    @v1.post(
        "/completions", openapi_extra=protocol.request_body("completion"), responses=protocol.responses("completion")
    )
    async def completions(request: Request) -> Response:
        """A completion of one prompt (text or token ids), whole or streamed one block per event."""
        return await counted(request, lambda record: _answer(request, "completion", served, batcher, record))

    @v1.post("/chat/completions", openapi_extra=protocol.request_body("chat"), responses=protocol.responses("chat"))
    async def chat_completions(request: Request) -> Response:
        """The assistant's answer to a conversation, through the checkpoint's chat template."""
        return await counted(request, lambda record: _answer(request, "chat", served, batcher, record))

    return v1


def _schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, with the protocol's models (``protocol``) that the routes' bodies and
    answers refer to."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        document.setdefault("components", {}).setdefault("schemas", {}).update(protocol.schema_components())
        app.openapi_schema = document
    return app.openapi_schema


def _error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, 404; a method the route does not take, 405); under
    ``/v1/`` they are counted too, under one endpoint label whatever the path."""
    if request.url.path.startswith("/v1/"):
        Outcome(request.app.state.metrics, UNROUTED).refused(exc.status_code)
    return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)


async def _answer(request: Request, endpoint: str, served: ServedModel, batcher: Batcher, record: Outcome) -> Response:
    body = await read_json(request, served.limits.max_body_bytes)
    decode_request = parse_request(body, endpoint, served)
    ticket = batcher.submit(decode_request)
    writer = ResponseWriter(endpoint, served.name)
    if decode_request.stream:
        return _Events(_stream(request, ticket, writer, served, record), ticket, record)
    answer = asyncio.create_task(_whole(ticket, writer, served))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        ticket.cancel()  # no-op once answered; frees the row when the client left first
        left = not answer.done()
        if left:
            answer.cancel()
    if left:
        record.cancelled()
        return JSONResponse(error_body("the client disconnected", code="client_closed"), status_code=CLIENT_CLOSED)
    response, usage = answer.result()  # a RequestError (timeout, failed decode) is counted by ``counted``
    record.answered(usage)
    return JSONResponse(response)


async def _whole(ticket: Ticket, writer: ResponseWriter, served: ServedModel) -> tuple[dict, dict[str, Any]]:
    texts, ids, traces = [], [], []
    async for piece in pieces(ticket, served.lm):
        texts.append(piece.text)
        ids += piece.token_ids
        traces += [piece.trace] if piece.trace is not None else []
    return writer.body("".join(texts), ids, piece, joined_trace(traces) if traces else None), piece.usage


class _Events(StreamingResponse):
    """A stream of server-sent events whose end, however it comes (the last event, the client
    leaving, the response cancelled before its first event), frees the row and counts the request."""

    def __init__(self, events: AsyncIterator[str], ticket: Ticket, record: Outcome):
        super().__init__(events, media_type="text/event-stream")
        self.ticket, self.record = ticket, record

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # an ASGI 2.4 server reports a failed send so
            pass
        finally:
            self.ticket.cancel()
            self.record.cancelled()  # a no-op once answered or failed


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
        # Counted before the last events are handed to the server, as a whole answer is before its
        # body: a client that has read [DONE] finds itself counted, and one that closes at once
        # after it (before this generator resumes) is not counted as cancelled.
        record.answered(piece.usage)
        if include_usage:
            yield writer.usage_chunk(piece.usage)
        yield DONE
    except RequestError as exc:
        record.refused(exc.status)
        yield event(exc.body())
    except Exception:  # a bug: the response has started, so the client gets it as an error event
        log.exception("%s %s failed mid-stream", request.method, request.url.path)
        record.failed()
        yield event(InternalError().body())
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
    playground: bool = True,
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
    return create_app(served, batcher, warmup_lengths, api_key, playground)
