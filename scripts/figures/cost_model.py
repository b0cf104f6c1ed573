"""FLOPs and bytes of every kind of model call the decoders make, against the ideal, with rooflines.

Why: to know what an 8B decode costs on an accelerator before renting one, and where the
compiled calls do more work than the decoding needs. For the real LLaDA-8B and Dream-7B configs in
bfloat16 (``../shared/hf-configs``), nothing materialised (``nnx.eval_shape``, ``ShapeDtypeStruct``),
each call the engine makes is compiled by XLA and its ``cost_analysis()`` read:

* ``full``: the uncached call, ``predict`` over ``[B, K, P + gen]`` canvases (K = 1 plain,
  D + 1 = 4 PSD, k_max + 1 = 11 RPS);
* ``refresh``: the block-start full forward of a cached decode (``predict_prefill``, [B, P + gen],
  which also returns every layer's keys and values);
* ``dual``: a dual-cache window call, the block's ``block_length`` positions of K candidates
  against the cache (``predict_window``);
* ``prefix``: a prefix-cache window call at the first block (the rest of the canvas, ``gen``
  positions, against the cache).

XLA's cost analysis does not multiply a loop body by its trip count, so layers are unrolled; and
since every layer is the same, a call is compiled with 1 and with 2 layers and extrapolated
linearly to the real depth (exact for FLOPs and bytes: cost(L) = cost(1) + (L - 1) * (cost(2) - cost(1))).

``--quantize int8|int4`` stores the layers' projections as the loaders do (``models.quantize``,
abstractly). ``--compiler tpu`` (needs libtpu: ``pip install "jax[tpu]"``; no TPU needed) compiles
each call with the TPU compiler ahead of time for one v5e chip and reads its cost analysis: the
bytes of the TPU kernels (fused attention, dequantization fused into the matmuls) where XLA:CPU's
count is that of the CPU kernels.

Ideal FLOPs of a call: 2 x (layer parameters) x (tokens through the layers) + 2 x (LM head
parameters) x (positions a decoder can commit: the current block, per candidate) + attention
(4 x layers x queries x keys x d_model). Roofline time on one chip: max(FLOPs / peak, bytes /
bandwidth), with the peaks below.

    python -m scripts.figures.cost_model [--models LLaDA-8B,Dream-7B] [--batches 1,8,32] [--gens 256,1024] [--json PATH]
        [--kinds full,refresh,dual,prefix] [--decoders plain,psd,rps] [--quantize int8|int4] [--compiler cpu|tpu]

Its figures are in docs/cost-model.md and docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HF = REPO.parent / "shared" / "hf-configs"
MODELS = {"LLaDA-8B": HF / "LLaDA-8B-Instruct", "Dream-7B": HF / "Dream-v0-Instruct-7B"}
PROMPT, BLOCK = 128, 32
DECODERS = {"plain": {}, "psd": {"decoder": "psd", "depth": 3}, "rps": {"decoder": "rps", "k_max": 10}}
KINDS = ("full", "refresh", "dual", "prefix")

# bfloat16 dense peak FLOP/s and HBM bandwidth (bytes/s) of one chip, with their sources.
CHIPS = {
    # NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with 2:4 sparsity (989 dense), 4.8 TB/s HBM3e.
    "H200": (989e12, 4.8e12),
    # Google Cloud TPU v5e documentation: 197 TFLOPS bf16, 819 GB/s HBM2 per chip.
    "TPU v5e": (197e12, 819e9),
    # Google Cloud TPU v4 documentation: 275 TFLOPS bf16, 1,228 GB/s HBM2 per chip.
    "TPU v4": (275e12, 1228e9),
}


def call_function(kind: str, cfg, dcfg, batch: int):
    """(function of (graphdef, params), its abstract arguments) for one kind of model call."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from psd_jax.core.decoders import decoder_for
    from psd_jax.core.engine import Loop
    from psd_jax.core.predict import predict, predict_prefill, predict_window
    from psd_jax.core.runtime import Program, RowValues

    n, k = PROMPT + dcfg.gen_length, decoder_for(dcfg).branches
    key = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)  # the rows' PRNG keys (psd_jax.core.runtime)
    values = jax.tree.map(jnp.asarray, RowValues.of([dcfg] * batch))
    mask = jax.ShapeDtypeStruct((batch, n), jnp.int32)
    # The positions that get logits, as the engine asks for them (a row at its first block).
    program = Program.of(dcfg)
    window = lambda: Loop(cfg, program, PROMPT, None).logit_window(jnp.zeros(batch, jnp.int32))  # noqa: E731
    if kind == "full":
        tokens = jax.ShapeDtypeStruct((batch, k, n), jnp.int32)
        fn = lambda g, p, t, m, r: predict(nnx.merge(g, p), t, m, PROMPT, r, values, cfg, program, window())  # noqa: E731
        return fn, (tokens, mask, key)
    if kind == "refresh":
        tokens = jax.ShapeDtypeStruct((batch, n), jnp.int32)

        def fn(g, p, t, m, r):
            return predict_prefill(nnx.merge(g, p).prefill, t, m, PROMPT, r, values, cfg, program, window())

        return fn, (tokens, mask, key)
    width = BLOCK if kind == "dual" else dcfg.gen_length
    kv = jax.ShapeDtypeStruct((cfg.n_layers, batch, n, cfg.n_kv_heads, cfg.head_dim), jnp.bfloat16)
    tokens = jax.ShapeDtypeStruct((batch, k, width), jnp.int32)
    cache_mask = jax.ShapeDtypeStruct((batch, n), jnp.bool_)
    window_mask = jax.ShapeDtypeStruct((batch, width), jnp.bool_)
    out = BLOCK - cfg.logit_shift

    def fn(g, p, t, pos, ck, cv, cm, wm, r):
        return predict_window(nnx.merge(g, p).window, t, pos, (ck, cv), cm, wm, out, r, values, cfg, program)

    return fn, (tokens, tokens, kv, kv, cache_mask, window_mask, key)


def quantized_layers(model, quantize: str) -> None:
    """``model``'s (unrolled) projections as the loaders store them quantized, abstractly."""
    import jax

    from models.quantize import is_projection, quantize_weight

    for layer in model.layers:
        for name in [name for name in layer if is_projection(name)]:
            layer[name].set_value(jax.eval_shape(lambda w: quantize_weight(w, quantize), layer[name].get_value()))


def tpu_device():
    """One v5e chip of the TPU compiler's topology (ahead of time: no TPU is needed)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)
    ).devices[0]


def compiled_cost(
    kind: str, cfg, dcfg, batch: int, quantize: str | None = None, compiler: str = "cpu"
) -> tuple[float, float, float]:
    """(FLOPs, bytes accessed, compile seconds) of one call, XLA's cost analysis."""
    import contextlib

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from models import DiffusionLM
    from models.transformer import compiling_for

    with compiling_for(compiler) if compiler == "tpu" else contextlib.nullcontext():
        model = nnx.eval_shape(lambda: DiffusionLM(cfg, dtype=jnp.bfloat16, unroll_layers=True))
        if quantize is not None:
            quantized_layers(model, quantize)
        graphdef, state = nnx.split(model)
        place = SingleDeviceSharding(tpu_device()) if compiler == "tpu" else None
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place)  # noqa: E731
        params = jax.tree.map(abstract, state)
        fn, args = call_function(kind, cfg, dcfg, batch)
        start = time.perf_counter()
        compiled = jax.jit(fn, static_argnums=0).lower(graphdef, params, *map(abstract, args)).compile()
        seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]), float(cost["bytes accessed"]), seconds


def layer_params(cfg) -> int:
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    return attn + 3 * d * cfg.mlp_hidden


def ideal_flops(kind: str, cfg, dcfg, batch: int) -> float:
    """2 x parameters x tokens of the layers, the LM head over the committable block, attention."""
    from psd_jax.core.decoders import decoder_for

    n, k = PROMPT + dcfg.gen_length, decoder_for(dcfg).branches
    rows = batch * k if kind in ("full", "dual", "prefix") else batch
    queries = {"full": n, "refresh": n, "dual": BLOCK, "prefix": dcfg.gen_length}[kind]
    layers = 2 * layer_params(cfg) * cfg.n_layers * rows * queries
    head = 2 * cfg.d_model * cfg.vocab_size * rows * BLOCK
    attention = 4 * cfg.n_layers * rows * queries * n * cfg.n_heads * cfg.head_dim
    return float(layers + head + attention)


def measure(
    name: str, cfg, kind: str, decoder: str, batch: int, gen: int, quantize: str | None = None, compiler: str = "cpu"
) -> dict:
    from psd_jax.core.config import DecodeConfig

    dcfg = DecodeConfig(
        gen_length=gen,
        block_length=BLOCK,
        cache="none" if kind == "full" else "dual",
        policy="threshold",
        **DECODERS[decoder],
    )
    one, two = (
        compiled_cost(kind, replace(cfg, n_layers=layers), dcfg, batch, quantize, compiler) for layers in (1, 2)
    )
    extrapolate = lambda i: one[i] + (cfg.n_layers - 1) * (two[i] - one[i])  # noqa: E731
    flops, bytes_ = extrapolate(0), extrapolate(1)
    ideal = ideal_flops(kind, cfg, dcfg, batch)
    row = {
        "model": name,
        "kind": kind,
        "decoder": decoder,
        "batch": batch,
        "gen": gen,
        "flops": flops,
        "bytes": bytes_,
        "ideal_flops": ideal,
        "ratio": flops / ideal,
        "compile_seconds": one[2] + two[2],
        "weights": quantize or "bfloat16",
        "compiler": compiler,
    }
    for chip, (peak, bandwidth) in CHIPS.items():
        row[f"ms {chip}"] = 1e3 * max(flops / peak, bytes_ / bandwidth)
    return row


def markdown(rows: list[dict]) -> str:
    chips = list(CHIPS)
    head = (
        "| model | call | decoder | batch | gen | TFLOPs | ideal | ratio | GB | "
        + " | ".join(f"{c} ms" for c in chips)
        + " |\n"
    )
    head += (
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in chips) + " |\n"
    )
    return (
        head
        + "\n".join(
            f"| {r['model']} | {r['kind']} | {r['decoder']} | {r['batch']} | {r['gen']} | {r['flops'] / 1e12:.2f} | "
            f"{r['ideal_flops'] / 1e12:.2f} | {r['ratio']:.2f}x | {r['bytes'] / 1e9:.1f} | "
            + " | ".join(f"{r[f'ms {c}']:.1f}" for c in chips)
            + " |"
            for r in rows
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m scripts.figures.cost_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--decoders", default=",".join(DECODERS))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--gens", default="256,1024")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--quantize", choices=("int8", "int4"), help="the projections as models.quantize stores them")
    p.add_argument(
        "--compiler", choices=("cpu", "tpu"), default="cpu", help="XLA:CPU or the TPU compiler (one v5e chip)"
    )
    args = p.parse_args(argv)
    if args.compiler == "tpu":
        import importlib.util
        import os

        if importlib.util.find_spec("libtpu") is None:
            p.error('--compiler tpu needs libtpu in this environment: pip install "jax[tpu]"')
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "none")  # no local TPU to probe: compile only
    from models import load_config

    rows = []
    for name in args.models.split(","):
        cfg = load_config(MODELS[name])
        for kind in args.kinds.split(","):
            for decoder in args.decoders.split(","):
                if kind == "refresh" and decoder != "plain":
                    continue  # the block-start forward is one canvas per row for every decoder
                for batch in map(int, args.batches.split(",")):
                    for gen in map(int, args.gens.split(",")):
                        rows.append(measure(name, cfg, kind, decoder, batch, gen, args.quantize, args.compiler))
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
