"""Export DiffusionGemma weights in psd-jax's parameter layout, for DeepMind's gemma loader.

Runs in psd-jax's venv (it imports psd-jax's converter and model; it modifies nothing there):

    python scripts/peers/deepmind_gemma/export_weights.py --shape tiny
    python scripts/peers/deepmind_gemma/export_weights.py --shape 100m

Writes build/peers/weights/<shape>/:
  params.npz       psd-jax's parameters by ``models.diffusion_gemma.param_shapes`` name, float32
                   (``convert.diffusion_gemma.read_params`` / ``from_mapping`` output, unchanged)
  config.json      the Hugging Face config the weights are for (tiny: the checkpoint's; 100m:
                   ``scripts.figures.diffusion_gemma_speed.config_100m`` of it)
  psd_config.json  psd-jax's ``DiffusionGemmaConfig`` of it (what the loader builds DeepMind's
                   ``TransformerConfig`` from)
  reference.npz    one encoder call + denoiser calls of psd-jax on fixed inputs, for the forward
                   comparison: input_ids, position_ids, canvas, decoder_position_ids,
                   sc_logits, psd_logits_nosc, psd_logits_sc (and, for tiny, transformers' own
                   logits from the golden case ``forward_single``: hf_logits_nosc, hf_logits_sc)

tiny: ../shared/goldens/diffusion-gemma-tiny through ``read_params``. 100m: transformers'
``DiffusionGemmaForBlockDiffusion`` built from ``config_100m`` after ``torch.manual_seed(0)`` (as
psd-jax's speed script does), its state dict through ``from_mapping``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

TINY = Path(__file__).resolve().parents[3].parent / "shared" / "goldens" / "diffusion-gemma-tiny"
GOLDEN_CASES = Path(__file__).resolve().parents[3].parent / "shared" / "goldens" / "diffusion_gemma_cases.safetensors"
OUT = Path(__file__).resolve().parents[3] / "build" / "peers" / "weights"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("tiny", "100m"), required=True)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from convert.diffusion_gemma import from_mapping, read_params
    from models.diffusion_gemma import DiffusionGemma
    from models.diffusion_gemma_config import DiffusionGemmaConfig

    tiny_raw = json.loads((TINY / "config.json").read_text())
    if args.shape == "tiny":
        raw = tiny_raw
        cfg = DiffusionGemmaConfig.from_dict(raw)
        params = read_params(TINY, cfg)
    else:
        import torch
        from transformers import DiffusionGemmaConfig as HFConfig
        from transformers import DiffusionGemmaForBlockDiffusion

        from scripts.figures.diffusion_gemma_speed import config_100m

        raw = config_100m(tiny_raw)
        cfg = DiffusionGemmaConfig.from_dict(raw)
        torch.manual_seed(0)
        hf = DiffusionGemmaForBlockDiffusion(HFConfig.from_dict(raw)).to(torch.float32).eval()
        state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
        params = from_mapping(state, cfg)
        del hf, state

    out = OUT / args.shape
    out.mkdir(parents=True, exist_ok=True)
    params = {k: np.asarray(v, np.float32) for k, v in params.items()}
    np.savez(out / "params.npz", **params)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    (out / "psd_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))

    # Reference forward: one encoder call on a prompt, then the denoiser's first step (no
    # self-conditioning) and a self-conditioned step, on one canvas.
    model = DiffusionGemma.from_params(cfg, params)
    ref: dict[str, np.ndarray] = {}
    if args.shape == "tiny":
        from safetensors.numpy import load_file

        case = {
            k.split(".forward_single.", 1)[1]: v for k, v in load_file(GOLDEN_CASES).items() if ".forward_single." in k
        }
        ids, canvas = case["input_ids"], case["canvas"]
        sc = case["self_conditioning_logits"]
        ref["hf_logits_nosc"], ref["hf_logits_sc"] = case["logits_nosc"], case["logits_sc"]
    else:
        rng = np.random.default_rng(0)
        ids = np.concatenate([[[2]], rng.integers(3, cfg.vocab_size, (1, 31))], axis=1)
        canvas = rng.integers(0, cfg.vocab_size, (1, cfg.canvas_length))
        sc = rng.normal(0.0, 3.0, (1, cfg.canvas_length, cfg.vocab_size)).astype(np.float32)
    n, c = ids.shape[1], canvas.shape[1]
    pos = np.arange(n)[None]
    dpos = np.arange(n, n + c)[None]
    _, cache = model.encode(jnp.asarray(ids), jnp.asarray(pos), jnp.ones(ids.shape, bool))
    ref["psd_logits_nosc"] = np.asarray(model.denoise(jnp.asarray(canvas), jnp.asarray(dpos), cache))
    ref["psd_logits_sc"] = np.asarray(
        model.denoise(jnp.asarray(canvas), jnp.asarray(dpos), cache, jax.nn.softmax(jnp.asarray(sc), axis=-1))
    )
    ref.update(
        input_ids=np.asarray(ids, np.int32), position_ids=pos.astype(np.int32),
        canvas=np.asarray(canvas, np.int32), decoder_position_ids=dpos.astype(np.int32),
        sc_logits=np.asarray(sc, np.float32),
    )  # fmt: skip
    if "hf_logits_nosc" in ref:
        for k in ("nosc", "sc"):
            d = np.abs(ref[f"psd_logits_{k}"] - ref[f"hf_logits_{k}"]).max()
            print(f"psd-jax vs transformers golden logits_{k}: max abs diff {d:.3g}")
    np.savez(out / "reference.npz", **ref)
    total = sum(v.size for k, v in params.items() if not k.endswith("_scalar"))
    print(json.dumps({"shape": args.shape, "dir": str(out), "n_params": len(params), "text_parameters": int(total)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
