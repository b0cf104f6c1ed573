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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        )
        for row in range(canvas.shape[0])
    ]
