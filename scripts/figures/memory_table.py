"""Per-device memory of LLaDA-8B / Dream-7B / LLaDA2.0-mini / SDAR-8B / LLaDA2.1-mini / -flash decoding (bfloat16) on TPU v5e-8, TPU v4-8 and one 80 GB GPU.

Why: to say which batch / generation length fits where before renting the hardware. Nothing is
guessed and no weight is materialised (only ``ShapeDtypeStruct`` / ``eval_shape``):

* parameters: ``param_shapes`` under the real ``param_shardings`` (exact from shapes);
* KV cache and decode state: ``jax.eval_shape`` shapes of ``engine.init_state`` with
  ``cache="dual"`` (block-start full forward that fills the cache), each array's bytes per
  device from the sharding GSPMD gives it in the compiled ``init_state`` (exact from shapes,
  given that sharding);
* activations: ``temp_size_in_bytes`` of XLA's memory analysis of that compiled ``init_state``
  (the decode's first call, as ``engine.decode_start``: one full forward over its canvas
  [B, P + gen], block-causal for LLaDA2.0, + logits -> prediction);
* optionally (``--decode``) the whole jitted ``engine.decode`` loop, for the largest batch and
  generation length per model and target (slow to compile), as a check of the per-call sum.

``--compiler`` chooses who compiles:

* ``tpu`` (needs libtpu: ``pip install "jax[tpu]"``; no TPU needed): the TPU compiler itself,
  ahead of time for the real topologies (``jax.experimental.topologies``: a v5e 2x4 slice, a v4
  2x2x1 slice in megacore mode) with the accelerator kernel forms and ``lax.scan`` layers. There
  is no deviceless GPU compiler, so the "GPU 80GB" row is the same program compiled for one
  accelerator chip (a v5p chip, 95 GiB) and compared with 80 GiB: an accelerator compiler's
  buffer assignment of the one-device program, not XLA:GPU's.
* ``cpu`` (default): XLA:CPU on 8 simulated devices, with the CPU kernel forms this host would
  run. A pessimistic proxy: XLA:CPU upcasts bfloat16 dot operands to float32 (the whole KV cache
  for a cached call) and materialises per-head attention scores.

LLaDA2.0-mini (16.3B parameters, 256 experts) runs on its expert mesh (``MOE_MESHES``: experts
over ``expert``, see ``psd_jax.parallel.sharding``); ``--mesh "TPU v5e-8:expert=4,model=2"`` (entries
separated by ``;``) replaces a target's mesh for the selected models. ``--models`` selects models.

Runs itself in a subprocess. Prints Markdown, writes ``--json``.

``--targets`` selects targets (default: the three above; ``TPU v5e-1`` is one v5e chip, 16 GiB;
``24GB device`` is one v6e chip whose compiler is limited to 24 GiB, a stand-in for one 24 GB GPU
with the TPU compiler, ``COMPILER_OPTIONS``; ``TPU v5p-8`` is four v5p chips, 95 GiB each, for
LLaDA2.1-flash's 100B), ``--quantize int8|int4`` stores the projections as ``models.quantize`` does (int4: one-device targets).

    python -m scripts.figures.memory_table [--json PATH] [--decode] [--batches 1,8,32] [--gens 256,1024] [--compiler cpu|tpu]
        [--models LLaDA-8B,Dream-7B,LLaDA2.0-mini,SDAR-8B] [--mesh "TARGET:SPEC;..."] [--targets ...] [--quantize int8|int4]

Its figures are in docs/memory-and-scaling.md and docs/cost-model.md and docs/quantization.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HF = REPO.parent / "shared" / "hf-configs"
MODELS = {
    "LLaDA-8B": HF / "LLaDA-8B-Instruct",
    "Dream-7B": HF / "Dream-v0-Instruct-7B",
    "LLaDA2.0-mini": HF / "LLaDA2.0-mini",
    "SDAR-8B": HF / "SDAR-8B-Chat",
    # LLaDA2.1 keeps LLaDA2.0's architecture (inclusionAI/LLaDA2.1-mini: LLaDA2.0-mini's shapes), decoded
    # with token editing; its own config is not stored here.
    "LLaDA2.1-mini": HF / "LLaDA2.0-mini",
    # LLaDA2.0-flash's shapes (100B), from inclusionAI's training repository (configs/LLaDA2.0-flash/README.md).
    "LLaDA2.1-flash": REPO / "scripts" / "figures" / "configs" / "LLaDA2.0-flash",
}
# The decode each model is measured with, besides its lengths and the dual cache (default: plain).
EDITING_QUALITY_MODE = {"decoder": "edit", "policy": "threshold_schedule", "threshold": 0.7, "editing_threshold": 0.5}
DECODE_FIELDS = {"LLaDA2.1-mini": EDITING_QUALITY_MODE, "LLaDA2.1-flash": EDITING_QUALITY_MODE}
GiB = 2**30
# name: (devices, HBM per device in bytes, mesh spec)
TARGETS = {
    "TPU v5e-8": (8, 16 * GiB, "data=1,model=8"),
    "TPU v4-8": (4, 32 * GiB, "data=1,model=4"),
    "GPU 80GB": (1, 80 * GiB, "data=1,model=1"),
    "TPU v5e-1": (1, 16 * GiB, "data=1,model=1"),
    "24GB device": (1, 24 * GiB, "data=1,model=1"),
    "TPU v5p-8": (4, 95 * GiB, "data=1,model=4"),
}
DEFAULT_TARGETS = ("TPU v5e-8", "TPU v4-8", "GPU 80GB")
# --compiler tpu: the topology each target is compiled for (name, get_topology_desc options).
TOPOLOGIES = {
    "TPU v5e-8": ("v5e:2x4", {}),
    "TPU v4-8": ("v4:2x2x1", {"chip_config_name": "megacore"}),
    "GPU 80GB": ("v5p:1x1x1", {"chips_per_host_bounds": (1, 1, 1)}),
    "TPU v5e-1": ("v5e:1x1", {"chips_per_host_bounds": (1, 1, 1)}),
    "24GB device": ("v6e:1x1", {"chips_per_host_bounds": (1, 1, 1)}),
    "TPU v5p-8": ("v5p:2x2x1", {}),
}
# --compiler tpu: compiler options per target. "24GB device" is one v6e chip (32 GiB of HBM) whose
# compiler is told it has 24 GiB (libtpu's xla_tpu_max_hbm_size_mib): the TPU compiler's buffer
# assignment of the one-device program, refused for memory as on a 24 GiB device.
COMPILER_OPTIONS = {"24GB device": {"xla_tpu_max_hbm_size_mib": 24 * 1024}}
# The mixture-of-experts model's mesh per target (experts over ``expert``; the 4 KV heads and the
# 512 expert hidden units split over ``model`` as well where it is given).
MOE_MESHES = {
    "TPU v5e-8": "expert=8",
    "TPU v4-8": "expert=4",
    "GPU 80GB": "data=1,model=1",
    "TPU v5e-1": "data=1,model=1",
    "24GB device": "data=1,model=1",
    "TPU v5p-8": "expert=4",
}
PROMPT = 128


def model_config(path: Path):
    """The config of ``path``; LLaDA2.0's real config names no mask/EOS ids: those are in special_ids.json."""
    from models import config_from_dict, load_config

    ids = path / "special_ids.json"
    if not ids.is_file():
        return load_config(path)
    return config_from_dict(json.loads((path / "config.json").read_text()), str(path), json.loads(ids.read_text()))


def mesh_spec(cfg, target: str, overrides: dict[str, str]) -> str:
    from models import LLaDA2Config

    if target in overrides:
        return overrides[target]
    return MOE_MESHES[target] if isinstance(cfg, LLaDA2Config) else TARGETS[target][2]


def _leaf_bytes(shape, dtype, sharding) -> int:
    """Bytes of one array on one device under ``sharding`` (the largest shard)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    shard = sharding.shard_shape(tuple(shape)) if sharding is not None else tuple(shape)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # a PRNG key is its raw key data
        return math.prod(shard) * jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).size * 4
    if np.dtype(dtype) in (np.dtype(jnp.int4), np.dtype(jnp.uint4)):  # two per byte on the device
        return -(-math.prod(shard) // 2)
    return math.prod(shard) * np.dtype(dtype).itemsize


def abstract_params(cfg, mesh, quantize: str | None):
    """(graphdef, the parameters as abstract arrays placed as the loaders place them on ``mesh``;
    ``quantize``: the projections as the loaders store them quantized)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import model_class
    from models.quantize import fitted_sharding
    from psd_jax.parallel.sharding import param_shardings

    model = nnx.eval_shape(lambda: model_class(cfg)(cfg, dtype=jnp.bfloat16))
    if quantize is not None:  # the projections as the loaders store them (models.quantize), abstractly
        from models import check_family, param_shapes
        from models.quantize import is_projection, quantize_weight

        check_family(cfg.family)
        for name in [name for name in param_shapes(cfg) if is_projection(name)]:
            weight = getattr(model, name).get_value()
            model.set_param(name, jax.eval_shape(lambda w: quantize_weight(w, quantize), weight))
    graphdef, state = nnx.split(model)
    shardings = param_shardings(cfg, mesh)
    # A quantized weight's scales split as far as their shape allows (models.quantize.place_quantized).
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=fitted_sharding(shardings[str(getattr(path[0], "key", path[0]))], x.shape)
        ),
        state,
    )
    return graphdef, params


def measure(
    cfg,
    mesh,
    batch: int,
    gen: int,
    full_decode: bool,
    quantize: str | None = None,
    options: dict | None = None,
    fields: dict | None = None,
) -> dict:
    """Compile ``init_state`` (and optionally ``decode``) on abstract inputs; bytes per device
    (``options``: the compiler's options)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from psd_jax.core.config import DecodeConfig
    from psd_jax.core.engine import decode, init_state, loop_and_mask
    from psd_jax.core.runtime import Program, RowValues
    from psd_jax.parallel.sharding import batch_sharding, bytes_per_device

    dcfg = DecodeConfig(gen_length=gen, block_length=32, cache="dual", **(fields or {}))
    program, values = Program.of(dcfg), RowValues.of([dcfg] * batch)
    graphdef, params = abstract_params(cfg, mesh, quantize)
    rows = batch_sharding(mesh, batch)
    ids = jax.ShapeDtypeStruct((batch, PROMPT), jnp.int32, sharding=rows)
    key = jax.ShapeDtypeStruct(
        (), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=NamedSharding(mesh, PartitionSpec())
    )

    def init(params, prompt_ids, prompt_mask, key):  # the decode's first state, as engine.decode_start
        loop, mask = loop_and_mask(nnx.merge(graphdef, params), prompt_mask, cfg, program, values)
        return init_state(loop, prompt_ids, mask, key, values)

    start = time.perf_counter()
    compiled = jax.jit(init).lower(params, ids, ids, key).compile(compiler_options=options)
    seconds = time.perf_counter() - start
    shapes = jax.eval_shape(init, params, ids, ids, key)
    out_shardings = compiled.output_shardings
    kv = [_leaf_bytes(a.shape, a.dtype, s) for a, s in zip(shapes.cache, out_shardings.cache)]
    state_leaves = jax.tree.leaves(shapes.replace(cache=None))
    state_shard = jax.tree.leaves(out_shardings.replace(cache=None))
    mem = compiled.memory_analysis()
    param_bytes = sum(_leaf_bytes(s.shape, s.dtype, s.sharding) for s in jax.tree.leaves(params))
    if all(s.dtype == jnp.bfloat16 for s in jax.tree.leaves(params)):  # LLaDA2.0 keeps expert_bias in float32
        assert param_bytes == bytes_per_device(cfg, mesh, 2)
    out = {
        "params": param_bytes,
        "kv_cache": sum(kv),
        "kv_shape": list(shapes.cache[0].shape),
        "kv_spec": str(out_shardings.cache[0].spec),
        "state": sum(_leaf_bytes(a.shape, a.dtype, s) for a, s in zip(state_leaves, state_shard)),
        "activations": mem.temp_size_in_bytes,
        "xla_init": memory_sizes(mem, seconds),
        # f32 logits of one full forward over the whole canvas, split over the vocabulary
        "logits_f32": 4
        * batch
        * (PROMPT + gen)
        * cfg.vocab_size
        // (mesh.shape["model"] if cfg.vocab_size % mesh.shape["model"] == 0 else 1),
    }
    if full_decode:
        lower = lambda: decode.lower(graphdef, params, ids, ids, key, values, mcfg=cfg, program=program)  # noqa: E731
        out["xla_decode"] = compiled_memory(lower, options)
    return out


def memory_sizes(mem, seconds: float) -> dict:
    """A compiled program's memory analysis in bytes, and its compile time."""
    return {
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
        "compile_s": round(seconds, 1),
    }


def compiled_memory(lower, options: dict | None) -> dict:
    """``memory_sizes`` of the program ``lower()`` gives, lowered and compiled, or the compiler's
    own "does not fit"."""
    import jax

    start = time.perf_counter()
    try:
        whole = lower().compile(compiler_options=options).memory_analysis()
    except jax.errors.JaxRuntimeError as exc:
        if "RESOURCE_EXHAUSTED" not in str(exc):
            raise
        return {"error": str(exc).splitlines()[0]}
    return memory_sizes(whole, time.perf_counter() - start)


def target_devices(target: str, compiler: str) -> list:
    import jax

    if compiler == "cpu":
        assert jax.device_count() >= 8, jax.devices()
        return jax.devices()[: TARGETS[target][0]]
    from jax.experimental import topologies

    name, options = TOPOLOGIES[target]
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices)


def worker(
    batches: list[int],
    gens: list[int],
    full_decode: bool,
    compiler: str,
    models: list[str],
    overrides: dict[str, str],
    targets: list[str],
    quantize: str | None,
) -> list[dict]:
    import jax

    from models.transformer import compiling_for
    from psd_jax.parallel.sharding import make_mesh

    rows = []
    for model in models:
        cfg = model_config(MODELS[model])
        for target in targets:
            hbm = TARGETS[target][1]
            spec = mesh_spec(cfg, target, overrides)
            mesh = make_mesh(spec, target_devices(target, compiler))
            for batch in batches:
                for gen in gens:
                    last = batch == max(batches) and gen == max(gens)
                    row = {
                        "model": model,
                        "target": target,
                        "mesh": spec,
                        "hbm": hbm,
                        "batch": batch,
                        "prompt": PROMPT,
                        "gen": gen,
                        "compiler": compiler,
                        "quantize": quantize,
                    }
                    try:
                        with compiling_for(compiler), jax.set_mesh(mesh):
                            options = COMPILER_OPTIONS.get(target) if compiler == "tpu" else None
                            fields = DECODE_FIELDS.get(model)
                            row.update(measure(cfg, mesh, batch, gen, full_decode and last, quantize, options, fields))
                    except jax.errors.JaxRuntimeError as exc:  # the compiler's own "does not fit"
                        if "RESOURCE_EXHAUSTED" not in str(exc):
                            raise
                        row.update(compile_error=str(exc).splitlines()[0], fits=False)
                        print(json.dumps(row), file=sys.stderr, flush=True)
                        rows.append(row)
                        continue
                    row["total"] = row["params"] + row["kv_cache"] + row["state"] + row["activations"]
                    row["fits"] = row["total"] <= hbm
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
    return rows


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def markdown(rows: list[dict]) -> str:
    lines = [
        f"Per-device memory, {rows[0]['quantize'] or 'bfloat16'} weights, prompt {PROMPT} tokens, "
        '`cache="dual"`, plain decoder (K = 1), GiB.',
        "Params, KV cache and state: exact from shapes and shardings. Activations: "
        f"XLA:{rows[0]['compiler'].upper()} `temp_size_in_bytes` of the block-start full forward.",
        "",
        "| model | target | mesh | batch | gen | params | KV cache | state | activations | total | HBM | fits |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "compile_error" in r:
            lines.append(
                f"| {r['model']} | {r['target']} | `{r['mesh']}` | {r['batch']} | {r['gen']} | "
                f"{r['compile_error']} ||||| {gib(r['hbm'])} | **no** |"
            )
            continue
        lines.append(
            f"| {r['model']} | {r['target']} | `{r['mesh']}` | {r['batch']} | {r['gen']} | {gib(r['params'])} | {gib(r['kv_cache'])} | "
            f"{gib(r['state'])} | {gib(r['activations'])} | {gib(r['total'])} | {gib(r['hbm'])} | {'yes' if r['fits'] else '**no**'} |"
        )
    whole = [r for r in rows if "xla_decode" in r]
    if whole:
        lines += [
            "",
            f"Whole jitted `engine.decode` loop (XLA:{rows[0]['compiler'].upper()} memory analysis), GiB per device:",
            "",
            "| model | target | batch | gen | arguments | temp | output | arguments + temp + output | table total |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in whole:
            d = r["xla_decode"]
            if "error" in d:
                lines.append(
                    f"| {r['model']} | {r['target']} | {r['batch']} | {r['gen']} | {d['error']} |||| {gib(r['total'])} |"
                )
                continue
            lines.append(
                f"| {r['model']} | {r['target']} | {r['batch']} | {r['gen']} | {gib(d['argument'])} | {gib(d['temp'])} | "
                f"{gib(d['output'])} | {gib(d['argument'] + d['temp'] + d['output'])} | {gib(r['total'])} |"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--gens", default="256,1024")
    parser.add_argument(
        "--decode", action="store_true", help="also compile the whole decode loop at the largest batch/gen"
    )
    parser.add_argument(
        "--compiler", choices=("cpu", "tpu"), default="cpu", help="XLA:CPU proxy or the TPU compiler ahead of time"
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument(
        "--mesh", default="", help='replace targets\' meshes: "TPU v5e-8:expert=4,model=2;TPU v4-8:expert=2,model=2"'
    )
    parser.add_argument(
        "--targets", default=",".join(DEFAULT_TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}"
    )
    parser.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        help="projections as models.quantize stores them (int4: one-device targets)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    batches, gens = [int(b) for b in args.batches.split(",")], [int(g) for g in args.gens.split(",")]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    overrides = dict(entry.split(":", 1) for entry in args.mesh.split(";") if entry.strip())
    overrides = {target.strip(): spec.strip() for target, spec in overrides.items()}
    if set(overrides) - set(TARGETS):
        parser.error(f"unknown target(s) in --mesh: {', '.join(set(overrides) - set(TARGETS))}")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if set(targets) - set(TARGETS):
        parser.error(f"unknown target(s) {', '.join(set(targets) - set(TARGETS))}; choose from {', '.join(TARGETS)}")
    if args.quantize == "int4" and any(TARGETS[t][0] > 1 for t in targets):
        parser.error("--quantize int4 needs one-device targets (int4 is not placed on meshes): --targets 'TPU v5e-1'")
    if args.worker:
        print(json.dumps(worker(batches, gens, args.decode, args.compiler, models, overrides, targets, args.quantize)))
        return 0
    if args.compiler == "tpu" and importlib.util.find_spec("libtpu") is None:
        parser.error('--compiler tpu needs libtpu in this environment: pip install "jax[tpu]"')
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--batches", args.batches, "--gens", args.gens]
    cmd += ["--compiler", args.compiler, "--models", ",".join(models), "--mesh", args.mesh]
    cmd += ["--targets", ",".join(targets)] + (["--quantize", args.quantize] if args.quantize else [])
    cmd += ["--decode"] if args.decode else []
    return run_worker(cmd, args.compiler, markdown, args.json)


def run_worker(cmd: list[str], compiler: str, render, json_out: Path | None) -> int:
    """``cmd`` (this table's ``--worker``) in a process of its own, where XLA is set up for
    ``compiler`` (8 simulated CPU devices, or the TPU compiler without a TPU), from the repository
    root; its rows printed by ``render`` and written to ``json_out``. Returns its exit code."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    if compiler == "cpu":
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    else:
        env.setdefault("TPU_ACCELERATOR_TYPE", "none")  # no local TPU to probe: compile only
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
    if proc.returncode:
        return proc.returncode
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print(render(rows))
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
