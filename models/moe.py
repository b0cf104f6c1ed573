"""The mixture-of-experts feed-forward of LLaDA2.0, LLaDA-MoE and DiffusionGemma: the router's choice
and the dropless expert compute.

Routing (``route``) follows upstream ``LLaDA2MoeGate`` exactly: logits in float32, sigmoid scores,
``expert_bias`` added only to choose experts, group-limited top-k (keep the ``topk_group``
groups whose top-2 biased scores sum highest, then the top ``k`` experts among them), the chosen
experts' unbiased scores normalised to sum 1 and scaled by ``routed_scaling_factor``. Ties go to
the lower index (``lax.top_k``'s rule), for groups and experts alike. LLaDA-MoE's router
(``softmax_route``, OLMoE's rule) is a float32 softmax over all experts and its top-k, not renormalised.

Experts (``routed_experts``) are dropless and exact: every token gets exactly its k experts. The
(token, expert) assignments are sorted by expert; on TPU they run as one grouped matrix product per
projection (``ragged_matmul``), elsewhere in slots of a few rows per expert that read the expert
weights in place (``expert_slots``). The work against the active-parameter ideal and the time
are in docs/cost-model.md (``scripts/figures/moe_cost.py``). The outputs are unsorted and combined
with the routing weights in float32, rounded once, as upstream's ``moe_infer``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .quantize import fitted_specs, is_quantized, quantized_expert_matmul, quantized_ragged_dot
from .transformer import on_tpu

MIN_SLOT_ROWS, MAX_SLOT_ROWS = 8, 32


def route(
    x: jax.Array,
    router: jax.Array,
    expert_bias: jax.Array,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> tuple[jax.Array, jax.Array]:
    """Chosen experts [T, k] (int32) and their weights [T, k] (float32) for rows x [T, D].

    ``router`` is the gate weight as [D, E] (upstream's [E, D] transposed); ``expert_bias`` [E]."""
    logits = jnp.dot(
        x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )  # float32 on every backend (no TF32 / bf16 passes): the choice is discrete
    scores = jax.nn.sigmoid(logits)
    biased = scores + expert_bias.astype(jnp.float32)
    tokens, n_experts = biased.shape
    grouped = biased.reshape(tokens, n_group, n_experts // n_group)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [T, G]
    _, kept = jax.lax.top_k(group_scores, topk_group)
    group_mask = jnp.zeros((tokens, n_group), bool).at[jnp.arange(tokens)[:, None], kept].set(True)
    expert_mask = jnp.repeat(group_mask, n_experts // n_group, axis=1)
    _, chosen = jax.lax.top_k(jnp.where(expert_mask, biased, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, chosen, axis=1)
    if top_k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return chosen.astype(jnp.int32), weights * scaling


def softmax_route(x: jax.Array, router: jax.Array, *, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Chosen experts [T, k] (int32) and their weights [T, k] (float32) for rows x [T, D], as upstream
    LLaDA-MoE's ``LLaDAMoESparseMoeBlock`` (OLMoE's rule): the gate's logits in the model dtype (a
    ``Linear`` there, float32 accumulation rounded once), a float32 softmax over every expert, the top
    ``k`` probabilities kept as they are: not renormalised (upstream hard-codes ``norm_topk_prob``
    False), so a token's expert weights sum to less than 1.

    ``router`` is the gate weight as [D, E] (upstream's [E, D] transposed)."""
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits.astype(x.dtype).astype(jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, top_k)
    return chosen.astype(jnp.int32), weights


def slot_rows(assignments: int, n_experts: int, tokens: int) -> int:
    """Rows per expert in one slot of ``expert_slots``: the power of two at or above twice the mean
    group size, within [8, 32] and at most ``tokens`` (no group is larger: a token picks an expert
    once). With balanced routing one slot covers every group; fewer slots mean fewer reads of the
    expert weights, which is what the product waits on at decoding sizes."""
    mean = -(-assignments // n_experts)
    rows = min(MAX_SLOT_ROWS, max(MIN_SLOT_ROWS, 1 << (2 * mean - 1).bit_length()))
    return int(max(1, min(rows, tokens)))


def expert_slots(xs: jax.Array, sizes: jax.Array, w_gate, w_up, w_down, swiglu, rows: int) -> jax.Array:
    """Each expert's MLP on its rows of xs [R, D], sorted by expert with ``sizes`` [E] rows each (rows
    after ``sizes.sum()`` belong to no expert here and come back as zeros), in xs's dtype.

    XLA has no grouped GEMM outside TPU (``jax.lax.ragged_dot`` on CPU and GPU lowers to a dense
    product of every row with every expert), so the groups are cut into slots: slot s holds rows
    ``s * rows .. (s + 1) * rows - 1`` of every expert's group, zero-padded, as one [E, rows, D]
    batch, and a ``while_loop`` runs one batched product per projection against the whole expert
    stack per slot, until the largest group is covered (``ceil(max(sizes) / rows)`` slots: at most
    ``ceil(tokens / rows)``, the dense product's work, whatever the routing). The weights are read
    in place, never gathered or copied. Products accumulate in float32 and round once to xs's dtype,
    each row's exactly as one expert's product; ``w_up`` None means ``w_gate`` holds both
    (``interleave_gate_up``). Quantized weights (``qwix.QArray``) go through ``qwix.einsum``."""
    total, n_experts = xs.shape[0], sizes.shape[0]
    start = jnp.cumsum(sizes) - sizes
    n_slots = (jnp.max(sizes) + rows - 1) // rows
    # Absent rows get distinct indices past the end: read as zeros, their writes dropped.
    absent = total + jnp.arange(n_experts * rows).reshape(n_experts, rows)

    def product(a, w):
        if is_quantized(w):
            return quantized_expert_matmul(a, w).astype(xs.dtype)
        return jnp.einsum("emk,ekn->emn", a, w, preferred_element_type=jnp.float32).astype(xs.dtype)

    def slot(s, out):
        r = s * rows + jnp.arange(rows)
        present = r[None, :] < sizes[:, None]  # [E, rows]
        index = jnp.where(present, start[:, None] + r[None, :], absent)
        xe = jnp.take(xs, index, axis=0, mode="fill", fill_value=0)
        if w_up is None:
            both = product(xe, w_gate)
            h = swiglu(both[..., 0::2], both[..., 1::2])
        else:
            h = swiglu(product(xe, w_gate), product(xe, w_up))
        ye = product(h, w_down)
        return out.at[index.reshape(-1)].set(ye.reshape(-1, ye.shape[-1]), mode="drop", unique_indices=True)

    # The first slot outside the loop: its result carries the inputs' types, which under
    # ``shard_map`` vary over the mesh axes the weights are split on, as the loop's carry must.
    first = slot(0, jnp.zeros((total, w_down.shape[-1]), xs.dtype))
    return jax.lax.fori_loop(1, n_slots, slot, first)


def ragged_matmul(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """``x[r] @ w[g(r)]`` for rows x [R, K] sorted by group, ``group_sizes`` [G] rows each, w [G, K, N],
    by ``jax.lax.ragged_dot`` (TPU's native grouped kernel; ``qwix.ragged_dot`` for quantized
    weights), accumulated in float32 and rounded once to x's dtype."""
    if is_quantized(w):
        return quantized_ragged_dot(x, w, group_sizes).astype(x.dtype)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def routed_experts(
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array | None,
    w_down: jax.Array,
    swiglu,
    per_slot: int | None = None,
    grouped=None,
    batch: int = 1,
) -> jax.Array:
    """Sum over each row's k experts of weight * SwiGLU expert(x), rows x [T, D] -> [T, D] in x's dtype.

    chosen/weights [T, k] from ``route``; w_gate/w_up [E, D, F], w_down [E, F, D]; or ``w_up`` None
    and ``w_gate`` [E, D, 2F] the two interleaved (``interleave_gate_up``); ``swiglu(gate, up)``
    is the model's activation (float32 SiLU, rounded once). Off TPU the experts run in slots of
    ``per_slot`` rows per expert (``expert_slots``; ``slot_rows`` when None); on TPU, and wherever
    ``grouped(x, w, sizes)`` is given (``ragged_matmul`` or ``jax.lax.ragged_dot``: the cost
    figures measure it), as one grouped product per projection.

    Traced under a mesh (``jax.set_mesh``) with more than one device, the product runs expert
    parallel (``expert_parallel``; the T rows are ``batch`` sequences of T / batch tokens, split over
    the mesh by ``row_axes``); otherwise on the whole arrays."""
    if grouped is None and on_tpu():
        grouped = ragged_matmul
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and math.prod(mesh.shape.values()) > 1:
        return expert_parallel(
            x, chosen, weights, w_gate, w_up, w_down, swiglu, grouped, dict(mesh.shape), batch, per_slot
        )
    return _local_experts(x, chosen, weights, w_gate, w_up, w_down, swiglu, grouped, 0, per_slot).astype(x.dtype)


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[E, D, F] gate and up projections as one [E, D, 2F] array, unit j's gate at column 2j and its
    up at 2j + 1: one grouped product for both, and a split of the columns over ``model`` keeps
    each unit's pair together (halves side by side would give one device only gates).

    Why one array: on TPU ``ragged_dot`` wants its weight's output dimension minor, and the
    compiler lays out a parameter whose last dimension is not a multiple of 128 (DiffusionGemma's
    704) the other way round, so every call copied every layer's gate and up weights, hoisted out
    of the decode loop all at once (docs/diffusion-gemma.md); 2F = 1408 is laid out as wanted."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def _local_experts(x, chosen, weights, w_gate, w_up, w_down, swiglu, grouped, first, per_slot=None) -> jax.Array:
    """The float32 sum over each row's chosen experts among ``first .. first + E_local - 1`` (the
    experts of w_gate/w_up/w_down [E_local, ...]); the row's other experts contribute nothing.

    Their assignments are sorted after every local group and left out of the group sizes, so
    neither product counts them as any expert's rows (both give zeros there, dropped)."""
    tokens, k = chosen.shape
    n_local = w_gate.shape[0]
    local = chosen - first
    mine = (local >= 0) & (local < n_local)
    flat = jnp.where(mine, local, n_local).reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments sorted by expert, other devices' last
    sizes = jnp.zeros((n_local,), jnp.int32).at[flat].add(1, mode="drop")
    xs = jnp.take(x, order // k, axis=0)
    if grouped is None:
        ys = expert_slots(xs, sizes, w_gate, w_up, w_down, swiglu, per_slot or slot_rows(tokens * k, n_local, tokens))
    else:
        if w_up is None:
            both = grouped(xs, w_gate, sizes)
            h = swiglu(both[:, 0::2], both[:, 1::2])
        else:
            h = swiglu(grouped(xs, w_gate, sizes), grouped(xs, w_up, sizes))
        ys = grouped(h, w_down, sizes)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(tokens, k, -1)
    # An elementwise product and sum, not a dot: no reduced-precision matmul passes on any backend.
    return jnp.where(mine[..., None], y.astype(jnp.float32) * weights[..., None], 0.0).sum(axis=1)


def row_axes(mesh_shape: dict[str, int], batch: int) -> str | tuple[str, str] | None:
    """The mesh axes a batch of ``batch`` sequences is split over, by rows: on an expert mesh
    ``data`` and ``expert`` together when their product divides the batch (attention, the dense and
    shared layers and the head are then data parallel over the expert devices too, and each device's
    experts serve every row of its ``data`` shard: ``expert_parallel``); else ``data`` when it divides
    the batch; else none (replicated). One rule for the prompts, the KV cache and the expert product
    (``psd_jax.parallel.sharding``)."""
    data, expert = mesh_shape.get("data", 1), mesh_shape.get("expert", 1)
    if expert > 1 and batch % (data * expert) == 0:
        return ("data", "expert")
    if data > 1 and batch % data == 0:
        return "data"
    return None


# Why ``jax.shard_map`` and not the partitioner: GSPMD cannot split a sort-by-expert grouped
# product over experts. On TPU it all-gathers the whole expert stack in front of
# ``jax.lax.ragged_dot`` (it partitions a ragged dot's non-grouped dimensions only); for a product
# of gathered per-tile expert weights it gathered them with a masked local gather and an all-reduce
# of the gathered [tiles, K, N] weights, more bytes than the stack itself (both seen in the compiled
# HLO of the LLaDA2.0 forward on ``expert=8``; docs/memory-and-scaling.md). Here the compiled
# forward has no all-gather and no all-to-all of expert weights.
#
# Every device sorts all of its shard's T * k assignment rows (static shapes); other devices' rows
# are outside its groups, and neither product computes them.
def expert_parallel(
    x,
    chosen,
    weights,
    w_gate,
    w_up,
    w_down,
    swiglu,
    grouped,
    mesh_shape: dict[str, int],
    batch: int = 1,
    per_slot: int | None = None,
):
    """``routed_experts`` over the current mesh: each device runs its own experts on its rows.

    The expert weights are split over ``expert`` on their expert dimension and over ``model`` on
    their hidden dimension (``psd_jax.parallel.sharding``), and no weight ever moves: tokens go to the
    experts. Rows are split as ``row_axes`` says:

    * over ``data`` (or not at all): every device of a ``data`` shard holds all of that shard's rows
      already, so each runs ``_local_experts`` on its experts' assignments with its weight slices,
      and one float32 all-reduce over ``expert`` and ``model`` of the combined rows [T, D] (the
      partial sums over experts and hidden units) finishes the layer: the same collective as a
      tensor-parallel MLP's;
    * over ``data`` and ``expert`` (a batch the expert devices divide): the rest of the layer is
      data parallel over the expert devices, so the shard's rows are first all-gathered over
      ``expert`` (bf16 rows and their routing), and the partial sums are reduce-scattered back to
      each device's rows (with an all-reduce over ``model``): the all-reduce's two halves, with the
      attention, dense and shared layers, the head and the KV cache no longer repeated on every
      expert device.
    """
    P = jax.sharding.PartitionSpec

    def axis(name: str, dim: int) -> str | None:
        size = mesh_shape.get(name, 1)
        return name if size > 1 and dim % size == 0 else None

    experts, hidden = axis("expert", w_gate.shape[0]), axis("model", w_down.shape[1])
    rows = row_axes(mesh_shape, batch)
    scatter = experts is not None and rows == ("data", "expert")
    reduced = tuple(a for a in ((hidden,) if scatter else (experts, hidden)) if a is not None)

    def local(x, chosen, weights, w_gate, w_up, w_down):
        if scatter:  # this data shard's rows, from every expert device
            x, chosen, weights = (jax.lax.all_gather(a, experts, axis=0, tiled=True) for a in (x, chosen, weights))
        first = jax.lax.axis_index(experts) * w_gate.shape[0] if experts else 0
        out = _local_experts(x, chosen, weights, w_gate, w_up, w_down, swiglu, grouped, first, per_slot)
        if reduced:
            out = jax.lax.psum(out, reduced)
        if scatter:
            out = jax.lax.psum_scatter(out, experts, scatter_dimension=0, tiled=True)
        return out.astype(x.dtype)

    # Quantized weights: the integers split as the float weights, their scales as far as their
    # shape allows (``models.quantize.fitted_specs``, as the loaders place them).
    row_spec, stack, down = P(rows, None), P(experts, None, hidden), P(experts, hidden, None)
    specs = (fitted_specs(w_gate, stack, mesh_shape), None if w_up is None else fitted_specs(w_up, stack, mesh_shape))
    return jax.shard_map(
        local,
        in_specs=(row_spec, row_spec, row_spec, *specs, fitted_specs(w_down, down, mesh_shape)),
        out_specs=row_spec,
    )(x, chosen, weights, w_gate, w_up, w_down)
