"""Weight-only post-training quantization of the projection weights, through Google's ``qwix``.

Decoding at small batch reads every weight once per forward, so its time and memory are the
weights': int8 halves bfloat16's bytes, int4 quarters them. The projections of every layer are
stored as ``qwix.QArray`` (integer values and their scales) and multiplied through qwix, which
dequantizes them inside the product; activations stay in the model dtype:

- LLaDA and Dream: attention q/k/v/o and the MLP's gate/up/down (``qwix.dot_general``);
- LLaDA2.0: the fused ``wqkv``, ``wo``, the dense layers' MLP and the shared expert
  (``qwix.dot_general``), and the routed experts' stacked [E, in, out] weights, through the expert
  product (``models.moe.routed_experts``: ``qwix.ragged_dot`` on TPU; elsewhere each slot of rows
  against the whole stacked ``QArray`` by ``qwix.einsum``).
- LLaDA-MoE: as LLaDA2.0, with separate ``wq``/``wk``/``wv`` in place of the fused ``wqkv``.
- DiffusionGemma: each layer's attention and dense projections and its routed experts (the fused
  gate/up array, a scale per interleaved column), per layer arrays (``DiffusionGemma.from_params``).

Every quantized weight is [..., in, out] (layers, and experts, in front; the contraction is the
second-to-last axis), with one scale per index of every other axis:

- ``int8``: one scale per output channel (per layer and expert; symmetric absmax).
- ``int4``: one scale per output channel and per group of ``INT4_GROUP`` contraction rows (one
  scale per whole row loses much more: docs/quantization.md).

What stays in the model dtype: the embedding (a gather, not a matmul), the norms and biases (a
few thousand values), the output head (the logits every decoder's confidence is read from) and
the routers of LLaDA2.0 and LLaDA-MoE and LLaDA2.0's expert bias (computed in float32 as upstream does: they choose the
experts, a discrete choice; the router is 0.06% of LLaDA2.0-mini's weights).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax.sharding import NamedSharding, PartitionSpec

QUANTIZE = ("int8", "int4")
INT4_GROUP = 32  # contraction rows per int4 scale (smaller where the axis is not a multiple)
QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
# The quantized parameters by name: LLaDA and Dream's stacked [L, in, out] projections, and
# LLaDA2.0's and LLaDA-MoE's per layer group (``dense_``/``moe_`` + name): [L, in, out], the experts
# [L, E, in, out].
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
LLADA2_PROJECTIONS = (
    *("wqkv", "wq", "wk", "wv"),  # LLaDA2.0's fused projection, LLaDA-MoE's separate ones
    *("wo", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down"),
)
LLADA2_EXPERTS = ("expert_gate", "expert_up", "expert_down")
LLADA2_GROUPS = ("dense", "moe")


INT4_ON_A_MESH = "quantize='int4' with a mesh is not supported yet (int8 is): load int4 on one device"


def check_quantize(quantize: str | None, on_mesh: bool = False) -> None:
    """A known ``quantize`` value, and not int4 on a mesh: XLA:CPU's runtime reports an int4
    array's layout without its 4-bit packing, so JAX refuses to call a compiled program (whose int4
    parameters are packed) with an int4 array committed to devices, as every array on a mesh is
    (docs/quantization.md)."""
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"unknown quantize {quantize!r}; choose one of {', '.join(QUANTIZE)} (or none)")
    if quantize == "int4" and on_mesh:
        raise ValueError(INT4_ON_A_MESH)


@functools.partial(jax.jit, static_argnums=1)
def quantize_weight(w: jax.Array, quantize: str) -> qwix.QArray:
    """``w`` [..., in, out] as a ``QArray``: a scale per index of every axis but the contraction
    (per output channel, per layer and expert when stacked), and for int4 per group of contraction
    rows too; scales in ``w``'s dtype (compiled once per shape: the loaders call it for every
    parameter)."""
    contraction_axis = w.ndim - 2
    others = [a for a in range(w.ndim) if a != contraction_axis]
    tiled = {}
    if quantize == "int4":
        tiled = {contraction_axis: math.gcd(w.shape[contraction_axis], INT4_GROUP)}
    return qwix.quantize(w, QTYPES[quantize], channelwise_axes=others, tiled_axes=tiled, scale_dtype=w.dtype)


def quantized_matmul(x: jax.Array, w: qwix.QArray) -> jax.Array:
    """``x @ w`` for a quantized ``w`` [in, out]: float32 accumulation, rounded once to ``x``'s dtype."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return qwix.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def quantized_expert_matmul(x: jax.Array, w: qwix.QArray) -> jax.Array:
    """``x[e] @ w[e]`` for one slot's rows x [E, M, K] and the quantized expert stack w [E, K, N], in
    float32 (``models.moe.expert_slots``)."""
    return qwix.einsum("emk,ekn->emn", x, w, preferred_element_type=jnp.float32)


def quantized_ragged_dot(x: jax.Array, w: qwix.QArray, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot`` of rows x [R, K] with quantized expert weights w [G, K, N], in float32."""
    return qwix.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


def is_quantized(w) -> bool:
    return isinstance(w, qwix.QArray)


def host_device() -> jax.Device:
    """Where loaders quantize: the host's CPU device (JAX always has one beside an accelerator)."""
    return jax.local_devices(backend="cpu")[0]


def is_projection(name: str) -> bool:
    """Whether parameter ``name`` (as ``models.param_shapes`` names it) is stored quantized."""
    group, _, base = name.partition("_")
    if group in LLADA2_GROUPS:
        return base in LLADA2_PROJECTIONS or base in LLADA2_EXPERTS
    return name in PROJECTIONS


def fitted_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh_shape) -> PartitionSpec:
    """``spec`` (of a weight) for an array of ``shape`` (its scales): the mesh axes of every
    dimension that still divides, none where it does not (a per-channel scale's contraction
    dimension is 1)."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))

    def size(axes) -> int:
        return math.prod(mesh_shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))

    return PartitionSpec(*[axes if axes is None or dim % size(axes) == 0 else None for axes, dim in zip(spec, shape)])


def fitted_specs(w, spec: PartitionSpec, mesh_shape):
    """The ``PartitionSpec`` of ``w``, a float weight (``spec``) or a ``QArray`` (a ``QArray`` of
    specs: the integers' is ``spec``, the scales' ``fitted_spec``), as ``jax.shard_map`` takes them."""
    if not is_quantized(w):
        return spec
    return jax.tree.map(lambda leaf: fitted_spec(spec, leaf.shape, mesh_shape), w)


def fitted_sharding(sharding, shape: tuple[int, ...]):
    """``sharding`` (of a weight) for an array of ``shape`` (its scales): ``fitted_spec`` on its mesh."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, fitted_spec(sharding.spec, shape, sharding.mesh.shape))


def place_quantized(q: qwix.QArray, sharding) -> qwix.QArray:
    """A quantized weight on the devices of its float weight's ``sharding``: the integers split as
    the weight, the scales as far as their shape allows. ``None``: on the default device, not
    committed to it (as float weights loaded without a mesh): XLA:CPU's runtime reports an int4
    array's layout without its 4-bit packing, and JAX refuses to call a compiled program with a
    committed argument whose layout differs from the program's (``check_quantize``)."""
    if sharding is None:
        return jax.device_put(jax.tree.map(np.asarray, q))
    if not sharding.is_fully_addressable:  # several processes: each puts its devices' blocks from the host
        q = jax.tree.map(np.asarray, q)
    return jax.device_put(q, jax.tree.map(lambda leaf: fitted_sharding(sharding, leaf.shape), q))


def quantized_on_host(value, quantize: str) -> qwix.QArray:
    """A loaded projection (stacked [L, ..., in, out]) quantized on the host, so that its device
    receives only the integers and scales (``place_quantized``) and never holds the float weight.

    One layer at a time (each layer has scales of its own, so this is exactly the stack's
    quantization), the layers' integers and scales stacked in host memory: the quantize program's
    float32 temporary is one layer's, not the stack's (a bfloat16 stack would need twice its bytes
    more: 20 GB for LLaDA2.0-mini's routed experts)."""
    host = host_device()
    layers = [quantize_weight(jax.device_put(value[i], host), quantize) for i in range(value.shape[0])]
    return jax.tree.map(lambda *parts: np.stack(parts), *layers)
