"""DiffusionGemma decoding: psd-jax's compiled sampler against transformers' ``generate`` (torch
eager, the ``torch`` extra) on the same weights, prompts and settings, timed in one process.

Adaptive stopping is off, so both make exactly N denoiser calls per canvas and the same number of
canvases: the work is equal whatever the draws, and the seconds compare like for like (each side
draws its own random ids; decoding with upstream's recorded draws is exact, see
tests/decoding/test_entropy_bound.py). Each side decodes once to warm up (psd-jax compiles then),
then the two alternate ``--runs`` times so the machine's drift falls on both; reported: each
side's median seconds, generated positions per second, and the median and range of the per-run
ratios.

    python -m scripts.figures.diffusion_gemma_speed [--shape tiny|100m] [--batch 1] [--runs 5]

``tiny`` is the golden checkpoint (tests' ``diffusion-gemma-tiny``); ``100m`` a random model of
about 100M parameters with DiffusionGemma's layout (8 layers, 5 sliding : 1 full, the last full, 16
experts top-2), made by transformers from its config and converted with ``convert.diffusion_gemma``.
Figures: docs/diffusion-gemma.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

from convert.diffusion_gemma import from_mapping
from models.diffusion_gemma import DiffusionGemma
from models.diffusion_gemma_config import DiffusionGemmaConfig
from psd_jax.cli.flags import positive_int
from psd_jax.core.entropy_bound import Draws, EntropyBoundSettings, decode

TINY = Path(__file__).resolve().parents[2].parent / "shared" / "goldens" / "diffusion-gemma-tiny"


def config_100m(tiny: dict) -> dict:
    """The tiny checkpoint's config with about 100M parameters' shapes."""
    text = dict(tiny["text_config"])
    text.update(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_global_key_value_heads=1, global_head_dim=128, intermediate_size=1024, num_experts=16,
        top_k_experts=2, moe_intermediate_size=256, vocab_size=32000, sliding_window=128,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] + ["full_attention"],
    )  # fmt: skip
    return {**tiny, "text_config": text, "image_token_id": 31999, "boi_token_id": 31997, "eoi_token_id": 31998}


def upstream_model(raw: dict, weights: Path | None):
    """transformers' model in float32 eval mode: the checkpoint's weights, or random ones."""
    import torch
    from transformers import DiffusionGemmaConfig as HFConfig
    from transformers import DiffusionGemmaForBlockDiffusion

    if weights is not None:
        return DiffusionGemmaForBlockDiffusion.from_pretrained(weights, dtype=torch.float32).eval()
    torch.manual_seed(0)
    return DiffusionGemmaForBlockDiffusion(HFConfig.from_dict(raw)).to(torch.float32).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "100m"), default="tiny")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--runs", type=positive_int, default=5)
    parser.add_argument("--steps", type=positive_int, default=16, help="max_denoising_steps (N)")
    parser.add_argument("--gen-length", type=positive_int, default=64, help="max_new_tokens")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(torch.get_num_threads())
    tiny = json.loads((TINY / "config.json").read_text())
    raw = tiny if args.shape == "tiny" else config_100m(tiny)
    hf = upstream_model(raw, TINY if args.shape == "tiny" else None)
    cfg = DiffusionGemmaConfig.from_dict({**raw, "eos_token_id": [1, 106]})
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    params = sum(p.numel() for n, p in hf.named_parameters() if "vision" not in n)

    settings = EntropyBoundSettings(
        gen_length=args.gen_length, max_denoising_steps=args.steps, stability_threshold=None, confidence_threshold=None
    )
    positions = args.batch * settings.canvases(cfg.canvas_length) * cfg.canvas_length
    rng = np.random.default_rng(0)
    prompt = np.concatenate([np.full((args.batch, 1), 2), rng.integers(3, 500, (args.batch, 31))], axis=1)
    valid = np.ones_like(prompt, bool)
    # Equal work: an end-of-sequence id outside the vocabulary on both sides, so no row ends early
    # (each side's own draws would end rows at different canvases).
    never = cfg.vocab_size
    ours_cfg = dataclasses.replace(cfg, eos_ids=(never,))
    ours = DiffusionGemma.from_params(ours_cfg, from_mapping(state, cfg))

    def run_ours(seed: int) -> float:
        start = time.perf_counter()
        out = decode(ours, prompt, valid, settings, Draws.from_seed([seed + r for r in range(args.batch)]))
        assert out.nfe == settings.canvases(cfg.canvas_length) * args.steps
        return time.perf_counter() - start

    def run_upstream(seed: int) -> float:
        torch.manual_seed(seed)
        ids = torch.tensor(prompt)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.tensor(valid), max_new_tokens=args.gen_length,
                max_denoising_steps=args.steps, stability_threshold=None, confidence_threshold=None,
                eos_token_id=[never], pad_token_id=0,
            )  # fmt: skip
        assert out.sequences.shape[1] == prompt.shape[1] + positions // args.batch
        return time.perf_counter() - start

    compile_s = run_ours(0)
    run_upstream(0)
    pairs = [(run_ours(r + 1), run_upstream(r + 1)) for r in range(args.runs)]
    ours_s = statistics.median(p[0] for p in pairs)
    up_s = statistics.median(p[1] for p in pairs)
    ratios = sorted(u / o for o, u in pairs)
    report = {
        "shape": args.shape,
        "text_parameters": params,
        "batch": args.batch,
        "settings": {"max_new_tokens": args.gen_length, "max_denoising_steps": args.steps, "adaptive_stopping": False},
        "first_call_seconds_psd_jax": round(compile_s, 3),
        "psd_jax_seconds": round(ours_s, 4),
        "transformers_seconds": round(up_s, 4),
        "psd_jax_positions_per_s": round(positions / ours_s, 1),
        "transformers_positions_per_s": round(positions / up_s, 1),
        "speedup_median": round(statistics.median(ratios), 2),
        "speedup_range": [round(ratios[0], 2), round(ratios[-1], 2)],
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
