"""OpenAI-style errors: every refused request is an HTTP status and one message naming the problem.

Clients written for OpenAI's API read ``{"error": {"message", "type", "param", "code"}}``; the
official client raises ``BadRequestError`` (400), ``NotFoundError`` (404), ... with that message.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .json_object import JsonObject

INVALID_REQUEST = "invalid_request_error"


class RequestError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = INVALID_REQUEST,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = INVALID_REQUEST, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object; the message and ``param`` may quote what the client sent (a field
    name with a lone surrogate), so they are made writable as UTF-8 first."""
    param = None if param is None else printable(param)
    detail = ErrorDetail(message=printable(message), type=kind, param=param, code=code)
    return ErrorResponse(error=detail).model_dump()


class ErrorDetail(JsonObject):
    message: str = Field(description="one line naming the problem")
    type: str = Field(description="invalid_request_error or server_error")
    param: str | None = Field(description="the field at fault, by its path (messages[0].role)")
    code: str | None


class ErrorResponse(JsonObject):
    """Every refusal and failure, and a stream's last event when it fails."""

    error: ErrorDetail


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) written as ``\\udXXX`` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Unauthorized(RequestError):
    """No or a wrong ``Authorization: Bearer`` key (``--api-key``): OpenAI's 401, whose type is
    ``invalid_request_error`` with code ``invalid_api_key`` (the official client raises
    ``AuthenticationError``). The message never repeats the key that was sent."""

    def __init__(self, sent: bool):
        message = (
            "Incorrect API key provided"
            if sent
            else "You didn't provide an API key: send it in the header Authorization: Bearer KEY"
        )
        super().__init__(message, code="invalid_api_key", status=401, headers={"WWW-Authenticate": "Bearer"})


class ShuttingDown(RequestError):
    """The server is stopping (SIGTERM): it takes no new requests, and after ``--drain-seconds``
    the ones still running end with this error."""

    def __init__(self):
        super().__init__(
            "the server is shutting down; retry on another server",
            code="server_shutting_down",
            status=503,
            kind="server_error",
        )


class RequestTimedOut(RequestError):
    """The request ran past the server's ``--request-timeout``: its row was stopped at the next
    block boundary."""

    def __init__(self, seconds: float):
        super().__init__(
            f"the request did not finish within the server's timeout of {seconds:g} s (--request-timeout)",
            code="timeout",
            status=504,
            kind="server_error",
        )


class QueueFull(RequestError):
    """More requests are waiting than the server queues (``--max-queue``): try again later."""

    def __init__(self, limit: int):
        super().__init__(
            f"the server is busy: {limit} requests are already waiting; retry later",
            code="server_busy",
            status=503,
            kind="server_error",
        )


class InternalError(RequestError):
    """A bug in the server, not the request's fault: the client learns only that much, the log gets
    the traceback."""

    def __init__(self):
        super().__init__(
            "the server failed to answer this request (an internal error; it is logged)",
            code="internal_error",
            status=500,
            kind="server_error",
        )


class DecodeFailed(RequestError):
    """The decode of this request's batch raised; only that batch's requests get this error."""

    def __init__(self, exc: BaseException):
        super().__init__(
            f"decoding failed: {type(exc).__name__}: {exc}", code="decode_failed", status=500, kind="server_error"
        )
