"""Running the app under uvicorn: as the process's server, with a graceful drain on SIGTERM/SIGINT
(``serve``), or in a thread of a process that goes on with other work (``serving_in_thread``).

uvicorn's own shutdown stops accepting connections and waits for the open ones. Before that, the
batcher drains (``Batcher.begin_drain``): new requests get 503, running ones have
``drain_seconds`` to finish and then end with a clear error, so the open connections close and the
process exits 0 within a bounded time.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from .lockstep import LockstepModel, PeerLost

SHUTDOWN_SLACK_S = 5.0  # after the drain, for the failed requests' responses to go out
THREAD_STOP_S = 2.0  # a thread's server: for connections still open when its block ends


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signal first drains the app's batcher."""

    def __init__(self, config: uvicorn.Config, drain_seconds: float):
        super().__init__(config)
        self.drain_seconds = drain_seconds

    def handle_exit(self, sig, frame) -> None:
        batcher = self.config.app.state.batcher
        if batcher.loop is not None and not batcher.draining:
            batcher.loop.call_soon_threadsafe(batcher.begin_drain, self.drain_seconds)
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has shut down, so the process would die of
        # it; after a drain the stop is a normal one and the process exits 0.
        self._captured_signals = [s for s in self._captured_signals if s not in (signal.SIGTERM, signal.SIGINT)]


def serve(
    app: FastAPI, *, host: str, port: int, log_level: str, drain_seconds: float, lockstep: LockstepModel | None = None
) -> PeerLost | None:
    """Serve ``app`` until a signal, then drain for at most ``drain_seconds``. With ``lockstep``
    (process 0 of several), the other processes are told to stop when the server does; if one of
    them is lost, every request fails with that error, the server stops, and the error is returned."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_seconds + SHUTDOWN_SLACK_S
    )
    server = DrainingServer(config, drain_seconds)
    if lockstep is not None:
        batcher = app.state.batcher

        def lost(error: PeerLost) -> None:
            if batcher.loop is not None:
                batcher.loop.call_soon_threadsafe(batcher.fail, error)
            server.should_exit = True

        lockstep.channel.on_lost = lost
        lockstep.channel.keep_alive()
    try:
        server.run()
    finally:  # also when uvicorn exits by itself (a port in use): the others must not wait for calls
        if lockstep is not None and lockstep.channel.lost is None:
            with contextlib.suppress(PeerLost):
                lockstep.close()
    return None if lockstep is None else lockstep.channel.lost


@contextlib.contextmanager
def serving_in_thread(app: FastAPI, *, start_timeout_s: float = 120.0) -> Iterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port in a daemon thread of this process and yield its base
    URL (``http://127.0.0.1:PORT``) until the block ends, then stop it. For a process that is also
    the client (a notebook, a test, a measurement); ``start_timeout_s`` covers the start-up's
    compiles of the warm-up settings. A server that dies or does not start in time is an error; when
    the block ends, connections still open get ``THREAD_STOP_S`` to finish."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=THREAD_STOP_S))
    ended: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # a failed start-up exits (SystemExit): reported to the caller
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive():
                why = repr(ended[0]) if ended else "no error"
                raise RuntimeError(f"the server did not start: uvicorn ended with {why} (its log says why)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {start_timeout_s:.0f} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(THREAD_STOP_S + SHUTDOWN_SLACK_S)
        sock.close()
