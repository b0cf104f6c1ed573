"""OpenAI response bodies and stream chunks for completions and chat completions, built as the
protocol's models (``protocol.CompletionResponse``, ...), so what is sent is what ``/docs`` shows."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from . import protocol
from .answers import Piece

OBJECTS = {  # endpoint -> (id prefix, response model, chunk model)
    "completion": ("cmpl", protocol.CompletionResponse, protocol.CompletionChunk),
    "chat": ("chatcmpl", protocol.ChatCompletionResponse, protocol.ChatCompletionChunk),
}


class ResponseWriter:
    """Bodies of one request's response: one id and creation time for all its chunks."""

    def __init__(self, endpoint: str, model: str):
        prefix, self.response, self.chunk_model = OBJECTS[endpoint]
        self.endpoint, self.model = endpoint, model
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._chunks = 0

    def _dump(self, model: type[protocol.JsonObject], choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """``model`` with this response's envelope; fields left unset (a choice's trace when not
        asked for, a chunk's usage without ``include_usage``) are left out of the JSON."""
        envelope = {"id": self.id, "created": self.created, "model": self.model}
        obj = model.model_validate({**envelope, "object": _object(model), "choices": choices, **extra})
        return obj.model_dump(exclude_unset=True)

    @staticmethod
    def _choice(piece: Piece, token_ids: list[int], trace: dict[str, Any] | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": piece.finish_reason, "logprobs": None}
        choice["token_ids"] = token_ids
        if trace is not None:
            choice["trace"] = trace
        return choice

    def body(self, text: str, token_ids: list[int], last: Piece, trace: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole answer (``stream: false``); ``trace``: the answer's blocks' (the ``trace`` setting)."""
        choice = self._choice(last, token_ids, trace)
        if self.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._dump(self.response, [choice], usage=last.usage)

    def chunk(self, piece: Piece, with_usage: bool) -> str:
        """One server-sent event: a block's text (the role too on a chat answer's first chunk)."""
        choice = self._choice(piece, piece.token_ids, piece.trace)
        if self.endpoint == "chat":
            first = {"role": "assistant"} if not self._chunks else {}
            choice["delta"] = {**first, "content": piece.text}
        else:
            choice["text"] = piece.text
        self._chunks += 1
        extra = {"usage": None} if with_usage else {}
        return event(self._dump(self.chunk_model, [choice], **extra))

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        """The last event of a stream with ``include_usage``: no choices, the usage."""
        return event(self._dump(self.chunk_model, [], usage=usage))


def _object(model: type[protocol.JsonObject]) -> str:
    """The ``object`` value a response model allows (its one ``Literal``)."""
    return model.model_fields["object"].annotation.__args__[0]  # type: ignore[union-attr]


def event(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = event("[DONE]")
