"""An OpenAI-compatible server for diffusion LMs (``python -m psd_jax.serve``): completions and
chat completions, streamed a block at a time, with concurrent requests batched.

``build_app`` makes the FastAPI application (for uvicorn, or a test's own server); see
docs/serving.md for how it batches and streams and what it measures.
"""

from .app import build_app, create_app

__all__ = ["build_app", "create_app"]
