"""A server under test: an app served on a free local port in a thread, and clients of it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import openai
import uvicorn

TIMEOUT_S = 60


@contextlib.contextmanager
def running(app):
    """Serve ``app`` on a free 127.0.0.1 port in a thread; always shut down."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120  # start-up compiles the warm-up settings
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=TIMEOUT_S).json()
