"""Optional PyTorch backend (``pip install psd-jax[torch]``): same checkpoints, same decoders.

``load_torch_model(path)`` loads a Hugging Face LLaDA/Dream directory into ``TorchDiffusionLM``
and returns a ``TorchLM`` whose ``generate`` mirrors ``psd_jax.load_model(path).generate`` (same
settings, block KV caches included, same ``Generation`` records, same tokens and call counts in
float32 greedy decoding). The decoding rules are the engine's own (``psd_jax.core.rules``, called with
``array_api_compat.torch``); block-causal families (LLaDA2.0) are refused by name.
It exists to compare the two backends (``scripts/figures/compare_backends.py``); the JAX engine is the spec.
"""

from .api import TorchLM, load_torch_model
from .model import TorchDiffusionLM, load_hf_torch
from .run import generate

__all__ = ["TorchDiffusionLM", "TorchLM", "generate", "load_hf_torch", "load_torch_model"]
