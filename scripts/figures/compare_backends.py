"""Side-by-side throughput of the JAX engine and the PyTorch backend, decoder by decoder.

For each decoder the same prompts, batches and settings go through every backend in one run:

- ``jax``: ``psd_jax.load_model(...).generate`` (one compiled ``lax.while_loop``; on a CPU the
  layers unrolled over per-layer weight arrays, ``load_model``'s default there);
- ``jax-scan`` (``--jax-scan``): the same with the layers run by ``lax.scan`` over stacked weights
  (the default on GPU/TPU), to show what the layout is worth in the same run;
- ``torch``: ``psd_jax.torch_backend`` eager (``torch.inference_mode``, one batched forward per
  iteration, Python loop over iterations);
- ``torch.compile`` (``--compile``): the same with the forward + prediction ``torch.compile``d.

Protocol: each backend first runs every batch once untimed (JAX: compile + warm-up run, whose
compile time is reported; torch: warm-up; torch.compile: compilation happens in this pass and its
wall time is reported as compile time). Then ``--repeats`` timed passes over all batches, the
backends interleaved within each pass (so load from other processes hits all of them alike);
reported numbers use the median pass. Tokens are counted as the project does (generated tokens
before the first EOS/EOT), and the tokens of every backend are compared with JAX's.

Models: the shipped default model (``--model``, default ``models/default`` when it has been trained;
skipped otherwise) and/or a randomly initialised LLaDA-shaped model (``--random-llada``), written
once as a Hugging Face directory in a temp dir and loaded by both backends through their normal
loaders, so both run identical float32 weights.

Runs unchanged on a GPU: JAX uses its default backend, torch uses CUDA when available.

Run from the repository root (``python scripts/figures/compare_backends.py`` works too where psd-jax is
installed). Example (the CPU measurement of docs/xla-vs-pytorch.md, an 8-layer d_model-1024 random
LLaDA, about 25 minutes per dtype on 2 cores)::

    python -m scripts.figures.compare_backends --no-default-model --random-llada --layers 8 --d-model 1024 \\
        --gen-length 256 --block-length 32 --prompts 1 --repeats 3 --no-compile --dtype bfloat16 \\
        --out compare.json

``--cache prefix|dual`` runs every decoder with Fast-dLLM's block KV cache in both backends (the
same tokens and call counts in float32); the JSON's ``meta`` and every decoder's settings record it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DECODERS = ("fixed", "threshold", "psd", "rps")
# --matmul-precision: (jax_default_matmul_precision, torch.set_float32_matmul_precision) per choice.
MATMUL_PRECISION = {"float32": ("highest", "highest"), "tf32": ("tensorfloat32", "high")}


def decoder_settings(name: str, args):
    from psd_jax import DecodeConfig

    base = DecodeConfig(gen_length=args.gen_length, block_length=args.block_length, cache=args.cache)
    threshold = {"policy": "threshold", "threshold": args.threshold}
    table = {
        "fixed": {"policy": "fixed", "steps": args.steps or args.gen_length},
        "threshold": threshold,
        "psd": {**threshold, "decoder": "psd", "depth": args.depth},
        "rps": {**threshold, "decoder": "rps", "k_max": args.k_max},
    }
    if name not in table:
        raise SystemExit(f"unknown decoder {name!r}; choose from {', '.join(DECODERS)}")
    return base.replace(**table[name])


# ------------------------------------------------------------------------------------ models


def random_llada_config(args):
    """The LLaDA-shaped config of ``--layers/--d-model/--heads/--kv-heads/--mlp/--vocab``."""
    from models import ModelConfig

    return ModelConfig(
        family="llada",
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads or args.heads,
        mlp_hidden=args.mlp or int(args.d_model * 8 / 3) // 64 * 64,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_length=4096,
        mask_id=args.vocab - 2,
        eos_id=args.vocab - 1,
        pad_id=args.vocab - 1,
    )


def write_random_llada(out: Path, args) -> Path:
    """A random LLaDA-shaped Hugging Face directory (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    from convert.export import llada_config_dict
    from convert.keys import expected_keys

    cfg = random_llada_config(args)
    rng = np.random.default_rng(args.seed)
    tensors = {}
    for key, target in expected_keys(cfg).items():
        if target.param.endswith("norm"):
            tensors[key] = np.ones(target.source_shape, np.float32)
        else:
            std = args.head_std if target.param == "lm_head" else 0.02
            tensors[key] = (std * rng.standard_normal(target.source_shape, dtype=np.float32)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(llada_config_dict(cfg), indent=1))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def prompts_for(path: Path, lm, args, random_model: bool) -> tuple[list, bool]:
    """Token-id prompts: random ids for the random model, held-out questions for a real one."""
    n = args.prompts
    if random_model or lm.tokenizer is None:
        rng = np.random.default_rng(args.seed + 1)
        special = {lm.config.mask_id, lm.config.eos_id, lm.config.pad_id}
        vocab = [t for t in range(min(lm.config.vocab_size, 4096)) if t not in special]
        return [rng.choice(vocab, size=args.prompt_length).tolist() for _ in range(n)], False
    from psd_jax.scoring import load_jsonl

    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    questions = [ex["question"] for ex in load_jsonl(path / "test.jsonl")[:n]]
    return [lm.encode(q, chat) for q in questions], True


# --------------------------------------------------------------------------------- measuring


def _sync(out):
    if hasattr(out, "block_until_ready"):
        out.block_until_ready()
    elif getattr(out, "is_cuda", False):
        import torch

        torch.cuda.synchronize()
    return out


class Backend:
    """One backend's runs of one decoder: warm-up, timed passes, optional forward replays."""

    def __init__(self, name: str, lm):
        self.name, self.lm = name, lm
        self.compile_seconds = 0.0
        self.warmup_seconds = 0.0
        self.passes: list[float] = []
        self.forward_passes: list[float] = []
        self.outputs: list[list[int]] = []
        self.nfe = 0
        self.calls: list[tuple[int, int]] = []  # per batch: ([B, N] calls, [B*K, N] calls)
        self.tokens = 0
        self.sequence_forwards = 0
        self.error: str | None = None

    def run_pass(self, batches, settings, bucket) -> tuple[float, list]:
        seconds, results = 0.0, []
        for batch in batches:
            out = self.lm.generate(batch, settings, prompt_bucket=bucket)
            seconds += out[0].seconds
            self.compile_seconds += out[0].compile_seconds
            results.append(out)
        return seconds, results

    def record(self, results, k: int) -> None:
        flat = [r for out in results for r in out]
        self.outputs = [r.output_ids for r in flat]
        self.nfe = sum(r.nfe for r in flat)
        self.tokens = sum(r.tokens for r in flat)
        self.sequence_forwards = sum(out[0].sequence_forwards for out in results)
        for out in results:
            # Model calls = the longest row's NFE; each is [B, N] (first call, s0-only calls) or
            # [B*K, N] (full calls), recovered from the sequence count.
            calls, b = max(r.nfe for r in out), len(out)
            full = 0 if k == 1 else (out[0].sequence_forwards - b * calls) // (b * (k - 1))
            self.calls.append((calls - full, full))

    def replay_forwards(self, batches, settings, bucket) -> float:
        """Wall time of a pass's model calls alone: the same number of bare forwards (logits only,
        no prediction) at the same shapes."""
        from psd_jax.core.decoders import decoder_for

        seconds = 0.0
        for batch, (narrow, full) in zip(batches, self.calls):
            n = max(len(p) for p in batch)
            n = (-(-n // bucket) * bucket if bucket else n) + settings.gen_length
            rng = np.random.default_rng(0)
            vocab = min(self.lm.config.vocab_size, 4096) - 16
            small = rng.integers(0, vocab, (len(batch), n))
            wide = rng.integers(0, vocab, (len(batch) * decoder_for(settings).branches, n))
            start = time.perf_counter()
            for ids in [small] * narrow + [wide] * full:
                _sync(self.lm.logits(ids))
            seconds += time.perf_counter() - start
        return seconds


def measure(decoder: str, settings, backends: dict, batches, args) -> dict:
    from psd_jax.core.decoders import decoder_for

    n_prompts = sum(len(b) for b in batches)
    everyone = {}
    for name, lm in backends.items():
        b = everyone[name] = Backend(name, lm)
        start = time.perf_counter()
        try:
            _, results = b.run_pass(batches, settings, args.prompt_bucket)  # compile / warm-up
        except Exception as exc:  # torch.compile without a working toolchain, out of memory, ...
            b.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"  {name}: failed: {b.error}", file=sys.stderr)
            continue
        b.warmup_seconds = time.perf_counter() - start
        b.record(results, decoder_for(settings).branches)
        if args.breakdown and name != "torch.compile":
            b.replay_forwards(batches, settings, args.prompt_bucket)  # warm the bare forward's shapes
        print(f"  {name}: warm-up {b.warmup_seconds:.1f}s (compile {b.compile_seconds:.1f}s)", file=sys.stderr)
    ok = [b for b in everyone.values() if b.error is None]
    for rep in range(args.repeats):
        # Interleaved, so that load from other processes hits every backend alike; a forward replay
        # runs right after its backend's pass for the same reason.
        for b in ok:
            b.passes.append(b.run_pass(batches, settings, args.prompt_bucket)[0])
            if args.breakdown and b.name != "torch.compile":
                b.forward_passes.append(b.replay_forwards(batches, settings, args.prompt_bucket))
        print(
            f"  pass {rep + 1}: "
            + ", ".join(
                f"{b.name} {b.passes[-1]:.2f}s"
                + (f" (model forwards {b.forward_passes[-1]:.2f}s)" if b.forward_passes else "")
                for b in ok
            ),
            file=sys.stderr,
        )
    rows = backend_rows(everyone, len(batches), n_prompts)
    return {"decoder": decoder, "settings": dict(vars(settings)), "backends": rows}


def backend_rows(everyone: dict, n_batches: int, n_prompts: int) -> dict:
    """Per backend: its timings (medians of the passes), counts, and its speed against JAX's,
    paired pass by pass; or the error it failed with."""
    ref = everyone.get("jax")
    ref = ref if ref is not None and ref.error is None else None
    rows = {}
    for b in everyone.values():
        if b.error is not None:
            rows[b.name] = {"error": b.error}
            continue
        median = statistics.median(b.passes)
        row = {
            "seconds_median": median,
            "seconds_all": b.passes,
            "tokens": b.tokens,
            "tokens_per_second": b.tokens / median,
            "latency_per_batch_s": median / n_batches,
            "latency_per_prompt_s": median / n_prompts,
            "nfe_per_prompt": b.nfe / n_prompts,
            "sequence_forwards": b.sequence_forwards,
            "calls_narrow_full": b.calls,
            "compile_seconds": b.compile_seconds,
            "warmup_seconds": b.warmup_seconds,
            "same_tokens_as_jax": None if ref is None else b.outputs == ref.outputs,
        }
        if ref is not None and b is not ref:
            # JAX throughput / this backend's, paired pass by pass (same moment, same load).
            row["jax_speedup_paired"] = statistics.median(t / j for t, j in zip(b.passes, ref.passes))
            row["jax_speedup_of_medians"] = median / statistics.median(ref.passes)
        if b.forward_passes:
            row["forward_seconds_all"] = b.forward_passes
            row["forward_share_median"] = statistics.median(f / t for f, t in zip(b.forward_passes, b.passes))
        rows[b.name] = row
    return rows


def markdown(title: str, results: list[dict]) -> str:
    lines = [
        f"**{title}**\n",
        "| decoder | backend | tokens/s | latency/prompt s | NFE/prompt | seq. fwd | compile s | warm-up s "
        "| same tokens | JAX / this | model fwd share |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: |",
    ]
    for res in results:
        for name, row in res["backends"].items():
            if "error" in row:
                lines.append(f"| {res['decoder']} | {name} | failed: {row['error']} | | | | | | | | |")
                continue
            same = {True: "yes", False: "NO", None: "-"}[row["same_tokens_as_jax"]]
            rel = f"{row['jax_speedup_paired']:.2f}x" if "jax_speedup_paired" in row else ""
            fwd = f"{100 * row['forward_share_median']:.0f}%" if "forward_share_median" in row else ""
            lines.append(
                f"| {res['decoder']} | {name} | {row['tokens_per_second']:.2f} | {row['latency_per_prompt_s']:.3f} | "
                f"{row['nfe_per_prompt']:.1f} | {row['sequence_forwards']} | {row['compile_seconds']:.1f} | "
                f"{row['warmup_seconds']:.1f} | {same} | {rel} | {fwd} |"
            )
    lines.append(
        "\nJAX / this: JAX tokens/s over this backend's, median of the per-pass ratios (passes interleaved). "
        "model fwd share: time of the same model calls replayed as bare forwards / decode time."
    )
    return "\n".join(lines) + "\n"


def run_model(label: str, path: Path, args, random_model: bool) -> dict:
    import torch

    import psd_jax
    from psd_jax.torch_backend import load_torch_model

    print(f"[{label}] loading {path}", file=sys.stderr)
    backends = {"jax": psd_jax.load_model(path, dtype=args.dtype)}
    if args.jax_scan:
        backends["jax-scan"] = psd_jax.load_model(path, dtype=args.dtype, unroll_layers=False)
    backends["torch"] = load_torch_model(path, args.dtype, device=args.torch_device)
    if args.compile:
        backends["torch.compile"] = load_torch_model(path, args.dtype, device=args.torch_device, compile=True)
    prompts, _ = prompts_for(path, backends["jax"], args, random_model)
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    cfg = backends["jax"].config
    results = []
    for decoder in args.decoders:
        settings = decoder_settings(decoder, args)
        print(f"[{label}] {decoder}: {settings.decoder}/{settings.policy}, {len(prompts)} prompts", file=sys.stderr)
        results.append(measure(decoder, settings, backends, batches, args))
        # Each decoder's rows as soon as they are measured, so a run cut short keeps what it finished.
        print(markdown(f"[{label}] {decoder} done", results[-1:]), file=sys.stderr, flush=True)
    return {
        "label": label,
        "path": str(path),
        "model": {
            "family": cfg.family,
            "layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "heads": cfg.n_heads,
            "kv_heads": cfg.n_kv_heads,
            "mlp": cfg.mlp_hidden,
            "vocab": cfg.vocab_size,
            "params": cfg.param_count(),
        },
        "prompts": len(prompts),
        "prompt_lengths": sorted({len(p) for p in prompts}),
        "batch": args.batch,
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: models/default when it has been trained)")
    p.add_argument("--no-default-model", action="store_true", help="do not benchmark the shipped model")
    add_random_model_flags(p)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument(
        "--cache",
        default="none",
        choices=["none", "prefix", "dual"],
        help="block KV cache of every decoder, in both backends (Fast-dLLM's prefix or dual cache)",
    )
    p.add_argument("--steps", type=int, help="fixed: total steps (default gen_length: 1 token per step)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--depth", type=int, default=3, help="PSD depth D")
    p.add_argument("--k-max", type=int, default=10, help="RPS k_max")
    p.add_argument("--decoders", default=",".join(DECODERS), help=f"comma-separated subset of {','.join(DECODERS)}")
    p.add_argument("--prompts", type=int, default=4, help="number of prompts")
    p.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    p.add_argument("--prompt-length", type=int, default=32, help="random model: prompt length in tokens")
    p.add_argument("--prompt-bucket", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed passes (the median is reported)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="also run the torch.compile variant"
    )
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for both backends: torch.set_num_threads and XLA's intra-op pool "
        "(default: each library's default, all cores)",
    )
    p.add_argument(
        "--jax-scan",
        action="store_true",
        help="also run JAX with the layers in a lax.scan over stacked weights (its GPU/TPU layout)",
    )
    p.add_argument("--torch-device", help="default: cuda when available, else cpu")
    p.add_argument(
        "--matmul-precision",
        default="float32",
        choices=list(MATMUL_PRECISION),
        help="float32 matrix products in both backends: true float32 (default; JAX's own GPU default "
        "is TF32 while torch's is float32, so leaving each at its default compares unlike work) "
        "or TF32 tensor cores in both. No effect on CPU or on bfloat16 weights",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="after each timed pass, replay its model calls as bare forwards (same count and shapes) "
        "and report the share of decode time spent in the model",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write all results as JSON here")
    return p


def add_random_model_flags(p: argparse.ArgumentParser) -> None:
    """The random LLaDA-shaped model's flags (``--random-llada``)."""
    p.add_argument("--random-llada", action="store_true", help="also benchmark a random LLaDA-shaped model")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, help="default: --heads")
    p.add_argument("--mlp", type=int, help="MLP hidden size (default: 8/3 d_model, rounded to 64)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument(
        "--head-std",
        type=float,
        default=0.5,
        help="std of the random LM head: larger = more confident predictions (0.5 at d_model 1024: "
        "threshold 0.9 commits ~2 tokens per forward, PSD accepts drafts, RPS finds pivots; "
        "0.02 = near-uniform)",
    )
    p.add_argument("--random-dir", help="keep the random model here instead of a temp dir")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    if args.threads:  # read when XLA's CPU client starts, so set before the first JAX computation
        flags = "--xla_cpu_multi_thread_eigen=false" if args.threads == 1 else ""
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} {flags} intra_op_parallelism_threads={args.threads}".strip()
        )
    for d in args.decoders:
        decoder_settings(d, args)  # fail early on a bad name or bad settings
    if args.breakdown and args.cache != "none":
        # The replay forwards whole canvases; a cached decode's calls are mostly windows.
        raise SystemExit("--breakdown replays uncached forwards only: use it with --cache none")

    import jax
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    jax_precision, torch_precision = MATMUL_PRECISION[args.matmul_precision]
    jax.config.update("jax_default_matmul_precision", jax_precision)
    torch.set_float32_matmul_precision(torch_precision)
    tmp = tempfile.TemporaryDirectory(prefix="random-llada-") if args.random_llada and not args.random_dir else None
    models = models_to_run(args, None if tmp is None else Path(tmp.name))
    if not models:
        print("nothing to benchmark: pass --model, --random-llada, or train the shipped model", file=sys.stderr)
        return 2
    report = {"meta": run_meta(args, argv), "models": []}
    try:
        for label, path, random_model in models:
            res = run_model(label, path, args, random_model)
            report["models"].append(res)
            print(markdown(table_title(label, res, args), res["results"]), flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def table_title(label: str, res: dict, args) -> str:
    m = res["model"]
    precision = f" (matmuls {args.matmul_precision})" if args.dtype == "float32" else ""  # bf16: n/a
    return (
        f"{label}: {m['params'] / 1e6:.1f}M params, {args.dtype}{precision}, "
        f"gen {args.gen_length}, block {args.block_length}, cache {args.cache}, "
        f"{res['prompts']} prompts x batch {args.batch}, median of {args.repeats}, "
        f"torch threads {res['torch_threads']}"
    )


def models_to_run(args, tmp_dir: Path | None) -> list[tuple[str, Path, bool]]:
    """(label, directory, is random) of each model to compare; the random one is written on first use."""
    from psd_jax.model_dir import DEFAULT_MODEL_DIR

    models: list[tuple[str, Path, bool]] = []
    if args.model:
        models.append((Path(args.model).name, Path(args.model), False))
    elif not args.no_default_model:
        if (DEFAULT_MODEL_DIR / "config.json").is_file():
            models.append(("shipped default model", DEFAULT_MODEL_DIR, False))
        else:
            print("shipped default model not trained yet (models/default has no config.json): skipped", file=sys.stderr)
    if args.random_llada:
        rdir = Path(args.random_dir) if args.random_dir else tmp_dir
        if not (rdir / "config.json").is_file():
            write_random_llada(rdir, args)
        models.append(
            (f"random LLaDA-shaped ({args.layers} layers, d_model {args.d_model}, vocab {args.vocab})", rdir, True)
        )
    return models


def run_meta(args, argv) -> dict:
    import jax
    import torch

    return {
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "argv": sys.argv[1:] if argv is None else argv,
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "torch": torch.__version__,
        "torch_device": args.torch_device or ("cuda" if torch.cuda.is_available() else "cpu"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "threads": args.threads,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "matmul_precision": args.matmul_precision,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gen_length": args.gen_length,
        "block_length": args.block_length,
        "cache": args.cache,
    }


if __name__ == "__main__":
    sys.exit(main())
