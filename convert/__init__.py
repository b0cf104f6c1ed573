"""Hugging Face safetensors -> Flax params and Orbax checkpoints."""

from .hf import check_key_set, load_hf_model
from .keys import expected_keys
from .safetensors_dir import CheckpointError

__all__ = ["CheckpointError", "check_key_set", "expected_keys", "load_hf_model"]
