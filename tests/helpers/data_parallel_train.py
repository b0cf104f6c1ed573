"""Run in a subprocess with 4 simulated CPU devices: a few training steps of the default model's
recipe on a tiny model, once unsharded and once with ``scripts.default_model.train.data_parallel``
(every batch split over the devices); print the losses and the largest parameter difference as JSON.

Usage, from the repository root (``scripts`` is imported from there):
    PYTHONPATH=. XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/helpers/data_parallel_train.py
"""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx

from models import DiffusionLM, ModelConfig
from scripts.default_model import train as train_default

CFG = ModelConfig(
    family="llada",
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    mlp_hidden=64,
    rope_theta=10000.0,
    norm_eps=1e-5,
    max_length=64,
    mask_id=62,
    eos_id=63,
    pad_id=63,
)
GEN, PROMPT, BATCH, STEPS = 16, 8, 8, 3


def run(data_parallel: bool) -> tuple[list[float], dict]:
    graphdef, params = nnx.split(DiffusionLM(CFG, rngs=nnx.Rngs(0), unroll_layers=True))
    optimizer = train_default.make_optimizer(1e-2, STEPS, warmup=1)
    opt_state = optimizer.init(params)
    put_batch, params, opt_state = train_default.data_parallel(data_parallel, params, opt_state, (BATCH,))
    step = train_default.make_train_step(graphdef, optimizer, CFG.mask_id, GEN)
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    losses = []
    for _ in range(STEPS):
        ids = rng.integers(0, 60, (BATCH, PROMPT + GEN)).astype(np.int32)
        ids, attn = put_batch((ids, np.ones_like(ids)))
        key, sub = jax.random.split(key)
        params, opt_state, loss, _ = step(params, opt_state, ids, attn, sub)
        losses.append(float(loss))
    return losses, jax.device_get(train_default.on_one_device(params))


def main() -> None:
    single_losses, single = run(False)
    sharded_losses, sharded = run(True)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), single, sharded))
    print(
        json.dumps(
            {
                "devices": len(jax.devices()),
                "single": single_losses,
                "sharded": sharded_losses,
                "max_param_diff": max(diffs),
                "batch_sharding": put_batch_sharding(),
            }
        )
    )


def put_batch_sharding() -> dict:
    """How ``data_parallel`` places a batch: partition spec, the devices holding its rows, and
    the rows kept of a full batch and of one row short (trimmed to a multiple of the devices)."""
    put_batch, _, _ = train_default.data_parallel(True, {}, {}, (BATCH,))
    (batch,) = put_batch((np.zeros((BATCH, 4), np.int32),))
    (uneven,) = put_batch((np.zeros((BATCH - 1, 4), np.int32),))
    return {
        "spec": list(batch.sharding.spec),
        "devices": len(batch.sharding.device_set),
        "rows": batch.shape[0],
        "uneven_rows": uneven.shape[0],
    }


if __name__ == "__main__":
    main()
