"""Running the app under uvicorn, with a graceful drain on SIGTERM/SIGINT.

uvicorn's own shutdown stops accepting connections and waits for the open ones. Before that, the
batcher drains (``Batcher.begin_drain``): new requests get 503, running ones have
``drain_seconds`` to finish and then end with a clear error, so the open connections close and the
process exits 0 within a bounded time.
"""

from __future__ import annotations

import contextlib
import signal

import uvicorn
from fastapi import FastAPI

from .lockstep import LockstepModel, PeerLost

SHUTDOWN_SLACK_S = 5.0  # after the drain, for the failed requests' responses to go out


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
