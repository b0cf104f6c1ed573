"""Batching: requests that share compiled settings decode together, in a worker thread.

Requests wait in an asyncio queue. The oldest one opens a batch; requests with the same settings
and padded prompt length (the same compiled loop) that arrive within ``max_wait`` join it, up to
``max_batch``. The batch is padded to the next of a few fixed sizes (powers of two up to
``max_batch``) with rows that start done, so nothing compiles after warm-up. It decodes block by
block (``LoadedModel.start_blocks``) in one worker thread (JAX releases the GIL, so the event
loop keeps answering), and each request gets its rows' progress after every block. A request
whose client left is stopped at the next block boundary; a decode that raises fails only its own
batch's requests.

Greedy rows decode exactly as alone. A sampled request with a ``seed`` decodes alone at the smallest
compiled batch size, so its answer is ``generate``'s for that seed when that size is 1 (the
sampling noise is drawn for the padded batch); sampled requests without one share a batch and a
drawn seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..api import LoadedModel
from ..config import DecodeConfig
from ..lengths import padded_length
from .errors import QueueFull
from .requests import DecodeRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """One request's row after a block call: its generated ids, final blocks, done, model calls."""

    generated: np.ndarray
    final_blocks: int
    done: bool
    nfe: int


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

    def cancel(self) -> None:
        """The answer is no longer wanted (client gone, stop string): free the row."""
        self.cancelled = True

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


class Batcher:
    """The queue, the batching rule and the worker thread; ``run`` is the dispatch loop."""

    def __init__(
        self, lm: LoadedModel, *, sizes: Sequence[int], max_wait_s: float, max_queue: int, prompt_bucket: int
    ) -> None:
        self.lm, self.sizes, self.max_batch = lm, tuple(sizes), max(sizes)
        self.max_wait_s, self.max_queue, self.prompt_bucket = max_wait_s, max_queue, prompt_bucket
        self._pending: list[Ticket] = []
        self._arrival = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psd-decode")
        self.counts = {"requests": 0, "batches": 0, "rows": 0, "compiles": 0, "cancelled": 0, "failed_batches": 0}
        self._lock = threading.Lock()  # counts change on the event loop and in the worker thread
        self.running = 0
        self.on_batch: Callable[[int, int], None] | None = None  # (rows, compiled size) per batch, for /metrics

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def stats(self) -> dict[str, int]:
        return {**self.counts, "queued": len(self._pending), "running": self.running}

    def submit(self, request: DecodeRequest) -> Ticket:
        """Queue a checked request (``QueueFull`` when ``max_queue`` are already waiting)."""
        if len(self._pending) >= self.max_queue:
            raise QueueFull(self.max_queue)
        ticket = Ticket(request, self.batch_key(request), asyncio.get_running_loop())
        self._pending.append(ticket)
        self.count("requests")
        self._arrival.set()
        return ticket

    def batch_key(self, request: DecodeRequest) -> tuple:
        """Requests with equal keys run in one compiled loop and may share a batch."""
        length = padded_length(len(request.prompt_ids), self.prompt_bucket)
        alone = request.sampled and request.seed is not None
        return request.settings, length, (object() if alone else request.sampled)

    def size_for(self, rows: int) -> int:
        return next(size for size in self.sizes if size >= rows)

    async def run(self) -> None:
        """Form batches and decode them one after another, for as long as the server runs."""
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            self.running = len(batch)
            try:
                await loop.run_in_executor(self._executor, self.decode, batch)
            finally:
                self.running = 0

    async def _next_batch(self) -> list[Ticket]:
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
                return same
            self._arrival.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrival.wait(), wait)

    def _drop_cancelled(self) -> None:
        gone = [t for t in self._pending if t.cancelled]
        if gone:
            self.count("cancelled", len(gone))
            self._pending = [t for t in self._pending if not t.cancelled]

    def decode(self, tickets: Sequence[Ticket]) -> None:
        """Decode one batch block by block (worker thread); every ticket hears how its row went."""
        self.count("batches")
        self.count("rows", len(tickets))
        if self.on_batch is not None:
            self.on_batch(len(tickets), self.size_for(len(tickets)))
        try:
            self._decode(tickets)
        except Exception as exc:  # a failing decode fails its own requests, never the server
            log.exception("decode of a batch of %d failed", len(tickets))
            self.count("failed_batches")
            for ticket in tickets:
                ticket.put(Failed(exc))

    def _decode(self, tickets: Sequence[Ticket]) -> None:
        request = tickets[0].request
        seed = request.seed if request.seed is not None else random.randrange(2**32) if request.sampled else 0
        run = self.lm.start_blocks(
            [t.request.prompt_ids for t in tickets],
            request.settings,
            seed=seed,
            chat=False,
            prompt_bucket=self.prompt_bucket,
            batch_size=self.size_for(len(tickets)),
        )
        self.count("compiles", int(run.compile_seconds > 0))
        sent, stopped = [0] * len(tickets), set()
        while not run.done:
            gone = [i for i, t in enumerate(tickets) if t.cancelled and i not in stopped]
            run.stop(gone)
            stopped.update(gone)
            self.count("cancelled", len(gone))
            progress = run.advance()
            for i, ticket in enumerate(tickets):
                final, done = int(progress.final_blocks[i]), bool(progress.done[i])
                if i in stopped or (final == sent[i] and not done):
                    continue
                ticket.put(RowUpdate(progress.generated[i], final, done, int(progress.nfe[i])))
                sent[i] = final
                if done:
                    stopped.add(i)

    def warm_up(self, settings: DecodeConfig, prompt_lengths: Sequence[int]) -> int:
        """Compile ``settings`` for every batch size at each prompt length's bucket (before serving).
        Returns the number of loops compiled."""
        compiled = 0
        for length in prompt_lengths:
            for size in self.sizes:
                prompt = [self.lm.config.pad_id] * length
                run = self.lm.start_blocks([prompt], settings, prompt_bucket=self.prompt_bucket, batch_size=size)
                compiled += int(run.compile_seconds > 0)
        self.count("compiles", compiled)
        return compiled

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
