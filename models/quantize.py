"""Weight-only post-training quantization of the projection weights, through Google's ``qwix``.

Decoding at small batch reads every weight once per forward, so its time and memory are the
weights': int8 halves bfloat16's bytes, int4 quarters them. The projections of every layer
(attention q/k/v/o and the MLP's gate/up/down) are stored as ``qwix.QArray`` (integer values and
their scales) and multiplied through ``qwix.dot_general``, which dequantizes them inside the
matmul; activations stay in the model dtype.

- ``int8``: one scale per output channel (symmetric absmax over the contraction axis).
- ``int4``: one scale per output channel and per group of ``INT4_GROUP`` contraction rows (one
  scale per whole row loses much more: docs/quantization.md).

What stays in the model dtype: the embedding (a gather, not a matmul), the norms and biases (a
few thousand values), and the output head (the logits every decoder's confidence is read from).
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
# Projection weights by family: [L, in, out] stacked (the contraction is axis 1).
FAMILIES = ("llada", "dream")
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def check_quantize(quantize: str | None) -> None:
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"unknown quantize {quantize!r}; choose one of {', '.join(QUANTIZE)} (or none)")


@functools.partial(jax.jit, static_argnums=(1, 2))
def quantize_weight(w: jax.Array, quantize: str, contraction_axis: int) -> qwix.QArray:
    """``w`` as a ``QArray``: a scale per index of every other axis (per output channel, per layer
    when stacked), and for int4 per group of contraction rows too; scales in ``w``'s dtype (compiled
    once per shape: the loaders call it for every parameter)."""
    others = [a for a in range(w.ndim) if a != contraction_axis]
    tiled = {}
    if quantize == "int4":
        tiled = {contraction_axis: math.gcd(w.shape[contraction_axis], INT4_GROUP)}
    return qwix.quantize(w, QTYPES[quantize], channelwise_axes=others, tiled_axes=tiled, scale_dtype=w.dtype)


def quantized_matmul(x: jax.Array, w: qwix.QArray) -> jax.Array:
    """``x @ w`` for a quantized ``w`` [in, out]: float32 accumulation, rounded once to ``x``'s dtype."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return qwix.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def is_quantized(w) -> bool:
    return isinstance(w, qwix.QArray)


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"quantize is not supported for the {family} family yet (supported: {', '.join(FAMILIES)})")


def host_device() -> jax.Device:
    """Where loaders quantize: the host's CPU device (JAX always has one beside an accelerator)."""
    return jax.local_devices(backend="cpu")[0]


def is_projection(name: str) -> bool:
    return name in PROJECTIONS


def fitted_sharding(sharding, shape: tuple[int, ...]):
    """``sharding`` (of a weight) for an array of ``shape`` (its scales): the mesh axes of every
    dimension that still divides, none where it does not (a per-channel scale's contraction
    dimension is 1)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))

    def size(axes) -> int:
        return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))

    fitted = [axes if axes is None or dim % size(axes) == 0 else None for axes, dim in zip(spec, shape)]
    return NamedSharding(mesh, PartitionSpec(*fitted))


def place_quantized(q: qwix.QArray, sharding) -> qwix.QArray:
    """A quantized weight on the devices of its float weight's ``sharding`` (None: the default
    device): the integers split as the weight, the scales as far as their shape allows."""
    if sharding is None:
        return jax.device_put(q)
    if not sharding.is_fully_addressable:  # several processes: each puts its devices' blocks from the host
        q = jax.tree.map(np.asarray, q)
    return jax.device_put(q, jax.tree.map(lambda leaf: fitted_sharding(sharding, leaf.shape), q))


def quantized_on_host(value, quantize: str) -> qwix.QArray:
    """A loaded projection (stacked [L, in, out]) quantized on the host, so that its device
    receives only the integers and scales (``place_quantized``) and never holds the float weight."""
    return quantize_weight(jax.device_put(value, host_device()), quantize, 1)
