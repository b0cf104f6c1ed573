"""Batching: requests that share a compiled program decode together, in one worker thread.

A request's batch key is its compiled program (the model's ``program_key``: for the mask-token
families ``runtime.Program``, the settings that set shapes; for DiffusionGemma its sampler
settings; with the generation length rounded up to the server's generation bucket) and its padded
prompt length. Runtime values (threshold, temperature, RPS's thresholds, ...), seeds and each
row's own generation length are per row, so requests that differ only in them share a batch.

``continuous`` (the default): a running batch decodes block by block (``BlockDecode.advance``: one
compiled call and one host round trip per block). Between two calls the scheduler retires rows
that finished, were cancelled or timed out, writes queued requests of the batch's key into free
rows (``BlockDecode.join``: each decodes from there exactly as a ``generate`` of its own), and
moves the batch to another compiled size when its rows outgrow it or fit a smaller one
(``BlockDecode.regroup``). A row never waits for a batch to finish, and a batch never waits for
its slowest row. Several running batches (different keys) take turns, one block call each.

``static``: the oldest request opens a batch; requests with its key that arrive within
``max_wait`` join it, up to the largest size; the batch is padded to the next compiled size and
decodes until its last row is done (the behaviour before continuous batching, for comparison).

In both, a request whose client left is stopped at the next block boundary; a request past its
deadline (``request_timeout_s``) gets its error at the deadline itself (a timer on the event loop,
so a long block call cannot hold it back) and its row is stopped at the next boundary; a decode
that raises fails only its own batch's requests. Greedy rows decode exactly as alone; a sampled
row draws from its own seed's key, so with a seed it gets ``generate([prompt], seed=seed)``'s
answer too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..core.config import DecodeConfig
from ..core.lengths import padded_length
from ..core.trace import FIELDS as TRACE_FIELDS
from .errors import QueueFull, RequestError, RequestTimedOut, ShuttingDown
from .requests import DecodeRequest
from .session import BlockEngine, BlockSession, SessionRows

log = logging.getLogger(__name__)
BATCHING = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """One request's row after a block call: its generated ids, final blocks, done, model calls, and
    with the ``trace`` setting its trace so far (``core.trace`` fields, one array each)."""

    generated: np.ndarray
    final_blocks: int
    done: bool
    nfe: int
    trace: dict[str, np.ndarray] | None = None


@dataclasses.dataclass(frozen=True)
class Failed:
    error: BaseException


class Ticket:
    """A queued or running request: the worker thread puts its updates on ``events``."""

    def __init__(self, request: DecodeRequest, key: tuple, loop: asyncio.AbstractEventLoop):
        self.request, self.key, self._loop = request, key, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrived = time.monotonic()
        self.cancelled = False
        self.timed_out = False  # set before ``cancelled``, so the worker never counts it as cancelled too
        self.answered_early = False  # a stop string ended the answer: its row is freed, not counted as cancelled
        self.finished = False  # its last update is sent (set by the worker thread)
        self.timer: asyncio.TimerHandle | None = None  # its deadline (``request_timeout_s``)
        self.seed = request.seed if request.seed is not None else random.randrange(2**32) if request.sampled else 0

    def cancel(self) -> None:
        """The answer is no longer wanted (client gone, stop string, deadline): free the row. On the
        event loop."""
        self.cancelled = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def answer_early(self) -> None:
        """The answer is complete before its row is (a stop string): free the row without counting
        the request as cancelled. On the event loop."""
        self.answered_early = True
        self.cancel()

    def put(self, event: RowUpdate | Failed) -> None:
        """Called from the worker thread."""
        self._loop.call_soon_threadsafe(self.events.put_nowait, event)


def default_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The compiled batch sizes: powers of two below ``max_batch``, and ``max_batch``."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return (*sizes, max_batch)


@dataclasses.dataclass
class Running:
    """A batch in flight: its decode with the request each row holds (``session.SessionRows``, the
    owner of row order; None before the batch starts) and the requests admitted to it."""

    key: tuple
    run: SessionRows | None = None
    joining: list[Ticket] = dataclasses.field(default_factory=list)  # admitted, written in next turn

    @property
    def tickets(self) -> list[Ticket]:
        """The requests its rows hold, in row order."""
        return [] if self.run is None else [self.run.holders[row] for row in self.run.held()]

    @property
    def live(self) -> int:
        return len(self.tickets) + len(self.joining)


class Batcher:
    """The queue, the batching rule and the worker thread; ``run`` is the dispatch loop. It drives
    the model through ``session.BlockEngine`` / ``BlockSession`` only."""

    def __init__(
        self,
        lm: BlockEngine,
        *,
        sizes: Sequence[int],
        max_wait_s: float,
        max_queue: int,
        prompt_bucket: int,
        batching: str = "continuous",
        gen_bucket: int | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        if batching not in BATCHING:
            raise ValueError(f"unknown batching {batching!r}; choose one of {', '.join(BATCHING)}")
        self.lm, self.sizes, self.max_batch = lm, tuple(sorted(sizes)), max(sizes)
        self.max_wait_s, self.max_queue, self.prompt_bucket = max_wait_s, max_queue, prompt_bucket
        self.batching, self.gen_bucket, self.request_timeout_s = batching, gen_bucket, request_timeout_s
        self._pending: list[Ticket] = []
        self._running: list[Running] = []
        self._arrival = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psd-decode")
        self.counts = {
            "requests": 0,
            "batches": 0,
            "rows": 0,
            "compiles": 0,
            "cancelled": 0,
            "timed_out": 0,
            "failed_batches": 0,
            "block_calls": 0,
            "block_rows": 0,  # rows decoding, summed over block calls: / block_calls = mean batch
        }
        self._lock = threading.Lock()  # counts change on the event loop and in the worker thread
        self.running = 0
        self.draining = False
        self.failure: RequestError | None = None  # set when the server can no longer decode: every request gets it
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's event loop (set at start-up)
        self.on_batch: Callable[[int, int], None] | None = None  # (rows, compiled size) per block call, for /metrics

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def stats(self) -> dict[str, int]:
        return {
            **self.counts,
            "queued": len(self._pending),
            "running": self.running,
            "compiled_programs": self.lm.compiled_programs,
            "batching": self.batching,
        }

    # ---------------------------------------------------------------------------- admission
    def submit(self, request: DecodeRequest) -> Ticket:
        """Queue a checked request (``QueueFull`` when ``max_queue`` are already waiting)."""
        if self.failure is not None:
            raise self.failure
        if self.draining:
            raise ShuttingDown()
        if len(self._pending) >= self.max_queue:
            raise QueueFull(self.max_queue)
        loop = asyncio.get_running_loop()
        ticket = Ticket(request, self.batch_key(request), loop)
        if self.request_timeout_s is not None:
            ticket.timer = loop.call_later(self.request_timeout_s, self._time_out, ticket)
        self._pending.append(ticket)
        self.count("requests")
        self._arrival.set()
        return ticket

    def _time_out(self, ticket: Ticket) -> None:
        """The request's deadline: its client gets the 504 now, even while a block call runs (a
        check between calls could be late by a whole call); its row is freed at the next boundary."""
        ticket.timer = None
        if ticket.cancelled or ticket.finished:
            return
        ticket.timed_out = True
        ticket.cancel()
        self.count("timed_out")
        ticket.put(Failed(RequestTimedOut(self.request_timeout_s)))

    def canvas_length(self, settings: DecodeConfig, prompt_length: int) -> int:
        """The canvas's generation length for a request: its own rounded up to the generation
        bucket (and a whole number of its blocks), if that still fits the context."""
        whole = settings.num_blocks * settings.block_length  # decoder "edit" may end inside its last block
        if not self.gen_bucket:
            return whole
        step = math.lcm(self.gen_bucket, settings.block_length)
        canvas = -(-settings.gen_length // step) * step
        return canvas if prompt_length + canvas <= self.lm.config.max_length else whole

    def batch_key(self, request: DecodeRequest) -> tuple:
        """Requests with equal keys run in one compiled program and may share a batch."""
        length = padded_length(len(request.prompt_ids), self.prompt_bucket)
        canvas = self.canvas_length(request.settings, length)
        return self.lm.program_key(request.settings, canvas), length

    def size_for(self, rows: int) -> int:
        return next((size for size in self.sizes if size >= rows), self.max_batch)

    # ------------------------------------------------------------------------------- dispatch
    async def run(self) -> None:
        """Form batches and decode them, for as long as the server runs."""
        loop = asyncio.get_running_loop()
        turn = 0
        while True:
            self._drop_cancelled()
            if self.batching == "static":
                batch = await self._next_static_batch()
                self._running = [batch]  # where a drain finds its requests
            else:
                await self._work()
                self._admit()
                turn %= max(len(self._running), 1)
                batch = self._running[turn]
                turn += 1
            self.running = batch.live if self.batching == "static" else sum(r.live for r in self._running)
            try:
                await loop.run_in_executor(self._executor, self.decode, batch)
            finally:
                self._running = [r for r in self._running if r.live]
                self.running = sum(r.live for r in self._running)

    async def _work(self) -> None:
        """Wait until some batch runs or a request waits."""
        while not self._running and not self._pending:
            self._arrival.clear()
            await self._arrival.wait()
            self._drop_cancelled()

    def _admit(self) -> None:
        """Queued requests into the running batches of their key (a new batch for a key that has
        none), as many as the largest compiled size holds."""
        for ticket in list(self._pending):
            batch = next((r for r in self._running if r.key == ticket.key), None)
            if batch is None:
                batch = Running(ticket.key)
                self._running.append(batch)
            if batch.live < self.max_batch:
                batch.joining.append(ticket)
                self._pending.remove(ticket)

    async def _next_static_batch(self) -> Running:
        while True:
            self._drop_cancelled()
            if not self._pending:
                self._arrival.clear()
                await self._arrival.wait()
                continue
            first = self._pending[0]
            same = [t for t in self._pending if t.key == first.key][: self.max_batch]
            wait = first.arrived + self.max_wait_s - time.monotonic()
            if len(same) == self.max_batch or wait <= 0:
                self._pending = [t for t in self._pending if t not in same]
                return Running(first.key, joining=same)
            self._arrival.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrival.wait(), wait)

    def _drop_cancelled(self) -> None:
        self._pending = self._wanted(self._pending)

    def _wanted(self, tickets: list[Ticket]) -> list[Ticket]:
        """``tickets`` less the cancelled ones, which are counted."""
        self._count_cancelled([t for t in tickets if t.cancelled])
        return [t for t in tickets if not t.cancelled]

    def _count_cancelled(self, tickets: list[Ticket]) -> None:
        """Cancelled requests leaving the queue or a row; one that timed out was counted at its deadline,
        and one that a stop string answered early was answered."""
        cancelled = sum(not (t.timed_out or t.answered_early) for t in tickets)
        if cancelled:
            self.count("cancelled", cancelled)

    # ---------------------------------------------------------------------------- worker side
    def decode(self, batch: Running) -> None:
        """One turn of a batch (worker thread): static, the whole batch; continuous, its joins,
        one block call and what the rows got. A decode that raises fails the batch's requests."""
        try:
            if self.batching == "static":
                self._start(batch)
                # until its rows are done, or all stopped (a stopped row is done only after a call)
                while batch.run is not None and not batch.run.done and batch.run.held():
                    self._block(batch)
            else:
                self._join(batch)
                self._block(batch)
        except Exception as exc:  # a failing decode fails its own requests, never the server
            log.exception("decode of a batch of %d requests failed", batch.live)
            self.count("failed_batches")
            for ticket in batch.tickets + batch.joining:
                ticket.put(Failed(exc))
            if batch.run is not None:
                for row in batch.run.held():
                    batch.run.free(row)
            batch.joining = []

    def _start(self, batch: Running) -> None:
        """A new decode of the batch's joining requests, at the smallest size that holds them: all
        of them start together (their first forward is one call)."""
        tickets = batch.joining = self._wanted(batch.joining)
        if not tickets:
            return
        size = self.size_for(len(tickets))
        run = self.lm.start_rows(
            [t.request.prompt_ids for t in tickets],
            [t.request.settings for t in tickets],
            [t.seed for t in tickets],
            batch_size=size,
            prompt_bucket=self.prompt_bucket,
            gen_length=batch.key[0].gen_length,
        )
        self.count("compiles", run.compiles)
        batch.run, batch.joining = SessionRows(run, tickets), []
        self.count("batches")
        self.count("rows", len(tickets))

    def _join(self, batch: Running) -> None:
        """Admitted requests into the batch's free rows, the batch regrouped to the size its rows
        need first (continuous batching)."""
        if batch.run is None:
            self._start(batch)
            return
        self._retire(batch)
        batch.joining = self._wanted(batch.joining)
        need = self.size_for(batch.live)
        if need != batch.run.size:
            self._regroup(batch, need)
        self._write(batch, batch.joining)
        batch.joining = []

    def _write(self, batch: Running, tickets: Sequence[Ticket]) -> None:
        """``tickets`` into the batch's free rows (the session picks them)."""
        if not tickets:
            return
        self._counted(
            batch.run,
            "join",
            tickets,
            [t.request.prompt_ids for t in tickets],
            [t.request.settings for t in tickets],
            [t.seed for t in tickets],
        )
        self.count("rows", len(tickets))

    def _regroup(self, batch: Running, size: int) -> None:
        """Move the batch's live rows to a decode of ``size`` rows (first rows first)."""
        self._counted(batch.run, "regroup", size)

    def _retire(self, batch: Running) -> None:
        """Stop rows whose request was cancelled (client gone, stop string, deadline); free them."""
        gone = [row for row in batch.run.held() if batch.run.holders[row].cancelled]
        self._count_cancelled([batch.run.holders[row] for row in gone])
        self._counted(batch.run, "stop", gone)

    def _counted(self, session: BlockSession, method: str, *args: Any) -> Any:
        """``session.method(*args)``, the programs it compiled counted (any call may compile: a
        size, prompt bucket or settings the warm-up did not cover)."""
        before = session.compiles
        try:
            return getattr(session, method)(*args)
        finally:
            self.count("compiles", session.compiles - before)

    def _block(self, batch: Running) -> None:
        """One block call and every row's progress to its request."""
        if self.batching == "static":
            self._retire(batch)
        if batch.run is None or not batch.run.held():
            return
        rows = len(batch.run.held())
        if self.on_batch is not None:
            self.on_batch(rows, batch.run.size)
        progress = self._counted(batch.run, "advance")
        self.count("block_calls")
        self.count("block_rows", rows)
        for row in batch.run.held():
            ticket = batch.run.holders[row]
            final, done = int(progress.final_blocks[row]), bool(progress.done[row])
            if final == batch.run.sent[row] and not done:
                continue
            end = progress.gen_length[row]
            generated = progress.generated[row, :end]
            trace = None
            if progress.trace is not None:
                trace = {name: getattr(progress.trace, name)[row, :end] for name in TRACE_FIELDS}
            ticket.finished = done  # before its last update: a deadline after it does not fail it
            ticket.put(RowUpdate(generated, final, done, int(progress.nfe[row]), trace))
            batch.run.sent[row] = final
            if done:
                batch.run.free(row)

    def warm_up(self, settings: DecodeConfig, prompt_lengths: Sequence[int]) -> int:
        """Compile ``settings``' programs for every batch size at each prompt length's bucket
        (before serving): start, block call, stopping a row (a client that leaves, a stop string)
        and, continuous, joining and regrouping between sizes. Returns the number of programs
        compiled."""
        sessions = []
        for length in prompt_lengths:
            prompt = [self.lm.config.pad_id] * length
            canvas = self.canvas_length(settings, padded_length(length, self.prompt_bucket))
            runs = {}
            for size in self.sizes:
                run = self.lm.start_blocks(
                    [prompt], settings, prompt_bucket=self.prompt_bucket, batch_size=size, gen_length=canvas
                )
                run.advance()
                if self.batching == "continuous":
                    run.join([size - 1], [prompt], [settings], [0])
                run.stop([0])
                runs[size] = run
            if self.batching == "continuous":
                for run in runs.values():
                    for other in self.sizes:
                        if other != run.size:
                            run.prepare_regroup(other)
            sessions += runs.values()
        compiled = sum(run.compiles for run in sessions)
        self.count("compiles", compiled)
        return compiled

    # ------------------------------------------------------------------------------- shutdown
    def begin_drain(self, seconds: float) -> None:
        """Stop taking requests (503), let what runs finish, and after ``seconds`` fail what is left
        with a clear error (SIGTERM: ``cli``)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        loop.call_later(seconds, self._fail_remaining)

    def _fail_remaining(self, error: RequestError | None = None) -> None:
        """Every request still wanted ends now with ``error``; their rows are freed at the next block
        boundary, so a shutdown waits for the block call in flight at most."""
        for ticket in self._pending + [t for r in self._running for t in r.tickets + r.joining]:
            if not ticket.cancelled:
                ticket.cancel()
                ticket.put(Failed(error or ShuttingDown()))
        self._pending = []

    def fail(self, error: RequestError) -> None:
        """The server can no longer decode (another serving process is lost): every queued and
        running request, and every later one, gets ``error``. Call on the event loop."""
        self.failure = error
        self._fail_remaining(error)

    def close(self) -> None:
        """Drop queued work and wait for the call in flight (one block call at most): on several
        processes the others are told to stop only after it, since they make it too."""
        self._executor.shutdown(wait=True, cancel_futures=True)
