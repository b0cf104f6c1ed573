"""Per-device cost of LLaDA2.0-mini's forward on a TPU slice's expert mesh, compiled ahead of time
by XLA:TPU (needs libtpu: ``pip install "jax[tpu]"``; no TPU needed): FLOPs and bytes accessed from
XLA's cost analysis, the temp memory, and the collectives of the compiled program by kind and shape.

Why: the row split of expert meshes (``models.moe.row_axes``) changes what each device computes and
what travels between devices; this shows both for a real topology from a CPU host. The layers are
unrolled, because XLA's cost analysis counts a ``lax.scan`` body once. Cost analysis counts
``ragged_dot`` as every row of a device's gathered assignments against its experts (the compiled
kernel skips the other devices' rows), so the expert product's FLOPs are an upper bound.

    python -m scripts.figures.mesh_cost [--target "TPU v5e-8"] [--mesh expert=8] [--batch 32] [--length 256]

Abstract weights only (``nnx.eval_shape``); one compile of the 16B model, a few minutes on 2 cores.

Its figures are in docs/memory-and-scaling.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

os.environ.setdefault("TPU_ACCELERATOR_TYPE", "none")  # no local TPU to probe: compile only

from scripts.figures.memory_table import MODELS, TARGETS, model_config, target_devices


def forward_cost(target: str, spec: str, batch: int, length: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from models import model_class
    from models.transformer import compiling_for
    from psd_jax.parallel.sharding import batch_sharding, collectives, make_mesh, param_shardings

    cfg = model_config(MODELS["LLaDA2.0-mini"])
    mesh = make_mesh(spec, target_devices(target, "tpu"))
    stacked = param_shardings(cfg, mesh)

    def sharding(path) -> NamedSharding:
        """Unrolled layers hold layer i's slice of the stacked ``<group>_<name>``: its spec less the layer axis."""
        keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        if not keys[0].endswith("_layers"):
            return stacked[keys[0]]
        name = next(k for k in reversed(keys[1:]) if k and k != "value" and not k.isdigit())
        return NamedSharding(mesh, PartitionSpec(*tuple(stacked[f"{keys[0][: -len('_layers')]}_{name}"].spec)[1:]))

    with compiling_for("tpu"), jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: model_class(cfg)(cfg, dtype=jnp.bfloat16, unroll_layers=True))
        graphdef, state = nnx.split(model)
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(path)), state
        )
        ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=batch_sharding(mesh, batch))
        forward = jax.jit(lambda p, i: nnx.merge(graphdef, p)(i, None, None, 32))  # block-causal, block 32
        compiled = forward.lower(params, ids).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    kinds = collections.Counter(f"{kind} {shapes}" for kind, shapes in collectives(compiled.as_text()))
    return {
        "target": target,
        "mesh": spec,
        "batch": batch,
        "length": length,
        "tflop_per_device": cost["flops"] / 1e12,
        "gb_accessed_per_device": cost.get("bytes accessed", 0.0) / 1e9,
        "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30,
        "collectives": dict(kinds.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="TPU v5e-8", choices=[t for t in TARGETS if t.startswith("TPU")])
    parser.add_argument("--mesh", default="expert=8")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        parser.error('needs libtpu in this environment: pip install "jax[tpu]"')
    print(json.dumps(forward_cost(args.target, args.mesh, args.batch, args.length), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
