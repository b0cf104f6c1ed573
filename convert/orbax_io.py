"""Converted checkpoints: ``config.json`` + tokenizer files + one Orbax item per parameter.

Layout: ``params/<name>/`` is an Orbax ``StandardCheckpointer`` checkpoint of ``{"value": array}``
for each parameter of ``models.param_shapes``. One item per parameter is what lets the converter
write each parameter as soon as it is assembled and drop it, so converting never holds the model
on the host (an Orbax pytree save needs every array in memory at once). A converted directory
loads without the Hugging Face source; restoring goes through an abstract target
(``jax.ShapeDtypeStruct`` per parameter, optionally with a sharding), so Orbax casts to the
requested dtype and each device reads only its shard.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from models import DiffusionLM, LLaDA2MoE, load_config, param_dtype, param_shapes

from .hf import model_from_params
from .safetensors_dir import CheckpointError

PARAMS_DIR = "params"
MARKER = "psd_jax.json"
FORMAT = "orbax-per-parameter"
# Files copied next to the parameters so the converted directory is self-contained.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "decode_defaults.json",
    "decode.json",  # LLaDA2.0's special ids, when its config.json has none
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


def save_params(params: Iterable[tuple[str, object]], dtype, source_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``(name, array)`` pairs (host numpy or JAX arrays), one Orbax item each, plus the side files.

    Each item is finished before the next pair is requested, so with a generator (the converter's
    ``iter_params``) only one parameter is alive at a time.
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
        for name, array in params:
            ckpt.save(out / PARAMS_DIR / name, {"value": array})
            ckpt.wait_until_finished()
            del array
    (out / MARKER).write_text(json.dumps({"format": FORMAT, "dtype": str(jnp.dtype(dtype))}, indent=2) + "\n")
    return out


def load_checkpoint(
    path: str | Path,
    dtype: str | jnp.dtype = jnp.float32,
    shardings: dict[str, jax.sharding.Sharding] | None = None,
    unroll_layers: bool = False,
) -> DiffusionLM | LLaDA2MoE:
    """Restore a converted directory into the family's module of ``dtype``, parameter by parameter."""
    path = Path(path).resolve()
    cfg = load_config(path)
    fmt = json.loads((path / MARKER).read_text()).get("format")
    if fmt != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {fmt!r}, this version reads {FORMAT!r}; convert it again with python -m convert"
        )
    dtype = jnp.dtype(dtype)
    shapes = param_shapes(cfg)
    stored = {p.name for p in (path / PARAMS_DIR).iterdir() if p.is_dir()}
    if stored != set(shapes):
        missing, extra = sorted(set(shapes) - stored), sorted(stored - set(shapes))
        raise CheckpointError(f"{path}: parameters do not match config.json (missing {missing}, unexpected {extra})")
    params = {}
    with ocp.StandardCheckpointer() as ckpt:
        for name, shape in shapes.items():
            item = path / PARAMS_DIR / name
            meta = ckpt.metadata(item).item_metadata.tree["value"]
            if tuple(meta.shape) != shape:
                raise CheckpointError(f"{path}: parameter '{name}' has shape {tuple(meta.shape)}, expected {shape}")
            target = jax.ShapeDtypeStruct(shape, param_dtype(cfg, name, dtype), sharding=(shardings or {}).get(name))
            params[name] = ckpt.restore(item, {"value": target})["value"]
    return model_from_params(cfg, params, dtype, unroll_layers)
