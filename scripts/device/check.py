"""One prepared GPU run: LLaDA-8B's forward MFU, the decoders in JAX, and the same decodes in PyTorch.

``scripts/device_check.sh`` runs each step below in a process of its own, with its own time limit and
log, and merges what the step wrote into ``$OUT/device_check.json`` and ``$OUT/device_check.md``
(``scripts/device/report.py``) as soon as it ends, so a step that runs out of time or fails
loses only its own unfinished rows. Every step writes its JSON part after each row it finishes.
Method and how to read the output: docs/device-check.md.

Steps, most important first (``python -m scripts.device.check STEP --out DIR [--deadline S]``):

- ``env``: versions and devices; a smoke test on a toy model: one JAX decode, and the PyTorch
  model on the same weights (DLPack) giving JAX's logits.
- ``forward``: LLaDA-8B's real shape (``LLADA_8B``, from its ``config.json``) with random bfloat16
  weights made on the device by a jitted ``jax.random`` init (never on the host), the layers a
  ``lax.scan`` (the GPU layout); one bare forward (logits of every position) at [batch, length] =
  [1, 512], [8, 512], [32, 512]: compile time apart, one warm-up call, then the median of
  ``forward_repeats`` calls, each ended by ``jax.block_until_ready``. MFU = FLOPs / time / peak.
- ``jax_decode``: the decoders fixed (one token per step), threshold 0.9, PSD (threshold 0.9,
  depth 3) and RPS (threshold 0.9, k_max 10) -- ``psd_jax.cli.bench.decoder_matrix``'s settings
  ``DECODERS`` -- with cache none and dual, batch 1 and 8, gen 256, block 32, prompts of 32 random
  tokens: tokens/s, TPF, NFE per prompt, compile seconds; and threshold with the dual cache's window
  a quarter block past the block (``window_cache``: ``dual+v8``), the program of the setting the
  tuner chooses for LLaDA-8B on an H200 (docs/tuning.md "The shipped model"; its threshold is a
  runtime value of the same program).
- ``torch``: the same rows in JAX and PyTorch eager (``psd_jax.torch_backend``) on the same weights
  (the JAX arrays handed to torch through DLPack: no copy on the GPU) and the same prompts, passes
  interleaved (JAX, then torch, in each pass): the ratio JAX / torch eager per row.
- ``torch_compile``: the same with ``torch.compile`` as a third backend in each pass.
- ``int8``: the same weights with the layers' projections quantized to int8 on the device
  (``models.quantize``, as ``load_model(quantize="int8")`` stores them) against the float model,
  passes interleaved, on ``int8_rows`` (decodes at small batch with the dual cache, where each call
  reads every weight once): tokens/s of each, int8 / bfloat16, TPF and NFE of each, and the
  weights' bytes on the device.

A row that fails (out of memory, a compiler failure) records its error and the step moves on; the
PyTorch backend runs every decoder with both caches, so a torch row has no error of its own. JAX programs compiled by ``jax_decode`` are read back from a persistent
compilation cache by the later steps (``DEVICE_CHECK_CACHE``), so they compile once.

Time on one NVIDIA H200 (estimates: the script has not yet run on a GPU). Each step also pays
about 15 s to start (imports, CUDA, the 16 GB weights made on the device).

- ``env`` ~20 s (limit 45 s);
- ``forward`` ~45 s (limit 75 s): three compiles of the 8B forward with ``lax.scan`` layers,
  ~10 s each; the calls themselves take 8-300 ms;
- ``jax_decode`` ~185 s (limit 200 s): 18 compiles of the decode loop, ~7 s each; one timed run
  per row (more while a row stays under ``row_seconds``), ~60 s in all, of which ~45 s are the
  uncached batch-8 rows (fixed: 256 calls of [8, 288] tokens, ~50 ms each);
- ``torch`` ~130 s (limit 130 s): JAX again (programs from the cache), then torch eager, ~75 s for
  one pass of the 16 rows; rows are ordered cheapest first (batch 1, then batch 8 with the dual
  cache, then batch 8 uncached), so a cut keeps the most rows;
- ``torch_compile`` (limit 50 s): compiling the 8B forward with inductor takes tens of seconds
  per graph, so this gets through the first rows only;
- ``int8`` ~60 s (limit 75 s): quantizing on the device (a float32 temporary of one stacked
  projection, 6.4 GB for ``w_gate``), three decode-loop compiles of the int8 model (the bfloat16
  ones come from the cache), one or two timed passes of each model per row.

The limits add up to 575 s. ``TINY=1`` runs the same steps on a toy LLaDA shape on the CPU (2
layers, d_model 128, vocab 512, gen 32, block 16, batch 1 and 2, forward length 64, float32 so
that both backends must give the same tokens), with XLA flags that make compiling fast
(``TINY_XLA_FLAGS``) and torch on one thread; its ``torch.compile`` rows trace with dynamo and
run its graphs eagerly (``backend="eager"``: inductor's C++ compile takes minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

# LLaDA-8B-Instruct's config.json, the fields the model needs (the GPU machine gets only the repository).
LLADA_8B = {
    "model_type": "llada",
    "d_model": 4096,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "mlp_hidden_size": 12288,
    "embedding_size": 126464,
    "vocab_size": 126464,
    "max_sequence_length": 4096,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "mask_token_id": 126336,
    "eos_token_id": 126081,
    "pad_token_id": 126081,
    "include_qkv_bias": False,
    "weight_tying": False,
}
# The toy of TINY=1: the same schema, LLaDA's layout at a size a 2-core CPU compiles in seconds.
TOY = {
    **LLADA_8B,
    "d_model": 128,
    "n_heads": 2,
    "n_kv_heads": 2,
    "n_layers": 2,
    "mlp_hidden_size": 320,
    "embedding_size": 512,
    "vocab_size": 512,
    "mask_token_id": 510,
    "eos_token_id": 511,
    "pad_token_id": 511,
}

# Dense bfloat16 tensor-core peak by device kind. NVIDIA H200 datasheet
# (https://www.nvidia.com/en-us/data-center/h200/): "BF16 Tensor Core 1,979 TFLOPS" with sparsity,
# i.e. 989 TFLOP/s dense (the H100 SXM's tensor cores and clock). PEAK_TFLOPS=... overrides.
PEAK_BF16_DENSE_FLOPS = {"H200": 989e12}

# The decoders measured: short name -> setting of psd_jax.cli.bench.decoder_matrix (the benchmark's mapping).
DECODERS = {
    "fixed": "fixed-1",
    "threshold": "threshold-0.9",
    "psd": "psd-threshold-0.9-d3",
    "rps": "rps-threshold-0.9",
}
CACHES = ("none", "dual")
WINDOWED = "threshold"  # the decoder also measured with the dual cache's window past the block


def window_cache(prof: Profile) -> str:
    """The dual cache with a window a quarter block past the block, as the tuner's space has it."""
    return f"dual+v{max(prof.block_length // 4, 1)}"


# The random LM head's std is LOGIT_STD / sqrt(d_model): logits of std 16 whatever the width, so that
# threshold 0.9 commits several tokens per call, PSD accepts drafts and RPS finds pivots, as in
# scripts/figures/compare_backends.py (head std 0.5 at d_model 1024). Every other matrix: std 0.02.
LOGIT_STD = 16.0

# TINY only: XLA:CPU compiles the toy's 16 decode loops ~5x faster (slower programs; a toy does not mind).
TINY_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_opt_preset=FAST_COMPILE --xla_cpu_parallel_codegen_split_count=1"
)

STEPS = ("env", "forward", "jax_decode", "torch", "torch_compile", "int8")


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    config: dict  # Hugging Face config.json fields
    dtype: str
    forward_shapes: tuple[tuple[int, int], ...]
    forward_target: tuple[int, int]  # the shape whose MFU is held against the target
    forward_repeats: int
    gen_length: int
    block_length: int
    batches: tuple[int, ...]
    prompt_length: int
    max_passes: int  # timed passes of a decode row, at most ...
    row_seconds: float  # ... and more than one only while the row's timed decodes took less than this
    compile_rows: int | None  # rows of the torch_compile step (None: all, as time allows)
    int8_rows: tuple[str, ...]  # rows of the int8 step (keys of ``rows``)


GPU = Profile(
    name="LLaDA-8B shape, random bfloat16 weights",
    config=LLADA_8B,
    dtype="bfloat16",
    forward_shapes=((1, 512), (8, 512), (32, 512)),
    forward_target=(8, 512),
    forward_repeats=5,
    gen_length=256,
    block_length=32,
    batches=(1, 8),
    prompt_length=32,
    max_passes=3,
    row_seconds=4.0,
    compile_rows=None,
    int8_rows=("threshold/dual/1", "fixed/dual/1", "threshold/dual/8"),
)
TINY = Profile(
    name="TINY: toy LLaDA shape on CPU (2 layers, d_model 128, 2 heads, vocab 512), float32",
    config=TOY,
    dtype="float32",
    forward_shapes=((1, 64), (8, 64), (32, 64)),
    forward_target=(8, 64),
    forward_repeats=3,
    gen_length=32,
    block_length=16,
    batches=(1,),  # one batch size: the steps' code paths, at half the rows (the suite runs it on 2 cores)
    prompt_length=32,
    max_passes=2,
    row_seconds=0.5,
    compile_rows=2,
    int8_rows=("threshold/dual/1",),
)

# Targets, held against the measurements by the report.
TARGET_MFU = 0.5  # the forward at forward_target: >= 50% of the bf16 dense peak
TARGET_JAX_OVER_TORCH = 1.5  # JAX >= 1.5x PyTorch eager tokens/s on every row


def profile() -> Profile:
    return TINY if os.environ.get("TINY") else GPU


def rows(prof: Profile) -> list[dict]:
    """Every decoder x cache x batch row, cheapest first: the first batch (uncached, dual), then each
    larger batch with the dual cache, then uncached, whose full-canvas forwards cost most."""
    order = [(prof.batches[0], "none"), (prof.batches[0], "dual"), (prof.batches[0], window_cache(prof))]
    order += [(b, cache) for b in prof.batches[1:] for cache in ("dual", window_cache(prof), "none")]
    return [
        {"decoder": d, "setting": DECODERS[d], "cache": c, "batch": b, "key": f"{d}/{c}/{b}"}
        for b, c in order
        for d in (DECODERS if c in CACHES else (WINDOWED,))
    ]


# --------------------------------------------------------------------------- model and weights


def model_config(prof: Profile):
    from models import config_from_dict

    return config_from_dict(prof.config, source=prof.name)


def forward_flops(cfg, batch: int, length: int) -> dict:
    """FLOPs of one bare forward: 2 x (weights multiplied per token) x tokens, the embedding table
    excluded (a row gather), plus attention's two products, 4 x layers x length^2 x heads x head_dim
    per sequence (bidirectional: every query against every key)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_token = cfg.n_layers * (2 * cfg.d_model * q + 2 * cfg.d_model * kv + 3 * cfg.d_model * cfg.mlp_hidden)
    per_token += cfg.d_model * cfg.vocab_size  # the LM head, at every position
    matmul = 2 * per_token * batch * length
    attention = 4 * cfg.n_layers * batch * length * length * q
    return {"matmul_weights": per_token, "matmul": matmul, "attention": attention, "total": matmul + attention}


def init_params(cfg, dtype: str, seed: int = 0) -> dict:
    """Random parameters, made on the default device by one jitted ``jax.random`` program (the
    host never holds them): norms 1, biases 0, the LM head std ``LOGIT_STD / sqrt(d_model)``, other
    matrices std 0.02 (``models.transformer.DiffusionLM``'s own init, with a more confident head)."""
    import jax
    import jax.numpy as jnp

    from models import param_shapes

    shapes = param_shapes(cfg)
    dt = jnp.dtype(dtype)

    @jax.jit
    def init(key):
        out = {}
        for (name, shape), k in zip(shapes.items(), jax.random.split(key, len(shapes))):
            if name.endswith("norm"):
                out[name] = jnp.ones(shape, dt)
            elif name.startswith("b"):
                out[name] = jnp.zeros(shape, dt)
            else:
                std = LOGIT_STD / math.sqrt(cfg.d_model) if name == "lm_head" else 0.02
                out[name] = (std * jax.random.normal(k, shape, dt)).astype(dt)
        return out

    return jax.block_until_ready(init(jax.random.key(seed)))


def jax_model(prof: Profile, seed: int = 0):
    """``LoadedModel`` of the profile's shape on random device-made weights, the layers a ``lax.scan``
    over stacked weights: the GPU/TPU layout (``load_model``'s default there), also in TINY runs on
    the CPU, where it compiles the toy's decode loops 1.5x faster than the unrolled CPU default."""
    from convert.hf import model_from_params
    from psd_jax.api import DTYPES, LoadedModel

    cfg = model_config(prof)
    params = init_params(cfg, prof.dtype, seed)
    model = model_from_params(cfg, params, DTYPES[prof.dtype], unroll_layers=False)
    return LoadedModel(model, None, Path(prof.name), None)


def quantized_model(lm, quantize: str = "int8"):
    """A ``LoadedModel`` of ``lm``'s weights with the layers' projections quantized on the device
    (``models.quantize``: the arrays ``load_model(quantize=...)`` stores); ``lm`` keeps its own."""
    import jax
    from flax import nnx

    from models import param_shapes
    from models.quantize import is_projection, quantize_weight
    from psd_jax.api import LoadedModel

    model = nnx.merge(lm.graphdef, jax.tree.map(lambda a: a, lm.params))  # its own module over the same arrays
    for name in [name for name in param_shapes(lm.config) if is_projection(name)]:
        model.set_param(name, quantize_weight(getattr(model, name).get_value(), quantize))
    return LoadedModel(model, None, lm.path, None)


def weight_bytes(lm) -> int:
    """Bytes of a model's parameters (float or int8 ones and their scales) on its device."""
    import jax

    return sum(a.nbytes for a in jax.tree.leaves(lm.params))


def torch_from_jax(lm, compile: bool = False):
    """A ``TorchLM`` whose weights are the JAX model's arrays, shared through DLPack (no copy: on the
    GPU they stay in place; torch reads JAX's [in, out] matrices as transposed views of its
    [out, in] ``Linear`` weights, as the key table maps them)."""
    import torch

    from convert.keys import expected_keys
    from psd_jax.torch_backend.api import TorchLM
    from psd_jax.torch_backend.model import TORCH_DTYPES, model_from_torch_tensors

    jm, cfg = lm.model, lm.config
    targets = expected_keys(cfg)
    stacked: dict = {}

    def source(param: str, layer: int | None):
        if layer is not None and jm.unrolled:
            return torch.from_dlpack(jm.layers[layer][param][...])
        if param not in stacked:
            stacked[param] = torch.from_dlpack(getattr(jm, param)[...])
        return stacked[param] if layer is None else stacked[param][layer]

    def get(key: str):
        target = targets[key]
        value = source(target.param, target.layer)
        return value.T if target.transpose else value

    model = model_from_torch_tensors(cfg, get, TORCH_DTYPES[str(jm.dtype)])
    return TorchLM(model, None, lm.path, compile=compile)


def prompts(cfg, n: int, length: int, seed: int = 1) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids (no special ids), the same in every step and backend."""
    rng = np.random.default_rng(seed)
    special = {cfg.mask_id, cfg.eos_id, cfg.pad_id}
    vocab = np.array([t for t in range(min(cfg.vocab_size, 32000)) if t not in special])
    return [rng.choice(vocab, size=length).tolist() for _ in range(n)]


def settings_for(row: dict, prof: Profile):
    from psd_jax import DecodeConfig
    from psd_jax.cli.bench import decoder_matrix

    base = DecodeConfig(gen_length=prof.gen_length, block_length=prof.block_length)
    (settings,) = decoder_matrix(base, [f"{row['setting']}/{row['cache']}"]).values()
    return settings


# ------------------------------------------------------------------------------------ measuring


def error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def digest(results) -> str:
    """A short hash of a batch's generated ids (equal hashes: the same tokens)."""
    ids = np.asarray([r.output_ids for r in results], np.int64)
    return hashlib.sha1(ids.tobytes()).hexdigest()[:16]


def run_once(lm, settings, batch_prompts, bucket: int) -> dict:
    out = lm.generate(batch_prompts, settings, prompt_bucket=bucket)
    tokens, nfe = sum(r.tokens for r in out), sum(r.nfe for r in out)
    return {
        "seconds": out[0].seconds,
        "compile_seconds": out[0].compile_seconds,
        "tokens": tokens,
        "nfe": nfe,
        "sequence_forwards": out[0].sequence_forwards,
        "digest": digest(out),
    }


def summarise(runs: list[dict], n_prompts: int) -> dict:
    first = runs[0]
    rates = [r["tokens"] / r["seconds"] for r in runs]
    return {
        "tokens_per_second": statistics.median(rates),
        "tokens_per_second_all": rates,
        "seconds_all": [r["seconds"] for r in runs],
        "tokens": first["tokens"],
        "nfe_per_prompt": first["nfe"] / n_prompts,
        "tpf": first["tokens"] / max(first["nfe"], 1),
        "sequence_forwards": first["sequence_forwards"],
        "compile_seconds": first["compile_seconds"],
        "digest": first["digest"],
        "same_tokens_every_pass": len({r["digest"] for r in runs}) == 1,
    }


def measure_row(backends: dict, row: dict, prof: Profile, all_prompts, deadline: float) -> dict:
    """One row through every backend, in interleaved passes: the first pass compiles (JAX; torch.compile
    compiles in a run of its own that ``TorchLM.generate`` reports as compile time), later passes
    run while the row's timed decodes, all backends together, took less than ``row_seconds`` (at most
    ``max_passes``)."""
    began = time.perf_counter()
    out = {k: row[k] for k in ("key", "decoder", "setting", "cache", "batch")}
    try:
        settings = settings_for(row, prof)
    except Exception as exc:
        return {**out, "error": error_text(exc)}
    out["settings"] = dict(vars(settings))
    batch_prompts = all_prompts[: row["batch"]]
    runs: dict[str, list] = {name: [] for name in backends}
    errors: dict[str, str] = {}
    for n_pass in range(prof.max_passes):
        timed = sum(r["seconds"] for done in runs.values() for r in done)
        if n_pass and (timed > prof.row_seconds or time.time() > deadline):
            break
        for name, lm in backends.items():
            if name in errors:
                continue
            try:
                runs[name].append(run_once(lm, settings, batch_prompts, prof.prompt_length))
            except Exception as exc:  # out of memory, a compiler failure, ...
                errors[name] = error_text(exc)
                print(f"  {row['key']} {name}: {errors[name]}", file=sys.stderr)
                empty_device_cache()
    out["backends"] = {name: {"error": errors[name]} for name in errors}
    for name, done in runs.items():
        if done and name not in errors:
            out["backends"][name] = summarise(done, row["batch"])
    out["passes"] = max((len(v) for v in runs.values()), default=0)
    add_ratios(out, runs)
    out["seconds"] = time.perf_counter() - began
    return out


def add_ratios(out: dict, runs: dict) -> None:
    """JAX tokens/s over each other backend's: the median of the per-pass ratios; same tokens or not."""
    jax_row = out["backends"].get("jax", {})
    if "error" in jax_row or "jax" not in runs or not runs["jax"]:
        return
    for name, row in out["backends"].items():
        if name == "jax" or "error" in row:
            continue
        pairs = zip(runs["jax"], runs[name])
        row["jax_over_this"] = statistics.median(
            (j["tokens"] / j["seconds"]) / (t["tokens"] / t["seconds"]) for j, t in pairs
        )
        row["same_tokens_as_jax"] = row["digest"] == jax_row["digest"]


def empty_device_cache() -> None:
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ the steps


class Part:
    """A step's JSON, rewritten after every row so that a step cut short keeps what it finished."""

    def __init__(self, out: Path, step: str, prof: Profile):
        self.path = out / "parts" / f"{step}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = {"step": step, "profile": prof.name, "tiny": prof is TINY, "finished": False, "rows": []}
        self.began = time.perf_counter()
        self.write()

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        self.write()

    def write(self, **fields) -> None:
        self.data.update(fields, seconds=time.perf_counter() - self.began)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


def step_env(part: Part, prof: Profile, deadline: float) -> None:
    """Versions, devices, and a toy smoke test of both backends on the device."""
    import flax
    import jax
    import torch

    info = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "torch_cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "commit": os.environ.get("DEVICE_CHECK_COMMIT", ""),
        "peak_bf16_dense_tflops": (peak_flops() or 0) / 1e12 or None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(json.dumps(info, indent=1))
    part.write(info=info)
    # True float32 products in both (JAX's GPU default for float32 is TF32, torch's is float32).
    jax.config.update("jax_default_matmul_precision", "highest")
    lm = jax_model(TINY)
    smoke = measure_row(
        {"jax": lm}, rows(TINY)[0], dataclasses.replace(TINY, max_passes=1), prompts(lm.config, 1, 32), deadline
    )
    part.add(smoke)
    if "error" in smoke or "error" in smoke["backends"]["jax"]:  # the machine's packages cannot run the engine
        raise SystemExit(f"smoke test failed: {smoke}")
    print(f"smoke test: toy JAX decode {smoke['backends']['jax']['tokens_per_second']:.1f} tokens/s")
    part.write(torch_smoke=torch_smoke(lm))
    print(f"torch smoke test: {part.data['torch_smoke']}")


def torch_smoke(lm) -> dict:
    """The PyTorch model on the JAX model's weights (DLPack) against JAX's logits, relative to their scale.
    Recorded, not fatal: the JAX steps are worth running whatever torch does."""
    try:
        ids = np.asarray(prompts(lm.config, 2, 32))
        ours = torch_from_jax(lm).logits(ids).float().cpu().numpy()
        theirs = np.asarray(lm.logits(ids))
        diff = float(np.abs(theirs - ours).max() / np.abs(theirs).max())
        return {"logits_max_rel_diff": diff, "ok": diff < 1e-4}
    except Exception as exc:
        return {"error": error_text(exc), "ok": False}


def peak_flops() -> float | None:
    import jax

    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]) * 1e12
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16_DENSE_FLOPS.items() if k in kind), None)


def step_forward(part: Part, prof: Profile, deadline: float) -> None:
    import jax
    from flax import nnx

    lm = jax_model(prof)
    cfg, peak = lm.config, peak_flops()
    fwd = jax.jit(lambda params, ids: nnx.merge(lm.graphdef, params)(ids))
    part.write(peak_flops=peak, device_kind=jax.devices()[0].device_kind, params=cfg.param_count())
    for batch, length in prof.forward_shapes:
        if time.time() > deadline:
            part.add({"shape": [batch, length], "skipped": "step deadline"})
            continue
        ids = jax.random.randint(jax.random.key(batch), (batch, length), 0, min(cfg.vocab_size, 32000))
        began = time.perf_counter()
        compiled = fwd.lower(lm.params, ids).compile()
        compile_seconds = time.perf_counter() - began
        jax.block_until_ready(compiled(lm.params, ids))  # warm-up
        times = []
        for _ in range(prof.forward_repeats):
            began = time.perf_counter()
            jax.block_until_ready(compiled(lm.params, ids))
            times.append(time.perf_counter() - began)
        flops, seconds = forward_flops(cfg, batch, length), statistics.median(times)
        part.add(
            {
                "shape": [batch, length],
                "tokens": batch * length,
                "compile_seconds": compile_seconds,
                "seconds": seconds,
                "seconds_all": times,
                "flops": flops,
                "xla_flops": xla_flops(compiled),
                "tflops_per_second": flops["total"] / seconds / 1e12,
                "mfu": None if peak is None else flops["total"] / seconds / peak,
            }
        )
        print(f"forward {batch} x {length}: {1e3 * seconds:.2f} ms, {flops['total'] / seconds / 1e12:.1f} TFLOP/s")


def xla_flops(compiled) -> float | None:
    """XLA's own FLOP count of the compiled forward, where it gives one (it counts a ``lax.scan``'s body,
    one layer, once: a check on the head and one layer of ``forward_flops``, not on the total)."""
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])
    except Exception:
        return None


def decode_step(part: Part, prof: Profile, deadline: float, backends: dict, selected: list[dict]) -> None:
    cfg = next(iter(backends.values())).config
    all_prompts = prompts(cfg, max(prof.batches), prof.prompt_length)
    for row in selected:
        if time.time() > deadline:
            part.add({**row, "skipped": "step deadline"})
            continue
        result = measure_row(backends, row, prof, all_prompts, deadline)
        part.add(result)
        print(row_line(result), flush=True)


def row_line(result: dict) -> str:
    cells = []
    for name, b in result.get("backends", {}).items():
        if "error" in b:
            cells.append(f"{name} failed: {b['error']}")
        else:
            ratio = f" (JAX/this {b['jax_over_this']:.2f}x)" if "jax_over_this" in b else ""
            cells.append(f"{name} {b['tokens_per_second']:.1f} tok/s, TPF {b['tpf']:.2f}{ratio}")
    return f"{result['key']}: " + ("; ".join(cells) or result.get("error", ""))


def step_jax_decode(part: Part, prof: Profile, deadline: float) -> None:
    decode_step(part, prof, deadline, {"jax": jax_model(prof)}, rows(prof))


def step_torch(part: Part, prof: Profile, deadline: float) -> None:
    lm = jax_model(prof)
    eager = torch_from_jax(lm)
    warm_torch(eager, lm.config)
    decode_step(part, prof, deadline, {"jax": lm, "torch": eager}, rows(prof))


def step_torch_compile(part: Part, prof: Profile, deadline: float) -> None:
    import torch

    if prof is TINY:  # dynamo's tracing, graphs run eagerly: inductor's C++ compile takes minutes on 2 cores
        torch.compile = functools.partial(torch.compile, backend="eager")
        part.write(torch_compile_backend="eager")
    lm = jax_model(prof)
    eager = torch_from_jax(lm)
    warm_torch(eager, lm.config)
    backends = {"jax": lm, "torch": eager, "torch.compile": torch_from_jax(lm, compile=True)}
    decode_step(part, prof, deadline, backends, rows(prof)[: prof.compile_rows])


def step_int8(part: Part, prof: Profile, deadline: float) -> None:
    lm = jax_model(prof)
    int8 = quantized_model(lm, "int8")
    part.write(weight_bytes={prof.dtype: weight_bytes(lm), "int8": weight_bytes(int8)})
    selected = [row for row in rows(prof) if row["key"] in prof.int8_rows]
    decode_step(part, prof, deadline, {"jax": lm, "jax int8": int8}, selected)


def warm_torch(tlm, cfg) -> None:
    """One forward, so that CUDA's and cuBLAS's start-up is not counted in the first row."""
    tlm.logits(np.asarray(prompts(cfg, 1, 32)))
    empty_device_cache()


def setup(prof: Profile) -> None:
    """Process settings read before JAX or torch start: XLA flags, the compilation cache, threads."""
    if prof is TINY and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TINY_XLA_FLAGS}".strip()
    import jax

    cache = os.environ.get("DEVICE_CHECK_CACHE")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if prof is TINY:
        import torch

        torch.set_num_threads(1)  # two threads on a busy 2-core machine spin: the toy runs 70x slower


STEP_FUNCTIONS = {
    "env": step_env,
    "forward": step_forward,
    "jax_decode": step_jax_decode,
    "torch": step_torch,
    "torch_compile": step_torch_compile,
    "int8": step_int8,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=STEPS)
    p.add_argument("--out", required=True, help="output directory (the step writes parts/STEP.json)")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds: start no row after this")
    args = p.parse_args(argv)
    prof = profile()
    deadline = time.time() + args.deadline
    setup(prof)
    part = Part(Path(args.out), args.step, prof)
    try:
        STEP_FUNCTIONS[args.step](part, prof, deadline)
    except BaseException as exc:
        part.write(error=error_text(exc), traceback=traceback.format_exc()[-4000:])
        raise
    part.write(finished=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
