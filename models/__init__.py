"""Flax NNX modules for the LLaDA, Dream, LLaDA2.0, LLaDA-MoE, SDAR and DiffusionGemma diffusion
language models.

``FAMILIES`` (``families``) registers each family once; ``load_config``, ``param_shapes``,
``param_dtype`` and ``model_class`` read it, so the converter, checkpoint code and decode stay
generic over the families."""

from __future__ import annotations

from types import ModuleType

import jax.numpy as jnp

from .config import ConfigError, LLaDA2Config, LLaDAMoEConfig, ModelConfig, SDARConfig
from .diffusion_gemma import DiffusionGemma
from .diffusion_gemma_config import DiffusionGemmaConfig
from .families import (
    FAMILIES,
    AnyConfig,
    Family,
    check_family,
    config_from_dict,
    family_of,
    load_config,
)
from .llada2 import LLaDA2MoE
from .lladamoe import LLaDAMoE
from .sdar import SDAR
from .transformer import DiffusionLM


def family_module(cfg: AnyConfig) -> ModuleType:
    """The module (``transformer``, ``llada2``, ``lladamoe``, ``sdar`` or ``diffusion_gemma``) holding the family's parameter
    table (``param_shapes``) and logical axes (``logical_axes``)."""
    return family_of(cfg).module


def param_shapes(cfg: AnyConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter of the family's model, by name (the single source of truth)."""
    return family_module(cfg).param_shapes(cfg)


def param_dtype(cfg: AnyConfig, name: str, dtype) -> jnp.dtype:
    """The dtype parameter ``name`` is stored in for a model of ``dtype`` (LLaDA2.0's router bias stays float32)."""
    return family_of(cfg).param_dtype(name, dtype)


def model_class(cfg: AnyConfig) -> type:
    """The module class that runs ``cfg``'s family (``LLaDAMoE`` is a ``DiffusionLM``, ``SDAR`` an
    ``LLaDA2MoE``)."""
    return family_of(cfg).model


__all__ = [
    "AnyConfig",
    "ConfigError",
    "DiffusionGemma",
    "DiffusionGemmaConfig",
    "DiffusionLM",
    "FAMILIES",
    "Family",
    "LLaDA2Config",
    "LLaDA2MoE",
    "LLaDAMoE",
    "LLaDAMoEConfig",
    "ModelConfig",
    "SDAR",
    "SDARConfig",
    "check_family",
    "config_from_dict",
    "family_module",
    "family_of",
    "load_config",
    "model_class",
    "param_dtype",
    "param_shapes",
]
