"""``python -m psd_jax.generate --show``: a decode replayed as it happened, from its trace.

The decode itself runs as always, in one compiled loop (``generate(..., trace=True)`` records, per
generated position, the model call whose prediction wrote it and how: ``core.trace``); the replay
is drawn afterwards, one frame per model call of the row: masks as ``░``, the positions this call
wrote highlighted by how they were written (the policy's commit, a PSD draft accepted at depth d,
an RPS pivot, an edit), the step counter and the decode's tokens/s. In a terminal the frames are
drawn in place with ``rich``; otherwise (a pipe, a log) each frame is one plain line.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TextIO

from ..core.records import Generation
from ..prompts import text_pieces

MASK_GLYPH = "░"
STOP_GLYPH = "·"  # a written end-of-sequence id
# rich styles of this frame's writes, by kind (``core.trace.kind_name``; drafts share one style)
STYLES = {
    "policy": "bold black on green",
    "draft": "bold black on cyan",
    "pivot": "bold black on magenta",
    "settled": "bold black on green",
}
EDIT_STYLE = "bold black on yellow"
REPLAY_SECONDS = 4.0  # a replay in a terminal lasts about this long ...
MAX_FRAME_SECONDS = 0.25  # ... with at most this long per frame


@dataclasses.dataclass(frozen=True)
class Frame:
    """The canvas after the row's model call ``step`` (0: before any): each generated position's
    text (``MASK_GLYPH`` while unwritten), which positions this call wrote or rewrote, and how
    many of each kind."""

    step: int
    pieces: list[str]
    written: list[str | None]  # the kind written at this step ("edit" for a rewrite), else None
    commits: dict[str, int]


def frames(r: Generation, decode: Callable[[list[int]], str], stop_ids: Sequence[int]) -> list[Frame]:
    """The replay of one row: frames 0 .. ``r.nfe`` from its trace (``generate(..., trace=True)``)."""
    if r.trace is None:
        raise ValueError("this generation has no trace: decode it with trace=True")
    trace, ids = r.trace, r.output_ids
    final = text_pieces(decode, ids)
    first = [decode([t]) for t in trace["first"]]
    stop = set(stop_ids)
    out = []
    for t in range(r.nfe + 1):
        pieces, written, commits = [], [], Counter()
        for i, step in enumerate(trace["step"]):
            rewritten = trace["rewritten"][i]
            if step == 0 or step > t:
                pieces.append("" if t == r.nfe and step == 0 else MASK_GLYPH)
                written.append(None)
                continue
            token = ids[i] if not rewritten or rewritten <= t else trace["first"][i]
            text = final[i] if token == ids[i] else first[i]
            pieces.append(STOP_GLYPH if token in stop else text)
            kind = "edit" if rewritten == t else (_first_kind(trace["kind"][i]) if step == t else None)
            written.append(kind)
            if kind is not None:
                commits[kind] += 1
        out.append(Frame(t, pieces, written, dict(commits)))
    return out


def _first_kind(kind: str) -> str:
    """How a position was first written (a rewritten one's ``kind`` says ``edit``: its first write
    was the fill rule's)."""
    return "policy" if kind == "edit" else kind


def header(frame: Frame, r: Generation, row: int, rows: int) -> str:
    """``row 1/2 · step 3/12 · +4 (policy 3, draft-1 1) · 812.5 tokens/s``."""
    made = ", ".join(f"{k} {n}" for k, n in sorted(frame.commits.items()))
    written = sum(frame.commits.values())
    tps = r.tokens / r.seconds if r.seconds > 0 else float("inf")
    where = f"row {row + 1}/{rows} · " if rows > 1 else ""
    return f"{where}step {frame.step}/{r.nfe} · +{written}" + (f" ({made})" if made else "") + f" · {tps:.1f} tokens/s"


def plain_line(frame: Frame) -> str:
    """The frame's canvas as one line (newlines shown as ``⏎``)."""
    return "".join(frame.pieces).replace("\n", "⏎")


def show(
    results: Sequence[Generation],
    decode: Callable[[list[int]], str],
    stop_ids: Sequence[int],
    out: TextIO | None = None,
    terminal: bool | None = None,
) -> None:
    """Replay each row's decode, one row after the other: in place with ``rich`` when ``out`` is a
    terminal (``terminal`` overrides the check), else every frame as a header line and a canvas line."""
    out = sys.stdout if out is None else out
    terminal = out.isatty() if terminal is None else terminal
    for row, r in enumerate(results):
        replay = frames(r, decode, stop_ids)
        if not terminal:
            for frame in replay:
                print(header(frame, r, row, len(results)), file=out)
                print(plain_line(frame), file=out)
            continue
        _live(replay, r, row, len(results), out)


def _live(replay: list[Frame], r: Generation, row: int, rows: int, out: TextIO) -> None:
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console(file=out, force_terminal=True)
    pause = min(MAX_FRAME_SECONDS, REPLAY_SECONDS / max(len(replay), 1))

    def render(frame: Frame) -> Group:
        canvas = Text()
        for piece, kind in zip(frame.pieces, frame.written):
            if kind is None:
                canvas.append(piece, style="dim" if piece == MASK_GLYPH else "")
            else:
                style = EDIT_STYLE if kind == "edit" else STYLES["draft" if kind.startswith("draft") else kind]
                canvas.append(piece, style=style)
        return Group(Text(header(frame, r, row, rows), style="bold"), canvas)

    with Live(render(replay[0]), console=console, auto_refresh=False) as live:
        for frame in replay:
            live.update(render(frame), refresh=True)
            time.sleep(pause)
    console.print()
