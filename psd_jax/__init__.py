"""psd-jax: JAX-native inference for diffusion language models (LLaDA, Dream) with PSD and RPS."""

from .api import Generation, InputError, LoadedModel, load_model
from .config import DecodeConfig, DecodeConfigError

__all__ = ["DecodeConfig", "DecodeConfigError", "Generation", "InputError", "LoadedModel", "load_model"]
