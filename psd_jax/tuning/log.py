"""The tuner's resumable log: one JSON line per evaluated (setting, batch of problems).

A line holds the setting's fields, the problem indices and, per problem, whether the answer was
right, its model calls and tokens, with the batch's warm decode seconds and its model calls by shape
(``calls.call_records``: what prices the batch on another device without decoding again). Each
problem is charged an equal share of its batch's seconds and calls. A line belongs to a run when
its context matches: the model path, the data file's SHA-256 and what else changes outcomes
(dtype, quantization, chat template, prompt bucket). A restarted run reads the matching lines
back, keyed by the setting's canonical JSON and the problem index, and decodes only what is
missing; a half-written last line (an interrupted run) is skipped.

On several processes (``psd_jax.parallel.multihost``) every process runs the same search: each
decode is a collective ``generate`` on the global mesh, and what a process reads or measures by
itself is process 0's on every process (``multihost.from_main``): the log read back, and each
batch's seconds, so every process ranks, halves and confirms alike. Only process 0 writes the log.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.config import DecodeConfig
from ..parallel import multihost
from .search import NotEvaluated, Outcome
from .space import canonical


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def decode_batch(lm, settings: DecodeConfig, examples: list[dict], chat: bool | None, bucket: int) -> tuple:
    """One warm decode of ``examples`` (``generate(warm=True)``): per problem whether it was right,
    its calls and tokens; the decode's seconds (compilation apart), its compile seconds and its
    calls by shape. On several processes every process makes the same decode (the answers come
    back to each) and takes process 0's seconds, which rank the candidates."""
    from ..scoring import is_correct

    texts = [ex["question"] for ex in examples]
    results = lm.generate(texts, settings, chat=chat, prompt_bucket=bucket, warm=True)
    first = results[0]
    correct = [int(is_correct(r.text or "", ex)) for r, ex in zip(results, examples)]
    timing = multihost.from_main(struct.pack("<dd", first.seconds, first.compile_seconds))
    seconds, compile_seconds = struct.unpack("<dd", timing)
    return (
        correct,
        [r.nfe for r in results],
        [r.tokens for r in results],
        seconds,
        compile_seconds,
        first.calls,
    )


def outcomes_of(
    correct: list[int], nfe: list[int], tokens: list[int], seconds: float, calls: list[dict], batch: int = 0
) -> list:
    """The ``Outcome`` of each problem of one batch (``batch``: its id): its own answer, calls and
    tokens, an equal share of the batch's seconds, and the batch's calls by shape."""
    rows, shared = len(correct), tuple(calls)
    return [
        Outcome(int(c), int(n), int(t), seconds / rows, shared, rows, batch) for c, n, t in zip(correct, nfe, tokens)
    ]


class LoggedEvaluator:
    """``search.Evaluator`` over a model loaded on first need, appending every decode to ``path``.

    ``load`` returns the model (called at most once, only when something is missing, so a finished
    run's report is rebuilt without loading weights); ``phase`` is written into each line
    ("search" or "confirm") so the log shows which split a problem was decoded for. On several
    processes only process 0 reads and writes ``path``; the others read back what it read."""

    def __init__(
        self,
        path: Path,
        context: dict[str, Any],
        examples: list[dict],
        load: Callable[[], Any],
        batch: int,
        chat: bool | None,
        bucket: int,
        progress=None,
        decode: bool = True,
    ):
        self.path, self.context, self.examples, self.decode = path, context, examples, decode
        self.load, self.lm = load, None
        self.batch, self.chat, self.bucket, self.progress = batch, chat, bucket, progress
        self.phase = "search"
        self.known: dict[tuple[str, int], Outcome] = {}
        self.decoded = 0  # problems decoded by this process (not read back)
        self.torn = False
        self.batches = 0  # batch ids handed out: one per log line read or written
        self.writes = multihost.is_main()
        self.read_back = self._read()

    def _read(self) -> int:
        own = self.path.read_bytes() if self.writes and self.path.is_file() else b""
        text = multihost.from_main(own).decode()
        if not text:
            return 0
        self.torn = not text.endswith("\n")  # an interrupted run's half line
        count = 0
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                if entry["context"] != self.context:
                    continue
                key = canonical(DecodeConfig(**entry["settings"]))
                outcomes = outcomes_of(
                    entry["correct"],
                    entry["nfe"],
                    entry["tokens"],
                    entry["seconds"],
                    entry.get("calls", []),
                    self.batches,
                )
                self.batches += 1
                for i, outcome in zip(entry["problems"], outcomes):
                    self.known[(key, int(i))] = outcome
                count += 1
            except (ValueError, KeyError, TypeError):
                continue  # an interrupted write, or a line of another version
        return count

    def missing(self, settings: DecodeConfig, ids: list[int]) -> list[int]:
        key = canonical(settings)
        return [i for i in ids if (key, i) not in self.known]

    def plan(self, settings: list[DecodeConfig], ids: list[int]) -> None:
        if self.progress is not None:
            self.progress.total = (self.progress.total or 0) + sum(len(self.missing(s, ids)) for s in settings)
            self.progress.refresh()

    def results(self, name: str, settings: DecodeConfig, ids: list[int]) -> dict[int, Outcome]:
        todo = self.missing(settings, ids)
        key = canonical(settings)
        if todo and not self.decode:
            raise NotEvaluated(f"{name}: {len(todo)} of {len(ids)} problems are not in {self.path}")
        for start in range(0, len(todo), self.batch):
            chunk = todo[start : start + self.batch]
            if self.lm is None:
                self.lm = self.load()
            if self.progress is not None:
                self.progress.set_postfix_str(f"{self.phase}: {name}")
            correct, nfe, tokens, seconds, compile_seconds, calls = decode_batch(
                self.lm, settings, [self.examples[i] for i in chunk], self.chat, self.bucket
            )
            outcomes = outcomes_of(correct, nfe, tokens, seconds, calls, self.batches)
            self.batches += 1
            self._append(name, settings, chunk, outcomes, seconds, compile_seconds, calls)
            for i, outcome in zip(chunk, outcomes):
                self.known[(key, i)] = outcome
            self.decoded += len(chunk)
            if self.progress is not None:
                self.progress.update(len(chunk))
        return {i: self.known[(key, i)] for i in ids}

    def _append(self, name, settings, chunk, outcomes, seconds, compile_seconds, calls) -> None:
        if not self.writes:
            return
        entry = {
            "name": name,
            "phase": self.phase,
            "settings": dataclass_fields(settings),
            "problems": chunk,
            "correct": [o.correct for o in outcomes],
            "nfe": [o.nfe for o in outcomes],
            "tokens": [o.tokens for o in outcomes],
            "seconds": seconds,
            "compile_seconds": compile_seconds,
            "calls": calls,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "context": self.context,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            if self.torn:
                f.write("\n")  # end the half-written line, so the next one parses
                self.torn = False
            f.write(json.dumps(entry) + "\n")
            f.flush()


def dataclass_fields(settings: DecodeConfig) -> dict[str, Any]:
    return json.loads(canonical(settings))


def progress_bar(disable: bool = False):
    from tqdm import tqdm

    return tqdm(total=0, desc="tune", unit="decode", file=sys.stderr, disable=disable)
