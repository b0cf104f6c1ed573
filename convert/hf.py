"""Hugging Face safetensors directory -> the family's module (``models.model_class``) with real weights.

The source key set must equal the key table's expansion exactly (a missing, unexpected or
duplicated tensor is an error naming it), every tensor's shape is asserted before it is used, and
each parameter is assembled and placed before the next one is read: loading puts it on device(s)
(sharded if asked), the converter writes it to Orbax and drops it, so the host holds one stacked
parameter and the tensor being read (scripts/figures/convert_peak_memory.py measures the peak).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import (
    AnyConfig,
    DiffusionLM,
    LLaDA2MoE,
    check_family,
    load_config,
    model_class,
    param_dtype,
    param_shapes,
)
from models.quantize import is_projection, place_quantized, quantized_on_host

from .keys import Target, expected_keys
from .safetensors_dir import CheckpointError, SafetensorsDir


def check_key_set(cfg: AnyConfig, available: dict[str, tuple[int, ...]], source: str) -> dict[str, Target]:
    """Completeness and shape check of a source key set against the family's key table."""
    expected = expected_keys(cfg)
    missing = sorted(set(expected) - set(available))
    unexpected = sorted(set(available) - set(expected))
    if missing:
        raise CheckpointError(
            f"{source}: missing tensor(s) {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else "")
        )
    if unexpected:
        raise CheckpointError(
            f"{source}: unexpected tensor(s) {', '.join(unexpected[:10])}"
            + (" ..." if len(unexpected) > 10 else "")
            + f" (not in the {cfg.family} key table for this config)"
        )
    for key, target in expected.items():
        if tuple(available[key]) != target.source_shape:
            raise CheckpointError(
                f"{source}: tensor '{key}' has shape {tuple(available[key])}, expected {target.source_shape} from config.json"
            )
    return expected


def param_sources(reader: SafetensorsDir, cfg: AnyConfig) -> dict[str, list[tuple[str, Target]]]:
    """Each parameter's source tensors and where each goes, after the key-set and shape check."""
    by_param: dict[str, list[tuple[str, Target]]] = {}
    for key, target in check_key_set(cfg, reader.shapes, str(reader.dir)).items():
        by_param.setdefault(target.param, []).append((key, target))
    return by_param


def iter_params(reader: SafetensorsDir, cfg: AnyConfig, dtype: jnp.dtype) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, host array)`` one parameter at a time, each assembled from its source tensors.

    The key set and every shape are checked before the first tensor is read. A consumer that
    drops each array before asking for the next holds one parameter (plus one source tensor)
    at a time: that is how the converter stays far below the model's size.
    """
    by_param = param_sources(reader, cfg)  # now, before anything is written

    def assemble() -> Iterator[tuple[str, np.ndarray]]:
        for name, shape in param_shapes(cfg).items():
            np_dtype = param_dtype(cfg, name, dtype)
            host = np.empty(shape, np_dtype)
            for key, target in by_param[name]:
                tensor = reader.get(key)
                if tensor.shape != target.source_shape:
                    raise CheckpointError(
                        f"{reader.location[key]}: tensor '{key}' has shape {tensor.shape}, expected {target.source_shape}"
                    )
                tensor = tensor.T if target.transpose else tensor
                host[target.index] = tensor.astype(np_dtype, copy=False)
                del tensor
            yield name, host
            del host

    return assemble()


def stream_params(
    reader: SafetensorsDir,
    cfg: AnyConfig,
    dtype: jnp.dtype,
    place: Callable[[str, np.ndarray], jax.Array] | None = None,
) -> dict[str, jax.Array]:
    """All parameters, each put on device(s) by ``place(name, host_array)`` as soon as it is built
    (default: ``jnp.asarray``; with shardings, each device receives only its shard)."""
    place = place or (lambda name, host: jnp.asarray(host))
    return {name: place(name, host) for name, host in iter_params(reader, cfg, dtype)}


def read_block(
    reader: SafetensorsDir, sources: list[tuple[str, Target]], shape: tuple[int, ...], np_dtype, index: tuple
) -> np.ndarray:
    """The block ``index`` (a slice per dimension, as ``jax.make_array_from_callback`` asks) of a
    stacked parameter of ``shape``, read from only the source tensors and the parts of them it
    covers."""
    bounds = [range(*s.indices(n)) for s, n in zip(index, shape)]
    out = np.empty([len(b) for b in bounds], np_dtype)
    for key, target in sources:
        lead = target.index  # the stacked axes (layer, expert) the tensor sits at
        if any(i not in b for i, b in zip(lead, bounds)):
            continue
        inner = tuple(slice(b.start, b.stop) for b in bounds[len(lead) :])
        block = reader.get_slice(key, inner[::-1] if target.transpose else inner)
        out[tuple(i - b.start for i, b in zip(lead, bounds))] = (block.T if target.transpose else block).astype(
            np_dtype, copy=False
        )
    return out


def sharded_params(
    reader: SafetensorsDir,
    cfg: AnyConfig,
    dtype: jnp.dtype,
    shardings: dict[str, jax.sharding.Sharding],
) -> dict[str, jax.Array]:
    """Every parameter straight into its shards: each process reads from the files only the blocks
    its own devices hold (on several hosts, no host reads the whole model), each block once
    however many of its devices hold it."""
    by_param = param_sources(reader, cfg)
    params = {}
    for name, shape in param_shapes(cfg).items():
        np_dtype, blocks = param_dtype(cfg, name, dtype), {}

        def block(index: tuple, name=name, shape=shape, np_dtype=np_dtype, blocks=blocks) -> np.ndarray:
            key = tuple(s.indices(n) for s, n in zip(index, shape))
            if key not in blocks:
                blocks[key] = read_block(reader, by_param[name], shape, np_dtype, index)
            return blocks[key]

        params[name] = jax.make_array_from_callback(shape, shardings[name], block)
    return params


def model_from_params(
    cfg: AnyConfig, params: dict[str, jax.Array], dtype: jnp.dtype, unroll_layers: bool = False
) -> DiffusionLM | LLaDA2MoE:
    """The family's module whose parameters are the stacked ``params`` (no random initialisation is run).

    Consumes ``params``: with ``unroll_layers`` each stacked array is dropped once it is sliced, so
    the host holds one parameter twice at most."""
    cls = model_class(cfg)
    model = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, unroll_layers=unroll_layers))
    for name in list(params):
        model.set_param(name, params.pop(name))
    return model


def load_hf_model(
    model_dir: str | Path,
    dtype: str | jnp.dtype = jnp.float32,
    shardings: dict[str, jax.sharding.Sharding] | None = None,
    unroll_layers: bool = False,
    quantize: str | None = None,
) -> DiffusionLM | LLaDA2MoE:
    """Load a Hugging Face LLaDA/Dream/LLaDA2.0/LLaDA-MoE directory straight into a Flax model (sharded if
    asked; with ``quantize``, each projection quantized as it arrives: ``models.quantize``)."""
    cfg = load_config(model_dir)
    if quantize is not None:
        check_family(cfg.family)

    def place(name: str, host: np.ndarray) -> jax.Array:
        target = None if shardings is None else shardings[name]
        if quantize is not None and is_projection(name):
            return place_quantized(quantized_on_host(host, quantize), target)
        return jax.device_put(host, target)

    with SafetensorsDir(model_dir) as reader:
        if shardings is not None and quantize is None:
            params = sharded_params(reader, cfg, jnp.dtype(dtype), shardings)
        else:  # quantizing needs a projection's whole rows (a scale per output channel)
            params = stream_params(reader, cfg, jnp.dtype(dtype), place)
    return model_from_params(cfg, params, jnp.dtype(dtype), unroll_layers)
