"""The DiffusionGemma goldens (``shared/goldens``): the tiny checkpoint as a model, and one case's
arrays by name, for every test file that compares against them."""

from __future__ import annotations

import functools

import numpy as np
from paths import GOLDENS
from safetensors.numpy import load_file

from convert.diffusion_gemma import read_params
from models.diffusion_gemma import DiffusionGemma
from models.diffusion_gemma_config import load_diffusion_gemma_config

TINY = GOLDENS / "diffusion-gemma-tiny"


def tiny_model() -> DiffusionGemma:
    """The tiny checkpoint through the converter, in float32."""
    cfg = load_diffusion_gemma_config(TINY)
    return DiffusionGemma.from_params(cfg, read_params(TINY, cfg))


@functools.cache
def _cases() -> dict[str, np.ndarray]:
    return load_file(GOLDENS / "diffusion_gemma_cases.safetensors")


def golden_case(name: str) -> dict[str, np.ndarray]:
    """Case ``name``'s fields (``forward_batch``, ``generate_default_p0``, ...) by field name."""
    prefix = f"diffusion-gemma-tiny.{name}."
    fields = {k[len(prefix) :]: v for k, v in _cases().items() if k.startswith(prefix)}
    assert fields, f"no golden case {name!r}"
    return fields
