"""Flax NNX modules for the LLaDA, Dream, LLaDA2.0, LLaDA-MoE and SDAR diffusion language models.

``param_shapes``, ``param_dtype`` and ``model_class`` dispatch on the config's type, so the
converter and checkpoint code stay generic over the families."""

from __future__ import annotations

import jax.numpy as jnp

from . import diffusion_gemma, llada2, lladamoe, sdar, transformer
from .config import (
    ConfigError,
    LLaDA2Config,
    LLaDAMoEConfig,
    ModelConfig,
    SDARConfig,
    config_from_dict,
    load_config,
)
from .diffusion_gemma_config import DiffusionGemmaConfig
from .llada2 import LLaDA2MoE
from .lladamoe import LLaDAMoE
from .sdar import SDAR
from .transformer import DiffusionLM

AnyConfig = ModelConfig | LLaDA2Config | LLaDAMoEConfig | SDARConfig | DiffusionGemmaConfig


def family_module(cfg: AnyConfig):
    """The module (``transformer``, ``llada2``, ``lladamoe``, ``sdar`` or ``diffusion_gemma``) holding the family's parameter
    table (``param_shapes``) and logical axes (``logical_axes``)."""
    if isinstance(cfg, LLaDA2Config):
        return llada2
    if isinstance(cfg, SDARConfig):
        return sdar
    if isinstance(cfg, DiffusionGemmaConfig):
        return diffusion_gemma
    return lladamoe if isinstance(cfg, LLaDAMoEConfig) else transformer


def param_shapes(cfg: AnyConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter of the family's model, by name (the single source of truth)."""
    return family_module(cfg).param_shapes(cfg)


def param_dtype(cfg: AnyConfig, name: str, dtype) -> jnp.dtype:
    """The dtype parameter ``name`` is stored in for a model of ``dtype`` (LLaDA2.0's router bias stays float32)."""
    if isinstance(cfg, LLaDA2Config):
        return llada2.param_dtype(name, dtype)
    return jnp.dtype(dtype)


def model_class(cfg: AnyConfig) -> type[DiffusionLM] | type[LLaDA2MoE]:
    """The module class that runs ``cfg``'s family (``LLaDAMoE`` is a ``DiffusionLM``, ``SDAR`` an
    ``LLaDA2MoE``)."""
    if isinstance(cfg, LLaDA2Config):
        return LLaDA2MoE
    if isinstance(cfg, SDARConfig):
        return SDAR
    return LLaDAMoE if isinstance(cfg, LLaDAMoEConfig) else DiffusionLM


__all__ = [
    "AnyConfig",
    "ConfigError",
    "DiffusionLM",
    "LLaDA2Config",
    "LLaDA2MoE",
    "LLaDAMoE",
    "LLaDAMoEConfig",
    "ModelConfig",
    "SDAR",
    "SDARConfig",
    "config_from_dict",
    "family_module",
    "load_config",
    "model_class",
    "param_dtype",
    "param_shapes",
]
