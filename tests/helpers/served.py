"""A server under test: an app served on a free local port in a thread, and clients of it."""

from __future__ import annotations

import httpx
import openai

from psd_jax.serve.server import serving_in_thread

TIMEOUT_S = 60


running = serving_in_thread  # ``with running(app) as url``: served on a free local port, always shut down


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=TIMEOUT_S).json()
