"""Per-device memory of DiffusionGemma-26B-A4B decoding (bfloat16 weights) on TPU v5e-8, TPU v4-8
and one 80 GB device: the whole compiled sampler (``psd_jax.core.entropy_bound``: every canvas and
step in one program) at the release's settings, compiled ahead of time on abstract inputs.

Why: to say which batch and generation length fit where before renting the hardware. Nothing is
materialised (``jax.eval_shape`` / ``ShapeDtypeStruct`` under the real ``param_shardings``):

* parameters: exact from shapes and shardings (experts over ``expert``, heads, MLP units and the
  vocabulary over ``model``);
* cache: the encoder's keys and values of every full layer for the prompt and every canvas,
  ``[B, P + K * C, KV, hd]``, of every sliding layer its last ``window - 1`` positions (exact from
  shapes; rows split as ``batch_sharding`` splits them);
* the compiled program's memory analysis: arguments (parameters and inputs), temp (the cache, the
  float32 logits ``[B, C, V]`` of a step and the self-conditioning logits carried to the next, and
  the other activations) and output.

``--compiler tpu`` (needs libtpu; no TPU: ``jax.experimental.topologies``) compiles with the TPU
compiler for the real topologies, ``cpu`` (default) with XLA:CPU on 8 simulated devices (a
pessimistic proxy: it upcasts bfloat16 products to float32). The targets, topologies and the
"GPU 80GB" stand-in are ``scripts.figures.memory_table``'s. Runs itself in a subprocess; prints
Markdown, writes ``--json``.

    python -m scripts.figures.diffusion_gemma_memory [--compiler cpu|tpu] [--batches 1,8] [--gens 256,1024]
        [--targets "TPU v5e-8,TPU v4-8,GPU 80GB"] [--mesh "TARGET:SPEC;..."] [--json PATH]

Figures: docs/diffusion-gemma.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

from scripts.figures.memory_table import (
    COMPILER_OPTIONS,
    DEFAULT_TARGETS,
    HF,
    TARGETS,
    _leaf_bytes,
    gib,
    memory_sizes,
    run_worker,
    target_devices,
)

CONFIG = HF / "DiffusionGemma-26B-A4B"
PROMPT = 128
# The experts over ``expert`` (128 experts: 16 per v5e device); the rest replicated, or over
# ``model`` where a target's mesh names it (``--mesh``).
MESHES = {"TPU v5e-8": "expert=8", "TPU v4-8": "expert=4", "GPU 80GB": "data=1,model=1"}


def cache_bytes(cfg, batch: int, gen: int, rows_split: int) -> int:
    """The encoder's cache for the prompt and every canvas, bfloat16, per device (rows split
    ``rows_split`` ways): keys and values of a full layer ``[B, P + K * C, KV, hd]``, of a sliding
    layer its last ``window - 1`` positions or all of them if fewer (``models.diffusion_gemma.Cache.for_decode``)."""
    canvases = math.ceil(gen / cfg.canvas_length)
    full = PROMPT + canvases * cfg.canvas_length
    slots = {"full": full, "sliding": min(cfg.sliding_window - 1, full)}
    per_row = sum(2 * math.prod(cfg.kv_shape(group)) * len(cfg.group_layers(group)) * slots[group] for group in slots)
    return 2 * per_row * batch // rows_split


def measure(cfg, mesh, batch: int, gen: int, options: dict | None) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.diffusion_gemma import DiffusionGemma
    from psd_jax.core.entropy_bound import Draws, EntropyBoundSettings, Prepared, SamplerValues, compile_decode
    from psd_jax.parallel.sharding import batch_sharding, param_shardings

    model = nnx.eval_shape(lambda: DiffusionGemma(cfg, dtype=jnp.bfloat16))
    graphdef, state = nnx.split(model)
    shardings = param_shardings(cfg, mesh)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[str(path[0].key)]), state
    )
    rows = batch_sharding(mesh, batch)
    ids = jax.ShapeDtypeStruct((batch, PROMPT), jnp.int32, sharding=rows)
    valid = jax.ShapeDtypeStruct((batch, PROMPT), jnp.bool_, sharding=rows)
    draws = Draws(key=jax.ShapeDtypeStruct((batch, 2), jnp.uint32, sharding=rows))
    settings = EntropyBoundSettings(gen_length=gen)  # the release's generation settings
    values = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows if v.ndim == 1 else None),
        SamplerValues.of([settings] * batch),
    )
    start = time.perf_counter()
    run = Prepared((ids, valid, draws, values), None)
    compiled = compile_decode(graphdef, params, run, settings.program(), options=options)
    mem = compiled.memory_analysis()
    rows_split = batch // rows.shard_shape((batch,))[0]
    return {
        "params": sum(_leaf_bytes(s.shape, s.dtype, s.sharding) for s in jax.tree.leaves(params)),
        "cache": cache_bytes(cfg, batch, gen, rows_split),
        # float32 logits of one step over the canvas, split over the vocabulary, and the
        # self-conditioning logits carried to the next step
        "logits_f32": 2
        * 4
        * batch
        * cfg.canvas_length
        * cfg.vocab_size
        // (rows_split * (mesh.shape.get("model", 1) if cfg.vocab_size % mesh.shape.get("model", 1) == 0 else 1)),
        "xla": memory_sizes(mem, time.perf_counter() - start),
    }


def worker(batches: list[int], gens: list[int], compiler: str, targets: list[str], overrides: dict) -> list[dict]:
    import jax

    from models import load_config
    from models.transformer import compiling_for
    from psd_jax.parallel.sharding import make_mesh

    cfg = load_config(CONFIG)
    out = []
    for target in targets:
        spec = overrides.get(target, MESHES[target])
        mesh = make_mesh(spec, target_devices(target, compiler))
        for batch in batches:
            for gen in gens:
                row = {"target": target, "mesh": spec, "hbm": TARGETS[target][1], "batch": batch, "gen": gen,
                       "prompt": PROMPT, "compiler": compiler}  # fmt: skip
                options = COMPILER_OPTIONS.get(target) if compiler == "tpu" else None
                try:
                    with compiling_for(compiler), jax.set_mesh(mesh):
                        row.update(measure(cfg, mesh, batch, gen, options))
                except jax.errors.JaxRuntimeError as exc:  # the compiler's own "does not fit"
                    if "RESOURCE_EXHAUSTED" not in str(exc):
                        raise
                    row.update(compile_error=str(exc).splitlines()[0], fits=False)
                else:
                    x = row["xla"]
                    row["total"] = x["argument"] + x["temp"] + x["output"] - x["alias"]
                    row["fits"] = row["total"] <= row["hbm"]
                print(json.dumps(row), file=sys.stderr, flush=True)
                out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        f"DiffusionGemma-26B-A4B, bfloat16 weights, prompt {PROMPT} tokens, the release's settings (canvas 256, "
        f"48 steps), GiB per device; XLA:{rows[0]['compiler'].upper()} memory analysis of the whole sampler.",
        "",
        "| target | mesh | batch | gen | params | cache | logits (f32, 2 copies) | XLA arguments | XLA temp | "
        "total | HBM | fits |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        head = f"| {r['target']} | `{r['mesh']}` | {r['batch']} | {r['gen']} |"
        if "compile_error" in r:
            lines.append(f"{head} {r['compile_error']} ||||||| {gib(r['hbm'])} | **no** |")
            continue
        x = r["xla"]
        lines.append(
            f"{head} {gib(r['params'])} | {gib(r['cache'])} | {gib(r['logits_f32'])} | {gib(x['argument'])} | "
            f"{gib(x['temp'])} | {gib(r['total'])} | {gib(r['hbm'])} | {'yes' if r['fits'] else '**no**'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--gens", default="256,1024")
    parser.add_argument("--compiler", choices=("cpu", "tpu"), default="cpu")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    parser.add_argument("--mesh", default="", help='replace targets\' meshes: "TPU v5e-8:expert=4,model=2;..."')
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches, gens = [int(b) for b in args.batches.split(",")], [int(g) for g in args.gens.split(",")]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if set(targets) - set(MESHES):
        parser.error(f"unknown target(s) {', '.join(set(targets) - set(MESHES))}; choose from {', '.join(MESHES)}")
    overrides = dict(entry.split(":", 1) for entry in args.mesh.split(";") if entry.strip())
    overrides = {target.strip(): spec.strip() for target, spec in overrides.items()}
    if args.worker:
        print(json.dumps(worker(batches, gens, args.compiler, targets, overrides)))
        return 0
    if args.compiler == "tpu" and importlib.util.find_spec("libtpu") is None:
        parser.error('--compiler tpu needs libtpu in this environment: pip install "jax[tpu]"')
    cmd = [sys.executable, "-m", "scripts.figures.diffusion_gemma_memory", "--worker", "--batches", args.batches]
    cmd += ["--gens", args.gens, "--compiler", args.compiler, "--targets", ",".join(targets), "--mesh", args.mesh]
    return run_worker(cmd, args.compiler, markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
