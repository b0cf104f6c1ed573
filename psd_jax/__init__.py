"""psd-jax: JAX-native inference for diffusion language models (LLaDA, Dream) with PSD and RPS."""

from convert.safetensors_dir import CheckpointError
from models import ConfigError

from .api import LoadedModel, load_model
from .core.config import DecodeConfig, DecodeConfigError
from .core.errors import InputError
from .core.records import Generation
from .parallel.sharding import MeshError
from .tokenizer import TokenizerError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DecodeConfig",
    "DecodeConfigError",
    "Generation",
    "InputError",
    "LoadedModel",
    "MeshError",
    "TokenizerError",
    "load_model",
]
