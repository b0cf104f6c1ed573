"""Shared fixtures: the read-only goldens in ../shared (never copied into the project)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.numpy import load_file

SHARED = Path(__file__).resolve().parents[2] / "shared"
GOLDENS = SHARED / "goldens"
HF_CONFIGS = SHARED / "hf-configs"


@pytest.fixture(scope="session")
def cases() -> dict:
    return load_file(str(GOLDENS / "cases.safetensors"))


@pytest.fixture(scope="session")
def lms() -> dict:
    """The three tiny golden checkpoints, loaded once (float32)."""
    from psd_jax import load_model

    return {name: load_model(GOLDENS / name) for name in ("llada-tiny", "llada-tiny-gqa", "dream-tiny")}
