"""Flax NNX modules for the LLaDA, Dream, LLaDA2.0, LLaDA-MoE and SDAR diffusion language models.

``FAMILIES`` registers each family once (its config class, module, module class and parameter
dtypes); ``param_shapes``, ``param_dtype`` and ``model_class`` read it, so the converter and
checkpoint code stay generic over the families."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

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
from .diffusion_gemma import DiffusionGemma
from .diffusion_gemma_config import DiffusionGemmaConfig
from .llada2 import LLaDA2MoE
from .lladamoe import LLaDAMoE
from .sdar import SDAR
from .transformer import DiffusionLM

AnyConfig = ModelConfig | LLaDA2Config | LLaDAMoEConfig | SDARConfig | DiffusionGemmaConfig


def stored_as_given(name: str, dtype) -> jnp.dtype:
    """A family whose parameters are all stored in the model's dtype."""
    return jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's registration: its config class, the module holding its parameter table
    (``param_shapes``) and logical axes (``logical_axes``), the module class that runs it, and the
    dtype each stored parameter takes for a model of a given dtype."""

    config: type
    module: ModuleType
    model: type
    param_dtype: Callable[[str, Any], jnp.dtype] = stored_as_given


# The one registration per family on the model side (its key table is ``convert/keys.py``'s, its
# decoding rules ``psd_jax/core/families.py``'s).
FAMILIES: dict[type, Family] = {
    f.config: f
    for f in (
        Family(ModelConfig, transformer, DiffusionLM),
        Family(LLaDA2Config, llada2, LLaDA2MoE, llada2.param_dtype),  # its router bias stays float32
        Family(LLaDAMoEConfig, lladamoe, LLaDAMoE),
        Family(SDARConfig, sdar, SDAR),
        Family(DiffusionGemmaConfig, diffusion_gemma, DiffusionGemma),
    )
}


def family_of(cfg: AnyConfig) -> Family:
    """``cfg``'s registration (by its config class)."""
    try:
        return FAMILIES[type(cfg)]
    except KeyError:
        raise TypeError(f"no model family is registered for {type(cfg).__name__}") from None


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
    "FAMILIES",
    "DiffusionLM",
    "Family",
    "LLaDA2Config",
    "LLaDA2MoE",
    "LLaDAMoE",
    "LLaDAMoEConfig",
    "ModelConfig",
    "SDAR",
    "SDARConfig",
    "config_from_dict",
    "family_module",
    "family_of",
    "load_config",
    "model_class",
    "param_dtype",
    "param_shapes",
]
