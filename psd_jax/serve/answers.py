"""A request's answer as pieces, one per decoded block: text, token ids, and at the end the finish
reason and usage. Streaming sends each piece as a chunk; a plain response joins them, so both
give the same text by construction."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from ..api import LoadedModel
from ..core.records import row_trace
from ..core.trace import FIELDS as TRACE_FIELDS
from .batcher import Failed, Ticket
from .errors import DecodeFailed, RequestError
from .text import TextStream


@dataclasses.dataclass(frozen=True)
class Piece:
    """One block's part of an answer; the last piece has ``finish_reason`` and ``usage``."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    trace: dict[str, Any] | None = None  # the block's positions' trace (the ``trace`` setting): ``block_trace``


TRACE_LISTS = (*TRACE_FIELDS, "pieces", "first_pieces")


def block_trace(
    trace: dict[str, np.ndarray], ids: np.ndarray, start: int, end: int, block: int, lm: LoadedModel
) -> dict[str, Any]:
    """Generated positions ``start`` .. ``end`` of a row's trace (``records.row_trace``'s fields),
    with ``offset``: ``start``, ``block_length``: ``block``, and for a client to draw them,
    ``pieces``: each position's text as it reads in the generated ``ids``, ``first_pieces``: the
    text of the token first written there."""
    fields = row_trace(*(trace[name][start:end] for name in TRACE_FIELDS))
    out = {"offset": start, "block_length": block, **fields}
    decode = lm.piece_decoder()
    out["pieces"] = lm.token_pieces(ids.tolist(), start, end)
    out["first_pieces"] = [p if f == t else decode([f]) for p, f, t in zip(out["pieces"], out["first"], ids[start:end])]
    return out


def joined_trace(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive blocks' traces as one from the first's offset."""
    out: dict[str, Any] = {"offset": traces[0]["offset"], "block_length": traces[0]["block_length"]}
    for name in TRACE_LISTS:
        out[name] = [v for t in traces for v in t[name]]
    return out


def usage(prompt_tokens: int, tokens: int, model_calls: int) -> dict[str, Any]:
    """OpenAI's usage, plus the diffusion decoder's cost: model calls and tokens per forward."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tokens,
        "total_tokens": prompt_tokens + tokens,
        "model_calls": model_calls,
        "tokens_per_forward": tokens / max(model_calls, 1),
    }


def first_stop(ids: np.ndarray, stop_ids: tuple[int, ...]) -> int:
    """Generated tokens before the first EOS/EOT (``Generation.tokens``' rule)."""
    stops = np.flatnonzero(np.isin(ids, stop_ids))
    return int(stops[0]) if stops.size else len(ids)


async def pieces(ticket: Ticket, lm: LoadedModel) -> AsyncIterator[Piece]:
    """The answer's pieces as the worker reports blocks; stops the row at a stop string."""
    request, block = ticket.request, ticket.request.settings.block_length
    text, sent = TextStream(lm.decode_text, request.stop), 0
    while True:
        event = await ticket.events.get()
        if isinstance(event, Failed):
            raise event.error if isinstance(event.error, RequestError) else DecodeFailed(event.error)
        for b in range(sent, event.final_blocks):
            final_ids = event.generated[: (b + 1) * block]
            last = event.done and b == event.final_blocks - 1
            delta = text.update(final_ids.tolist(), last)
            tokens = first_stop(final_ids, lm.config.stop_ids)
            ids = final_ids[b * block : max(tokens, b * block)].tolist()
            trace = (
                None
                if event.trace is None
                else block_trace(event.trace, final_ids, b * block, len(final_ids), block, lm)
            )
            if not (last or text.stopped):
                yield Piece(delta, ids, trace=trace)
                continue
            ticket.answer_early()  # a stop string ends the answer before its row: free the row
            reason = "stop" if text.stopped or tokens < len(final_ids) else "length"
            yield Piece(delta, ids, reason, usage(len(request.prompt_ids), tokens, event.nfe), trace)
            return
        sent = event.final_blocks
