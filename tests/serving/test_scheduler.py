"""The serving scheduler (``serve.batcher.Batcher``) against a model-free engine: its batching rules
(joins, regroups, static batches, cancellation, a failing decode, the deadline) checked without a
model or a compile, through the interface it drives (``serve.session``).

The fake engine decodes every live row one block per ``advance``; a row's ids are a function of its
prompt and position, so each answer can be checked against the row decoded alone. It records every
call the scheduler makes (start, join, regroup, stop), which is what these tests assert on."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from psd_jax import DecodeConfig
from psd_jax.core.runtime import Program
from psd_jax.serve.batcher import Batcher, Failed, RowUpdate
from psd_jax.serve.errors import RequestTimedOut
from psd_jax.serve.requests import DecodeRequest

SETTINGS = DecodeConfig(gen_length=16, block_length=4, policy="threshold", threshold=0.9)
CALLS_PER_BLOCK = 2


def alone_ids(prompt: tuple[int, ...], gen_length: int) -> list[int]:
    """The ids a row of ``prompt`` decodes, whatever shares its batch."""
    return [(sum(prompt) * 7 + i) % 97 + 3 for i in range(gen_length)]


@dataclasses.dataclass
class Progress:
    generated: np.ndarray
    final_blocks: np.ndarray
    done: np.ndarray
    nfe: np.ndarray
    gen_length: np.ndarray
    trace: None = None  # the model-free engine records no trace


class FakeSession:
    """A ``BlockSession`` without a model: each ``advance`` finishes one block of every live row."""

    def __init__(self, engine: FakeEngine, size: int, canvas: int):
        self.engine, self.size, self.canvas = engine, size, canvas
        self.compiles = 0
        self.rows: list[dict | None] = [None] * size
        self._compile(("start", size))

    def _compile(self, key: tuple) -> None:
        if key not in self.engine.programs:
            self.engine.programs.add(key)
            self.compiles += 1

    @property
    def done(self) -> bool:
        return all(r is None or r["done"] for r in self.rows)

    def write(self, row: int, prompt, settings: DecodeConfig) -> None:
        self.rows[row] = {"prompt": tuple(prompt), "blocks": 0, "done": False, "gen": settings.gen_length, "nfe": 0}

    def advance(self) -> Progress:
        if self.engine.gate is not None:  # the test lets each block call through
            assert self.engine.gate.acquire(timeout=30), "the test let no block call through in 30 s"
        self.engine.calls.append(("advance", self.size, tuple(r is not None and not r["done"] for r in self.rows)))
        if any(r is not None and not r["done"] and r["prompt"] in self.engine.failing for r in self.rows):
            raise RuntimeError("the fake decode failed")
        for r in self.rows:
            if r is not None and not r["done"]:
                r["blocks"] += 1
                r["nfe"] += CALLS_PER_BLOCK
                r["done"] = r["blocks"] * SETTINGS.block_length >= r["gen"]
        generated = np.zeros((self.size, self.canvas), np.int32)
        for i, r in enumerate(self.rows):
            if r is not None:
                generated[i, : r["gen"]] = alone_ids(r["prompt"], r["gen"])
        field = lambda name, default: np.array([default if r is None else r[name] for r in self.rows])  # noqa: E731
        return Progress(generated, field("blocks", 0), field("done", True), field("nfe", 0), field("gen", 0))

    def join(self, rows, prompts, settings, seeds) -> None:
        self.engine.calls.append(("join", self.size, tuple(rows)))
        self._compile(("join", self.size))
        for row, prompt, s in zip(rows, prompts, settings):
            assert self.rows[row] is None or self.rows[row]["done"], f"row {row} is busy"
            self.write(row, prompt, s)

    def regroup(self, index) -> None:
        self.engine.calls.append(("regroup", self.size, len(index)))
        self._compile(("regroup", self.size, len(index)))
        self.rows = [self.rows[i] if i >= 0 else None for i in index]
        self.size = len(index)

    def prepare_regroup(self, size: int) -> None:
        self._compile(("regroup", self.size, size))

    def stop(self, rows) -> None:
        if rows:
            self.engine.calls.append(("stop", self.size, tuple(rows)))
            self._compile(("stop", self.size))
        for row in rows:
            if self.rows[row] is not None:
                self.rows[row]["done"] = True


@dataclasses.dataclass
class FakeConfig:
    max_length: int = 4096
    pad_id: int = 0


class FakeEngine:
    """A ``BlockEngine`` without a model."""

    def __init__(self):
        self.config = FakeConfig()
        self.programs: set = set()
        self.calls: list[tuple] = []
        self.failing: set[tuple[int, ...]] = set()  # prompts whose decode raises
        self.gate: threading.Semaphore | None = None  # when set, each advance takes one permit

    @property
    def compiled_programs(self) -> int:
        return len(self.programs)

    def program_key(self, settings, gen_length):
        return Program.of(settings, gen_length)

    def start_rows(self, prompts, settings, seeds, *, batch_size=None, prompt_bucket=32, gen_length=None):
        size = batch_size or len(prompts)
        self.calls.append(("start", size, len(prompts)))
        session = FakeSession(self, size, gen_length or settings[0].gen_length)
        for row, (prompt, s) in enumerate(zip(prompts, settings)):
            session.write(row, prompt, s)
        return session

    def start_blocks(self, prompts, settings=None, *, prompt_bucket=32, batch_size=None, gen_length=None):
        return self.start_rows(prompts, [settings] * len(prompts), [0] * len(prompts), batch_size=batch_size)


def request(prompt: tuple[int, ...], **changes) -> DecodeRequest:
    return DecodeRequest("completion", prompt, SETTINGS.replace(**changes))


async def answer(ticket) -> tuple[list[int], int] | BaseException:
    """A ticket's final ids and model calls, or its error."""
    while True:
        event = await asyncio.wait_for(ticket.events.get(), 30)
        if isinstance(event, Failed):
            return event.error
        assert isinstance(event, RowUpdate)
        if event.done:
            return event.generated.tolist(), event.nfe


def serve(test, **options):
    """Run ``test(batcher, engine)`` with the batcher's dispatch loop running."""
    engine = FakeEngine()

    async def main():
        batcher = Batcher(
            engine, **{"sizes": (1, 2, 4), "max_wait_s": 0.05, "max_queue": 16, "prompt_bucket": 16, **options}
        )
        runner = asyncio.create_task(batcher.run())
        try:
            return await test(batcher, engine)
        finally:
            runner.cancel()
            batcher.close()

    return asyncio.run(main())


PROMPTS = [(5, 6, 7), (8, 9), (10, 11, 12, 13), (1,), (2, 3)]


def test_requests_join_a_running_batch_which_grows_and_shrinks():
    """Continuous batching: the first request starts a batch of one; two more, sent after its first
    block (one of them shorter: the generation bucket gives both one program), join it at the next
    boundary, the batch regrouped first to the compiled size that holds three; the short one
    finishes early and the batch shrinks to what its rows need. Every answer is its row decoded
    alone. The block calls are let through one at a time until the joins are queued."""

    async def test(batcher, engine):
        engine.gate = threading.Semaphore(1)
        first = batcher.submit(request(PROMPTS[0]))
        await asyncio.wait_for(first.events.get(), 30)  # its first block
        later = [batcher.submit(request(PROMPTS[1], gen_length=4)), batcher.submit(request(PROMPTS[2]))]
        engine.gate.release(100)
        answers = [await answer(t) for t in (first, *later)]
        return answers, engine.calls, batcher.stats()

    answers, calls, stats = serve(test, gen_bucket=16)
    lengths = (16, 4, 16)
    assert answers == [(alone_ids(p, g), CALLS_PER_BLOCK * g // 4) for p, g in zip(PROMPTS, lengths)]
    assert calls[0] == ("start", 1, 1)
    assert ("regroup", 1, 4) in calls  # one row and two joining: the size that holds three
    join = calls.index(("join", 4, (1, 2)))
    assert calls.index(("regroup", 1, 4)) < join
    assert ("regroup", 4, 2) in calls[join:]  # the short row done: two rows left, size 2
    assert (stats["batches"], stats["rows"], stats["requests"], stats["cancelled"]) == (1, 3, 3, 0)


def test_static_batches_wait_for_their_rows_and_then_for_the_last_row():
    """Static batching: requests arriving within max_wait share one batch padded to a compiled size,
    which decodes until its last row is done; a request after it opens a new batch."""

    async def test(batcher, engine):
        tickets = [batcher.submit(request(p)) for p in PROMPTS[:3]]
        answers = [await answer(t) for t in tickets]
        answers.append(await answer(batcher.submit(request(PROMPTS[3]))))
        return answers, engine.calls, batcher.stats()

    answers, calls, stats = serve(test, batching="static", max_wait_s=0.2)
    assert answers == [(alone_ids(p, 16), CALLS_PER_BLOCK * 4) for p in PROMPTS[:4]]
    assert [c for c in calls if c[0] == "start"] == [("start", 4, 3), ("start", 1, 1)]
    assert not any(c[0] in ("join", "regroup") for c in calls)
    assert stats["batches"] == 2 and stats["block_calls"] == 8


def second_row_let_go(let_go):
    """Two rows decoding; after its first block the second row's request is let go (``let_go(ticket)``)
    and the rest decodes: (the first row's answer, the engine's calls, the batcher's stats)."""

    async def test(batcher, engine):
        engine.gate = threading.Semaphore(1)
        tickets = [batcher.submit(request(p)) for p in PROMPTS[:2]]
        await asyncio.wait_for(tickets[1].events.get(), 30)
        let_go(tickets[1])
        engine.gate.release(100)
        kept = await answer(tickets[0])
        return kept, engine.calls, batcher.stats()

    return serve(test)


def test_a_cancelled_request_frees_its_row_at_the_next_boundary():
    """A client gone mid-decode: its row is stopped before the next block call and counted once; the
    other row decodes on as alone, and a later request takes the freed row."""
    kept, calls, stats = second_row_let_go(lambda ticket: ticket.cancel())
    assert kept == (alone_ids(PROMPTS[0], 16), CALLS_PER_BLOCK * 4)
    stops = [c for c in calls if c[0] == "stop"]
    assert stops and stops[0][2] == (1,)
    after = calls[calls.index(stops[0]) + 1]
    assert after[0] in ("advance", "regroup") and (after[0] == "regroup" or after[2][1] is False)
    assert stats["cancelled"] == 1


def test_a_request_answered_early_frees_its_row_and_is_not_counted_as_cancelled():
    """A stop string ends an answer before its row is done: the row is stopped at the next boundary
    as a cancelled one is, but the request was answered, so ``/health`` counts no cancellation."""
    kept, calls, stats = second_row_let_go(lambda ticket: ticket.answer_early())
    assert kept == (alone_ids(PROMPTS[0], 16), CALLS_PER_BLOCK * 4)
    stops = [c for c in calls if c[0] == "stop"]
    assert stops and stops[0][2] == (1,)
    assert stats["cancelled"] == 0


def test_a_failing_decode_fails_its_own_batch_only():
    """A decode that raises fails its batch's requests with the error; the server decodes the next
    request as usual and counts one failed batch."""

    async def test(batcher, engine):
        engine.failing.add(PROMPTS[4])
        failed = await answer(batcher.submit(request(PROMPTS[4])))
        ok = await answer(batcher.submit(request(PROMPTS[0], threshold=0.5)))
        return failed, ok, batcher.stats()

    failed, ok, stats = serve(test)
    assert isinstance(failed, RuntimeError) and "fake decode failed" in str(failed)
    assert ok == (alone_ids(PROMPTS[0], 16), CALLS_PER_BLOCK * 4)
    assert stats["failed_batches"] == 1


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_request_past_its_deadline_gets_its_error_and_is_counted_once(batching):
    """The deadline's error reaches the client, its row is stopped, and it is counted as timed out,
    not cancelled. No block call is let through before the error arrives."""

    async def test(batcher, engine):
        engine.gate = threading.Semaphore(0)
        late = await answer(batcher.submit(request(PROMPTS[0])))
        engine.gate.release(100)
        return late, batcher.stats()

    late, stats = serve(test, batching=batching, request_timeout_s=0.0)
    assert isinstance(late, RequestTimedOut)
    assert (stats["timed_out"], stats["cancelled"]) == (1, 0)
