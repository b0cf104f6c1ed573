"""Converted checkpoints: ``config.json`` + tokenizer files + Orbax parameters under ``params/``.

A converted directory loads without the Hugging Face source. Restoring goes through an abstract
target (``jax.ShapeDtypeStruct`` per parameter, optionally with a sharding), so Orbax casts to the
requested dtype and places each array where it belongs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from models import DiffusionLM, ModelConfig, load_config, param_shapes

from .hf import model_from_params
from .safetensors_dir import CheckpointError

PARAMS_DIR = "params"
MARKER = "psd_jax.json"
# Files copied next to the parameters so the converted directory is self-contained.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "decode_defaults.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def is_orbax_dir(path: str | Path) -> bool:
    return (Path(path) / PARAMS_DIR).is_dir() and (Path(path) / MARKER).is_file()


def save_checkpoint(model: DiffusionLM, source_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``model``'s parameters with Orbax and copy config/tokenizer files from ``source_dir``."""
    params = {name: getattr(model, name)[...] for name in param_shapes(model.config)}
    return save_params(params, model.dtype, source_dir, out_dir)


def save_params(params: dict, dtype, source_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a parameter dict (host numpy or JAX arrays) with Orbax plus the side files.

    The converter passes host arrays straight from the safetensors stream, so the model is held
    on the host once (not once as JAX buffers and again as Orbax's host copies).
    """
    out = Path(out_dir).resolve()
    if (out / PARAMS_DIR).exists():
        raise FileExistsError(f"{out / PARAMS_DIR} already exists; choose an empty --out directory")
    out.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, out / name)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / PARAMS_DIR, params)
    (out / MARKER).write_text(json.dumps({"format": "orbax", "dtype": str(jnp.dtype(dtype))}, indent=2) + "\n")
    return out


def load_checkpoint(
    path: str | Path,
    dtype: str | jnp.dtype = jnp.float32,
    shardings: dict[str, jax.sharding.Sharding] | None = None,
) -> DiffusionLM:
    """Restore a converted directory into a DiffusionLM of ``dtype``."""
    path = Path(path).resolve()
    cfg: ModelConfig = load_config(path)
    dtype = jnp.dtype(dtype)
    target = {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=(shardings or {}).get(name))
        for name, shape in param_shapes(cfg).items()
    }
    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.metadata(path / PARAMS_DIR)
        stored_tree = getattr(stored, "item_metadata", stored)
        stored_tree = getattr(stored_tree, "tree", stored_tree)
        if set(stored_tree) != set(target):
            missing, extra = sorted(set(target) - set(stored_tree)), sorted(set(stored_tree) - set(target))
            raise CheckpointError(f"{path}: parameters do not match config.json (missing {missing}, unexpected {extra})")
        for name, meta in stored_tree.items():
            if tuple(meta.shape) != target[name].shape:
                raise CheckpointError(f"{path}: parameter '{name}' has shape {tuple(meta.shape)}, expected {target[name].shape}")
        params = ckpt.restore(path / PARAMS_DIR, target)
    return model_from_params(cfg, params, dtype)
