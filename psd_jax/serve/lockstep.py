"""Several processes, one server: process 0 decides, every process makes the same calls.

Under ``jax.distributed`` every process must run the same compiled programs on the same global
arrays, in the same order, or the collectives inside them never complete. The server's scheduler
(which requests start a batch or join which rows, with their prompts, settings and seeds; regroups;
cancellations) runs on process 0 only, beside HTTP. Before each call that runs a compiled program
(``LoadedModel.start_rows`` / ``start_blocks``; ``BlockDecode.join``, ``advance``, ``regroup``,
``prepare_regroup``, ``stop``), process 0 sends the call, its name and arguments, to the other
processes through ``jax.distributed``'s key-value store (the coordination service every process is
connected to) and waits until each has received it. The other processes run no HTTP: ``follow``
receives the calls and makes them, in order, on their own copy of the model.

A process that does not confirm a call within ``timeout_s`` is taken for dead (``PeerLost``): the
call is not made, process 0 fails its requests with a 503 naming the process, and the server stops
with an error. While idle, process 0 sends an empty call every ``timeout_s / 2`` seconds, so a
process that dies between requests is noticed too. A process that dies while a call runs leaves the
others inside that call's collectives; JAX's coordination service ends every process after its
heartbeat timeout (``--heartbeat-timeout``; ``timeout_s`` is half of it, so the server's own check
comes first whenever it can).

When the server stops, process 0 sends ``EXIT`` and, once every process has it, deletes the
channel's keys: the same processes may start another server afterwards (a process that serves one
model, then another), its calls numbered from 1 again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .errors import RequestError

log = logging.getLogger(__name__)
PREFIX = "psd_jax/serve"
POLL_MS = 1000  # how long a follower's read of the next call waits before it looks again


class PeerLost(RequestError):
    """Another serving process stopped confirming calls: the server cannot decode any more."""

    def __init__(self, process: int, processes: int, seconds: float):
        super().__init__(
            f"process {process} of the {processes} serving processes did not answer within {seconds:g} s; "
            "the server is stopping",
            code="process_lost",
            status=503,
            kind="server_error",
        )
        self.process = process


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of process 0's, for the others to make: ``op`` on decode ``run`` (or on the model
    for a new decode), and the decodes process 0 still holds (the others drop the rest)."""

    op: str
    run: int | None = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    live: tuple[int, ...] = ()


PING, EXIT = "ping", "exit"  # no work; stop following (the server has stopped)
JOIN_TIMEOUT_S = 600.0  # how long process 0 waits, before it opens its port, for the others to follow


class NotJoined(RuntimeError):
    """Another process did not start following process 0 in time: the server does not start."""


def _client():
    """The key-value store of ``jax.distributed`` (its coordination service's client, which every
    process holds once ``jax.distributed.initialize`` has run; Orbax's multi-process barriers use it too)."""
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return distributed.global_state.client


def _timed_out(exc: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(exc)


class Channel:
    """Numbered calls from process 0 to the others, each confirmed by every receiver."""

    def __init__(self, process_id: int, processes: int, timeout_s: float, client: Any = None):
        self.process_id, self.processes, self.timeout_s = process_id, processes, timeout_s
        self.client = client if client is not None else _client()
        self.sent = self.received = 0
        self.last_sent = time.monotonic()
        self.lost: PeerLost | None = None
        self.closed = False  # ``close``d: nothing more is sent
        self.on_lost: Callable[[PeerLost], None] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------- process 0
    def send(self, call: Call) -> None:
        """Publish ``call`` and wait until every other process has it (``PeerLost`` if one does not
        confirm within ``timeout_s``; from then on every send raises it at once)."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if self.closed:
                raise RuntimeError(f"the serving channel is closed: {call.op} not sent")
            number = self.sent + 1
            self.client.key_value_set_bytes(f"{PREFIX}/call/{number}", pickle.dumps(call))
            for process in range(1, self.processes):
                try:
                    self.client.blocking_key_value_get_bytes(f"{PREFIX}/got/{number}/{process}", self._timeout_ms)
                except Exception as exc:  # the coordination service's DEADLINE_EXCEEDED, or its own failure
                    self.lost = PeerLost(process, self.processes, self.timeout_s)
                    log.error("%s (%s)", self.lost.message, exc)
                    break
            else:
                self.sent, self.last_sent = number, time.monotonic()
                self.closed = call.op == EXIT  # nothing follows it (a keep-alive ping included)
                self._forget(number - 1)
                return
        if self.on_lost is not None:
            self.on_lost(self.lost)
        raise self.lost

    def close(self) -> None:
        """Send ``EXIT`` (the other processes stop following) and, once each has it, delete what is
        left of this channel in the key-value store (the last call, the ready marks), so that the
        next server of these processes starts clean. ``PeerLost`` if a process does not confirm."""
        self.send(Call(EXIT))
        with self._lock:
            self._forget(self.sent)
            for process in range(1, self.processes):
                self.client.key_value_delete(f"{PREFIX}/ready/{process}")

    def wait_for_followers(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Process 0, before it opens its port: wait until every other process follows its calls
        (``calls`` marks it). So a server that answers ``/health`` can decode: no request reaches a
        process 0 whose calls no other process is there to make yet."""
        deadline = time.monotonic() + timeout_s
        for process in range(1, self.processes):
            left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                self.client.blocking_key_value_get_bytes(f"{PREFIX}/ready/{process}", left_ms)
            except Exception as exc:  # DEADLINE_EXCEEDED, or the coordination service's own failure
                raise NotJoined(
                    f"process {process} of the {self.processes} serving processes did not start serving within "
                    f"{timeout_s:g} s ({type(exc).__name__})"
                ) from None

    def _forget(self, number: int) -> None:
        if number < 1:
            return
        self.client.key_value_delete(f"{PREFIX}/call/{number}")
        for process in range(1, self.processes):
            self.client.key_value_delete(f"{PREFIX}/got/{number}/{process}")

    @property
    def _timeout_ms(self) -> int:
        return max(int(self.timeout_s * 1000), 1)

    def keep_alive(self) -> threading.Thread:
        """Send an empty call whenever nothing was sent for ``timeout_s / 2`` (a daemon thread), so
        a process that died while the server is idle is noticed within about 1.5 x ``timeout_s``."""

        def ping() -> None:
            while self.lost is None and not self.closed:
                time.sleep(self.timeout_s / 4)
                if time.monotonic() - self.last_sent >= self.timeout_s / 2:
                    try:
                        self.send(Call(PING))
                    except (PeerLost, RuntimeError):  # a lost process, or the channel closed meanwhile
                        return

        thread = threading.Thread(target=ping, name="psd-lockstep-ping", daemon=True)
        thread.start()
        return thread

    # ---------------------------------------------------------------------- other processes
    def receive(self) -> Call:
        """The next call (waits as long as it takes; a failure of the coordination service raises)."""
        number = self.received + 1
        while True:
            try:
                payload = self.client.blocking_key_value_get_bytes(f"{PREFIX}/call/{number}", POLL_MS)
                break
            except Exception as exc:
                if not _timed_out(exc):
                    raise
        self.client.key_value_set_bytes(f"{PREFIX}/got/{number}/{self.process_id}", b"")
        self.received = number
        return pickle.loads(payload)

    def calls(self) -> Iterator[Call]:
        """Every call in order until ``EXIT``, confirmed as soon as it arrives (by a thread of its
        own: a call is confirmed while the one before it still runs here)."""
        inbox: queue.Queue = queue.Queue()
        self.client.key_value_set_bytes(f"{PREFIX}/ready/{self.process_id}", b"")  # process 0 may open its port

        def pump() -> None:
            try:
                while True:
                    call = self.receive()
                    inbox.put(call)
                    if call.op == EXIT:
                        return
            except Exception as exc:  # process 0 or the coordination service is gone
                inbox.put(exc)

        threading.Thread(target=pump, name="psd-lockstep-receive", daemon=True).start()
        while True:
            item = inbox.get()
            if isinstance(item, Exception):
                raise item
            if item.op == EXIT:
                return
            yield item


class LockstepModel:
    """A ``LoadedModel`` on process 0 whose decodes are made by every process: the batcher and the
    app use it as the model itself."""

    def __init__(self, lm: Any, channel: Channel):
        self._lm, self.channel = lm, channel
        self._numbers = itertools.count(1)
        self._runs: weakref.WeakValueDictionary[int, LockstepRun] = weakref.WeakValueDictionary()

    def __getattr__(self, name: str) -> Any:  # config, tokenizer, settings, prompt_ids, compiled_programs, ...
        return getattr(self._lm, name)

    @property
    def max_programs(self) -> int | None:
        return self._lm.max_programs

    @max_programs.setter
    def max_programs(self, value: int | None) -> None:
        self._lm.max_programs = value

    def send(self, op: str, run: int | None, args: tuple, kwargs: dict) -> None:
        self.channel.send(Call(op, run, args, kwargs, tuple(sorted(self._runs))))

    def start_rows(self, *args: Any, **kwargs: Any) -> LockstepRun:
        return self._start("start_rows", args, kwargs)

    def start_blocks(self, *args: Any, **kwargs: Any) -> LockstepRun:
        return self._start("start_blocks", args, kwargs)

    def _start(self, op: str, args: tuple, kwargs: dict) -> LockstepRun:
        number = next(self._numbers)
        self.send(op, number, args, kwargs)
        run = LockstepRun(self, number, getattr(self._lm, op)(*args, **kwargs))
        self._runs[number] = run
        return run

    def close(self) -> None:
        """Tell the other processes that the server has stopped (they return from ``follow``)."""
        if self.channel.lost is None:
            self.channel.close()


class LockstepRun:
    """A ``BlockDecode`` on process 0 whose calls every process makes."""

    CALLS = ("join", "advance", "regroup", "prepare_regroup", "stop")

    def __init__(self, model: LockstepModel, number: int, run: Any):
        self._model, self._number, self._run = model, number, run

    def __getattr__(self, name: str) -> Any:  # size, done, program, compiles, results, ...
        attr = getattr(self._run, name)
        if name not in self.CALLS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._model.send(name, self._number, args, kwargs)
            return attr(*args, **kwargs)

        return call


def follow(lm: Any, channel: Channel) -> None:
    """Make process 0's calls on this process's model, in order, until the server stops. A call that
    raises here raised on process 0 too (the same call on the same values): it is logged, and the
    next call follows."""
    runs: dict[int, Any] = {}
    for call in channel.calls():
        if call.op == PING:
            continue
        for stale in set(runs) - set(call.live):
            del runs[stale]
        try:
            if call.op in ("start_rows", "start_blocks"):
                runs[call.run] = getattr(lm, call.op)(*call.args, **call.kwargs)
            else:
                getattr(runs[call.run], call.op)(*call.args, **call.kwargs)
        except Exception:
            log.exception("call %s on decode %s failed (as on process 0)", call.op, call.run)
