"""psd-jax: JAX-native inference for diffusion language models (LLaDA, Dream) with PSD and RPS."""

from .api import InputError, LoadedModel, load_model
from .config import DecodeConfig, DecodeConfigError
from .records import Generation

__all__ = ["DecodeConfig", "DecodeConfigError", "Generation", "InputError", "LoadedModel", "load_model"]
