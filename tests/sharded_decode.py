"""Run in a subprocess with 8 simulated CPU devices: decode on several meshes, print JSON.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded_decode.py CKPT
"""

from __future__ import annotations

import json
import sys
import time

import jax

from psd_jax import DecodeConfig, load_model

PROMPTS = [[474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492], [280, 242, 425, 15, 2, 138, 188]]
BASE = DecodeConfig(gen_length=32, block_length=16)
DECODERS = {
    "fixed": BASE,
    "threshold": BASE.replace(policy="threshold", threshold=0.7),
    "psd": BASE.replace(policy="threshold", threshold=0.7, decoder="psd", depth=3),
    "rps": BASE.replace(policy="threshold", threshold=0.7, decoder="rps", k_max=4, pivot_tau=0.5),
}
# With the block KV cache the cache arrays [L, B, N, KV, hd] are partitioned by GSPMD inside the
# loop too (each compile costs ~10 s of CI).
CACHED = {
    "fixed+prefix": BASE.replace(cache="prefix"),
    "threshold+dual": DECODERS["threshold"].replace(cache="dual"),
    "psd+dual": DECODERS["psd"].replace(cache="dual"),
    "rps+dual": DECODERS["rps"].replace(cache="dual"),
}
MESHES = ["data=1,model=8", "data=2,model=4", "data=8,model=1"]


def kv_cache_sharding(lm) -> list:
    """The sharding of the block KV cache that a cached decode's first state holds, under the mesh."""
    import jax.numpy as jnp
    from flax import nnx

    from psd_jax.engine import _attention_mask, _loop_for, init_state

    settings = CACHED["threshold+dual"]
    ids, mask = jnp.ones((2, 16), jnp.int32), jnp.ones((2, 16), jnp.int32)

    def first_state(params):
        loop = _loop_for(nnx.merge(lm.graphdef, params), 16, lm.config, settings)
        return init_state(loop, ids, _attention_mask(mask, settings.gen_length), jax.random.key(0))

    with jax.set_mesh(lm.mesh):
        state = jax.jit(first_state)(lm.params)
    spec = [list(axis) if isinstance(axis, tuple) else axis for axis in state.cache[0].sharding.spec]
    return spec + [None] * (state.cache[0].ndim - len(spec))  # JAX drops trailing Nones


def main(ckpt: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    out = {"reference": {}, "meshes": {}}
    single = load_model(ckpt)
    for name, settings in {**DECODERS, **CACHED}.items():
        out["reference"][name] = [[r.output_ids, r.nfe] for r in single.generate(PROMPTS, settings, prompt_bucket=16)]
    for mesh in MESHES:
        lm = load_model(ckpt, mesh=mesh)
        # Parameter names (a path's last key: the same in the stacked and the unrolled layout).
        split = sorted(
            {path[-1] for path, param in lm.params.flat_state() if not param[...].sharding.is_fully_replicated}
        )
        out["meshes"][mesh] = {"split_params": split, "kv_cache_spec": kv_cache_sharding(lm)}
        for name, settings in {**DECODERS, **CACHED}.items():
            start = time.perf_counter()
            out["meshes"][mesh][name] = [
                [r.output_ids, r.nfe] for r in lm.generate(PROMPTS, settings, prompt_bucket=16)
            ]
            print(f"{mesh} {name}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
