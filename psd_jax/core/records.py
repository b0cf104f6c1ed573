"""Framework-independent result records, shared by the JAX engine and the PyTorch backend.

``DecodeOutput`` is what a decode returns (JAX arrays from the compiled loop, torch tensors from
the eager one: a NamedTuple is a JAX pytree, so the jitted loop returns it as is);
``generations`` turns it into one ``Generation`` per prompt, the same way for both backends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


class DecodeOutput(NamedTuple):
    canvas: Any  # [B, P + gen_length]
    row_nfe: Any  # [B] model calls while the row was decoding
    nfe: Any  # () model calls
    sequence_forwards: Any  # () sequences the model processed
    iterations: Any  # () loop iterations
    stats: dict  # per-row decoder statistics (``Decoder.stat_shapes``)
    calls: Any = None  # [S] model calls by shape (``calls.call_shapes``; the JAX engine's)
    trace: Any = None  # ``core.trace.Trace`` of the canvas [B, N] each, when the decode recorded one


@dataclasses.dataclass
class Generation:
    """One prompt's result. ``tokens`` counts generated tokens before the first EOS/EOT."""

    output_ids: list[int]  # the gen_length generated ids
    text: str | None
    nfe: int  # model calls while this row was decoding
    sequence_forwards: int  # sequences the model processed for the whole batch
    tokens: int
    tpf: float  # tokens per forward = tokens / nfe
    seconds: float  # wall time of the batch's decode (compilation excluded)
    compile_seconds: float
    stats: dict[str, Any]
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the batch's, by shape (calls.py)
    iterations: int = 0  # the batch's loop iterations
    # When and how each generated position was written (``generate(..., trace=True)``; ``row_trace``).
    trace: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["trace"] is None:  # a decode without a trace prints what it always printed
            del out["trace"]
        return out


def row_trace(step, kind, first, rewritten) -> dict[str, Any]:
    """One row's trace over its generated positions (``core.trace``): ``step`` the row's model calls
    when each was written (0: never, e.g. after an end-of-sequence stop), ``kind`` how (``policy``,
    ``draft-<d>``, ``pivot``, ``edit``, ``none``), ``first`` the token first written and
    ``rewritten`` the step of its last rewrite (0: none; the editing decoder's)."""
    from .trace import kind_name

    return {
        "step": [int(v) for v in step],
        "kind": [kind_name(int(v)) for v in kind],
        "first": [int(v) for v in first],
        "rewritten": [int(v) for v in rewritten],
    }


def tokens_before_stop(ids: np.ndarray, stop_ids: tuple[int, ...]) -> np.ndarray:
    """Per row of generated ids [B, G], how many come before its first stop id (G if none)."""
    stop = np.isin(ids, stop_ids)
    return np.where(stop.any(1), stop.argmax(1), ids.shape[1])


def generations(
    out: DecodeOutput,
    prompt_length: int,
    stop_ids: tuple[int, ...],
    decode_text: Callable,
    seconds: float,
    compile_seconds: float,
    to_numpy: Callable = np.asarray,
    calls: list[dict[str, Any]] | None = None,
) -> list[Generation]:
    """One ``Generation`` per row of ``out``; ``to_numpy`` reads the backend's arrays; ``calls``:
    the batch's model calls by shape (``calls.call_records``), given to every row."""
    canvas = to_numpy(out.canvas)[:, prompt_length:]
    width = prompt_length + canvas.shape[1]
    trace = None
    if out.trace is not None:
        from .trace import FIELDS

        trace = [to_numpy(getattr(out.trace, name))[:, prompt_length:width] for name in FIELDS]
    row_nfe = to_numpy(out.row_nfe)
    stats = {k: to_numpy(v) for k, v in out.stats.items()}
    tokens = tokens_before_stop(canvas, stop_ids)
    return [
        Generation(
            output_ids=canvas[row].tolist(),
            text=decode_text(canvas[row].tolist()),
            nfe=int(row_nfe[row]),
            sequence_forwards=int(out.sequence_forwards),
            tokens=int(tokens[row]),
            tpf=float(tokens[row]) / max(int(row_nfe[row]), 1),
            seconds=seconds,
            compile_seconds=compile_seconds,
            stats={k: v[row].tolist() for k, v in stats.items()},
            calls=list(calls or []),
            iterations=int(to_numpy(out.iterations)),
            trace=None if trace is None else row_trace(*(a[row] for a in trace)),
        )
        for row in range(canvas.shape[0])
    ]
