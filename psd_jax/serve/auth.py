"""``--api-key``: every ``/v1/*`` request must send ``Authorization: Bearer KEY`` (as OpenAI's API
and vLLM's ``--api-key``; the official client sends its ``api_key`` so)."""

from __future__ import annotations

import hmac

from .errors import Unauthorized


def check_bearer(header: str | None, key: str) -> None:
    """``Unauthorized`` unless ``header`` (the Authorization header) is ``Bearer <key>``; the key is
    compared in constant time, so the time of a refusal says nothing about how much of it matched."""
    scheme, _, sent = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not sent.strip():
        raise Unauthorized(sent=False)
    if not hmac.compare_digest(sent.strip().encode(), key.encode()):
        raise Unauthorized(sent=True)
