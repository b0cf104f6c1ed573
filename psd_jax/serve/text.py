"""Text of an answer that grows a block at a time, cut at ``stop`` strings.

Each update decodes the whole final prefix again and sends what is new, so the concatenated
pieces are the text of the whole answer (a multi-byte character split across a block boundary
decodes as U+FFFD until its last byte arrives; it is held back until then). A tail that could be
the start of a stop string is held back too, until the next block shows whether it is one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """The pieces of one answer's text; ``stopped`` once a stop string was found."""

    def __init__(self, decode_text: Callable[[Sequence[int]], str | None], stop: Sequence[str] = ()):
        self._decode, self._stop = decode_text, tuple(stop)
        self.sent = ""
        self.stopped = False

    def update(self, final_ids: Sequence[int], last: bool) -> str:
        """The new text once ``final_ids`` (the answer's final ids so far) are known; ``last``: no
        more ids will come, so nothing is held back."""
        text = self._decode(final_ids) or ""
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            text, last, self.stopped = text[:cut], True, True
        if not last:
            text = text[: len(text) - self._held_back(text)]
        if not text.startswith(self.sent):  # a later block changed earlier text: send nothing more of it
            return ""
        piece = text[len(self.sent) :]
        self.sent += piece
        return piece

    def _held_back(self, text: str) -> int:
        """Characters at the end that may still change: an incomplete character, a stop string's start."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held
