"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .answers import Piece

OBJECTS = {  # endpoint -> (id prefix, response object, chunk object)
    "completion": ("cmpl", "text_completion", "text_completion"),
    "chat": ("chatcmpl", "chat.completion", "chat.completion.chunk"),
}


class ResponseWriter:
    """Bodies of one request's response: one id and creation time for all its chunks."""

    def __init__(self, endpoint: str, model: str):
        prefix, self.object, self.chunk_object = OBJECTS[endpoint]
        self.endpoint, self.model = endpoint, model
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._chunks = 0

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def body(self, text: str, token_ids: list[int], last: Piece, trace: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole answer (``stream: false``); ``trace``: the answer's blocks' (the ``trace`` setting)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if self.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["token_ids"] = token_ids
        if trace is not None:
            choice["trace"] = trace
        return self._envelope(self.object, [choice], usage=last.usage)

    def chunk(self, piece: Piece, with_usage: bool) -> str:
        """One server-sent event: a block's text (the role too on a chat answer's first chunk)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": piece.finish_reason, "logprobs": None}
        if self.endpoint == "chat":
            choice["delta"] = (
                {"role": "assistant", "content": piece.text} if not self._chunks else {"content": piece.text}
            )
        else:
            choice["text"] = piece.text
        choice["token_ids"] = piece.token_ids
        if piece.trace is not None:
            choice["trace"] = piece.trace
        self._chunks += 1
        extra = {"usage": None} if with_usage else {}
        return event(self._envelope(self.chunk_object, [choice], **extra))

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        """The last event of a stream with ``include_usage``: no choices, the usage."""
        return event(self._envelope(self.chunk_object, [], usage=usage))


def event(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = event("[DONE]")
