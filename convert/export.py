"""Flax model -> Hugging Face directory (``config.json`` + ``model.safetensors``), the inverse of
the key table. Used to ship our own trained model in the real LLaDA layout, so it loads through
exactly the same converter path as a downloaded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from models import DiffusionLM, ModelConfig

from .keys import expected_keys


def llada_config_dict(cfg: ModelConfig) -> dict:
    """A ``config.json`` in LLaDA-8B's schema for a LLaDA-family config."""
    if cfg.family != "llada":
        raise ValueError("only LLaDA-family configs are exported")
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "alibi": False,
        "attention_layer_norm": False,
        "block_type": "llama",
        "d_model": cfg.d_model,
        "embedding_size": cfg.vocab_size,
        "vocab_size": cfg.vocab_size,
        "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.pad_id,
        "mask_token_id": cfg.mask_id,
        "include_bias": False,
        "include_qkv_bias": cfg.qkv_bias,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "max_sequence_length": cfg.max_length,
        "mlp_hidden_size": cfg.mlp_hidden,
        "mlp_ratio": cfg.mlp_hidden // cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "n_layers": cfg.n_layers,
        "rms_norm_eps": cfg.norm_eps,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": cfg.rope_theta,
        "scale_logits": False,
        "weight_tying": cfg.tie_embeddings,
    }


def export_hf(model: DiffusionLM, out_dir: str | Path, dtype=np.float32) -> Path:
    """Write ``model`` as a Hugging Face LLaDA directory (tensor names as in LLaDA-8B)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    stacked = model.layer_weights()
    for key, target in expected_keys(model.config).items():
        source = stacked[target.param] if target.param in stacked else getattr(model, target.param)[...]
        value = np.asarray(source, dtype=np.float32)
        if target.layer is not None:
            value = value[target.layer]
        tensors[key] = np.ascontiguousarray(value.T if target.transpose else value).astype(dtype)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(llada_config_dict(model.config), indent=2) + "\n")
    return out
