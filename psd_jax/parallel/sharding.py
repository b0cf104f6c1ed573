"""Sharding with JAX's own SPMD machinery: a ``(data, model)`` or ``(data, expert, model)`` mesh
and one logical-axis table.

Parameters carry logical axis names (``models.transformer.logical_axes``, ``models.llada2.logical_axes``,
``models.lladamoe.logical_axes``);
``LOGICAL_RULES`` maps them to mesh axes: attention heads, MLP hidden units and the vocabulary
dimension of the embedding and LM head are split over ``model`` (tensor parallel); the experts of a
mixture-of-experts layer (LLaDA2.0's and LLaDA-MoE's weights stacked [layers, experts, ...]) over ``expert``, and
their hidden units over ``model`` too; prompt rows over ``data`` (and over ``expert`` too on an
expert mesh, when the batch allows: ``models.moe.row_axes``). The router and its selection bias are
replicated. A dimension that the mesh axis does not divide, or an axis the mesh does not have, is
replicated instead (e.g. 4 KV heads on 8 devices). ``jax.jit`` then partitions the whole decode
loop (GSPMD); only the expert product is partitioned by hand (``models.moe.expert_parallel``).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import AnyConfig, ModelConfig, family_module, param_shapes
from models.moe import row_axes

AXES = ("data", "model")  # a mesh without experts (LLaDA, Dream): the default
EXPERT_AXES = ("data", "expert", "model")  # when the spec names ``expert``
LOGICAL_RULES: dict[str, str | None] = {
    "layers": None,
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "qkv": "model",  # LLaDA2.0's fused [q heads | k heads | v heads] projection
    "head_dim": None,
    "mlp": "model",
    "vocab": "model",
    "experts": "expert",
    "expert_mlp": "model",
    "router": None,  # the router's expert scores and selection bias: replicated
    "batch": "data",
}


class MeshError(ValueError):
    """A mesh request that does not fit the devices, with the reason."""


def parse_mesh(spec: str | None, n_devices: int | None = None) -> dict[str, int]:
    """``"data=2,model=4"`` -> sizes; a missing axis takes the remaining devices (default: all on model).

    ``expert`` is an axis only when the spec names it (``"expert=8"``, ``"data=1,expert=4,model=2"``):
    then the sizes have the three axes, ``data`` defaults to 1 unless ``model`` is given too, and
    ``model`` takes the devices the others leave."""
    n = n_devices if n_devices is not None else jax.device_count()
    sizes: dict[str, int] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in EXPERT_AXES:
            raise MeshError(f"unknown mesh axis {name!r} in {spec!r}; axes are {', '.join(EXPERT_AXES)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise MeshError(f"mesh axis {name} needs an integer size, got {value!r}") from None
        if sizes[name] < 1:
            raise MeshError(f"mesh axis {name} must be >= 1, got {sizes[name]}")
    axes = EXPERT_AXES if "expert" in sizes else AXES
    expert = sizes.get("expert", 1)
    if n % expert:
        raise MeshError(f"expert={expert} does not divide the {n} devices")
    rest = n // expert  # devices for data x model
    if "data" not in sizes and "model" not in sizes:
        sizes.update(data=1, model=rest)
    for axis, other in (("data", "model"), ("model", "data")):
        if axis not in sizes:
            if rest % sizes[other]:
                what = f"{other}={sizes[other]}" + (f" x expert={expert}" if "expert" in sizes else "")
                raise MeshError(f"{what} does not divide the {n} devices")
            sizes[axis] = rest // sizes[other]
    if math.prod(sizes[a] for a in axes) != n:
        shape = " x ".join(f"{a}={sizes[a]}" for a in axes)
        raise MeshError(f"mesh {shape} needs {math.prod(sizes[a] for a in axes)} devices, found {n}")
    return {axis: sizes[axis] for axis in axes}


def make_mesh(spec: str | None = None, devices=None) -> Mesh:
    devices = list(devices) if devices is not None else jax.devices()
    sizes = parse_mesh(spec, len(devices))
    return Mesh(np.array(devices).reshape(tuple(sizes.values())), tuple(sizes))


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Map logical axes to mesh axes, replicating dimensions the mesh axis does not divide."""
    out = []
    for axis, dim in zip(axes, shape):
        mesh_axis = LOGICAL_RULES.get(axis)
        if mesh_axis in mesh.shape and dim % mesh.shape[mesh_axis] == 0:
            out.append(mesh_axis)
        else:
            out.append(None)
    return PartitionSpec(*out)


def logical_axes(cfg: AnyConfig, name: str) -> tuple[str | None, ...]:
    """The logical axes of parameter ``name`` of ``cfg``'s family."""
    return family_module(cfg).logical_axes(name)


def param_shardings(cfg: AnyConfig, mesh: Mesh) -> dict[str, NamedSharding]:
    return {
        name: NamedSharding(mesh, spec_for(logical_axes(cfg, name), shape, mesh))
        for name, shape in param_shapes(cfg).items()
    }


def batch_sharding(mesh: Mesh, batch: int) -> NamedSharding:
    """Row-major arrays [B, ...] of any rank (prompts, keys, per-row values) with rows over
    ``row_axes``: ``data`` (and ``expert`` on an expert mesh) when it divides the batch, else
    replicated; the other dimensions whole."""
    return NamedSharding(mesh, PartitionSpec(row_axes(dict(mesh.shape), batch)))


def bytes_per_device(cfg: AnyConfig, mesh: Mesh, itemsize: int = 2) -> int:
    """Parameter bytes held by each device under ``param_shardings`` (every parameter at ``itemsize``)."""
    total = 0
    for name, shape in param_shapes(cfg).items():
        spec = spec_for(logical_axes(cfg, name), shape, mesh)
        split = math.prod(mesh.shape[a] for a in spec if a is not None)
        total += math.prod(shape) * itemsize // split
    return total


def kv_cache_spec(cfg: ModelConfig, mesh_shape: dict[str, int], batch: int) -> PartitionSpec:
    """The block KV cache [L, B, N, KV, hd]: rows as ``row_axes`` splits them (over ``data``, and
    ``expert`` too on an expert mesh), and over ``model`` the KV heads when it divides them, else the
    head dimension (Dream-7B's 4 KV heads on ``model=8``: replicated, each device would hold the
    whole cache). Pinned, not left to the partitioner, which inside the decode loop may choose to
    replicate it."""
    model = mesh_shape.get("model", 1)
    rows = row_axes(mesh_shape, batch)
    if model > 1 and cfg.n_kv_heads % model == 0:
        return PartitionSpec(None, rows, None, "model", None)
    if model > 1 and cfg.head_dim % model == 0:
        return PartitionSpec(None, rows, None, None, "model")
    return PartitionSpec(None, rows, None, None, None)


def constrain_kv_cache(cache: tuple[jax.Array, jax.Array], cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """``cache`` with ``kv_cache_spec``'s sharding, when traced under a mesh (``jax.set_mesh``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return cache
    spec = kv_cache_spec(cfg, dict(mesh.shape), cache[0].shape[1])
    return tuple(jax.lax.with_sharding_constraint(a, spec) for a in cache)


def constrain_rows(tree, batch: int, replicated: bool = False):
    """``tree``'s arrays split by rows as ``batch_sharding`` splits a batch of ``batch``
    (``replicated``: whole on every device), when traced under a mesh; as they are otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return tree
    spec = PartitionSpec() if replicated else PartitionSpec(row_axes(dict(mesh.shape), batch))
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec), tree)


_COLLECTIVE = re.compile(
    r"= \(?((?:[a-z0-9]+\[[0-9,]*\][^ ]*,? ?)+)\)? (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)[-a-z]*\("
)


def collectives(hlo: str) -> list[tuple[str, list[list[int]]]]:
    """(kind, result shapes) of each collective in compiled HLO text (``compiled.as_text()``); an
    asynchronous one appears twice (its ``-start`` and ``-done``). For checking what a partitioned
    program communicates: e.g. that no collective carries expert weights."""
    found = []
    for match in _COLLECTIVE.finditer(hlo):
        shapes = [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\[([0-9,]*)\]", match.group(1))]
        found.append((match.group(2), shapes))
    return found
