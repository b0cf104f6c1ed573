"""psd-jax: JAX-native inference for diffusion language models (LLaDA, Dream) with PSD and RPS."""

from convert.safetensors_dir import CheckpointError
from models import ConfigError

from .api import LoadedModel, load_model
from .config import DecodeConfig, DecodeConfigError
from .errors import InputError
from .records import Generation
from .sharding import MeshError
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
