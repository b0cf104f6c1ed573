"""Flax NNX modules for the LLaDA and Dream diffusion language models."""

from .config import ConfigError, ModelConfig, config_from_dict, load_config
from .transformer import DiffusionLM, param_shapes

__all__ = ["ConfigError", "DiffusionLM", "ModelConfig", "config_from_dict", "load_config", "param_shapes"]
