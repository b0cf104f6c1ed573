"""psd-jax: JAX-native inference for diffusion language models (LLaDA, Dream) with PSD and RPS."""

from .api import InputError, LoadedModel, load_model
from .records import Generation
from .config import DecodeConfig, DecodeConfigError

__all__ = ["DecodeConfig", "DecodeConfigError", "Generation", "InputError", "LoadedModel", "load_model"]
