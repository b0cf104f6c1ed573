"""Flax NNX modules for the LLaDA, Dream and LLaDA2.0 diffusion language models.

``param_shapes``, ``param_dtype`` and ``model_class`` dispatch on the config's type, so the
converter and checkpoint code stay generic over the families."""

from __future__ import annotations

import jax.numpy as jnp

from . import llada2, transformer
from .config import ConfigError, LLaDA2Config, ModelConfig, config_from_dict, load_config
from .llada2 import LLaDA2MoE
from .transformer import DiffusionLM


def param_shapes(cfg: ModelConfig | LLaDA2Config) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter of the family's model, by name (the single source of truth)."""
    if isinstance(cfg, LLaDA2Config):
        return llada2.param_shapes(cfg)
    return transformer.param_shapes(cfg)


def param_dtype(cfg: ModelConfig | LLaDA2Config, name: str, dtype) -> jnp.dtype:
    """The dtype parameter ``name`` is stored in for a model of ``dtype`` (LLaDA2.0's router bias stays float32)."""
    if isinstance(cfg, LLaDA2Config):
        return llada2.param_dtype(name, dtype)
    return jnp.dtype(dtype)


def model_class(cfg: ModelConfig | LLaDA2Config) -> type[DiffusionLM] | type[LLaDA2MoE]:
    """The module class that runs ``cfg``'s family."""
    return LLaDA2MoE if isinstance(cfg, LLaDA2Config) else DiffusionLM


__all__ = [
    "ConfigError",
    "DiffusionLM",
    "LLaDA2Config",
    "LLaDA2MoE",
    "ModelConfig",
    "config_from_dict",
    "load_config",
    "model_class",
    "param_dtype",
    "param_shapes",
]
