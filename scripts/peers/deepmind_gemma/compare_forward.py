"""One denoiser forward of DeepMind's DiffusionGemma against psd-jax / transformers, same weights.

Runs in the gemma venv:

    JAX_PLATFORMS=cpu PEER_VENV/bin/python scripts/peers/deepmind_gemma/compare_forward.py [tiny|100m ...]

Inputs: build/peers/weights/<shape>/ from export_weights.py (reference.npz holds the prompt, the
canvas, the self-conditioning logits and psd-jax's logits; for tiny also transformers' logits
from the golden case ``forward_single``).

DeepMind side, in float32, exactly as its sampler does it:
  prefill   ``gemma.gm.text._prefill.prefill`` (the Sampler's own prefill: causal, sliding window,
            right-padded cache of ``prompt + canvas`` slots) with the ENCODER's layer scalars
  denoise   ``DiffusionMixin.call_with_self_conditioning`` with the masks
            ``DiffusionSampler.sample_next_canvas`` builds (``_make_global_attention_mask`` and
            ``_make_block_local_attention_mask``), with the DENOISER's layer scalars; first step:
            ``sc_embeddings`` all zeros (no self-conditioning); later step:
            ``embedder.encode_logits(sc_logits)``, in float32 and cast to bfloat16 as the sampler's
            carry does.
Variants:
  native      DeepMind's masks as released (block-local context of ``window`` positions, AND the
              positional sliding mask |q - k| < window inside the attention layer)
  hf_masks    the same weights and code, but the denoiser's sliding layers given transformers'
              semantics (last ``window - 1`` cached positions + the whole canvas, no window inside
              the canvas): the model's ``sliding_window_size`` lifted for the denoiser call only and
              ``_make_block_local_attention_mask`` called with ``window - 1``. This isolates the
              weight mapping from the mask design difference.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dm_params import load  # noqa: E402

WEIGHTS = Path(__file__).resolve().parents[3] / "build" / "peers" / "weights"


def run(shape: str) -> dict:
    from gemma.diffusion import _sampler
    from gemma.gm.text import _prefill
    from gemma.gm.utils import _types

    ref = dict(np.load(WEIGHTS / shape / "reference.npz"))
    model, p_den, p_enc, c = load(WEIGHTS / shape)
    window = c["sliding_window"]
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    canvas = jnp.asarray(ref["canvas"], jnp.int32)
    b, n = ids.shape
    cl = canvas.shape[1]
    assert np.all(ref["input_ids"] != 0), "DeepMind treats id 0 as padding"

    # Prefill exactly as gm.text.Sampler.sample does (no prompt bucketing: pad_length=None).
    inp = _types.Input(text=ids, images=None, config=model.config.input_config)
    state = _prefill.prefill(
        model=model, params=p_enc, input=inp, last_state=None, cache_length=n + cl,
        max_out_length=cl, pad_length=None, rng=jax.random.key(0), sharding=None,
    )  # fmt: skip
    cache = state.cache
    end = cache["layer_0"]["end_index"]
    assert int(end[0]) == n, end
    positions = end[:, None] + jnp.arange(cl)[None, :]
    assert np.array_equal(np.asarray(positions), ref["decoder_position_ids"])
    global_mask = _sampler._make_global_attention_mask(
        batch_size=b, canvas_length=cl, cache_length=n + cl, num_valid_tokens=end,
        full_attention_mask=state.full_attention_mask,
    )  # fmt: skip

    def local_mask(w):
        return _sampler._make_block_local_attention_mask(
            batch_size=b, canvas_length=cl, sliding_window_size=w, cache_length=n + cl, num_valid_tokens=end
        )

    # The denoiser with transformers' sliding semantics: no positional window inside the layer.
    hf_model = model.clone(config=dataclasses.replace(model.config, sliding_window_size=10**9))

    def denoise(m, sliding_mask, sc):
        out = m.apply(
            {"params": p_den}, tokens=canvas, sc_embeddings=sc, cache=cache, positions=positions,
            attention_mask=global_mask, sliding_attention_mask=sliding_mask,
            method=m.call_with_self_conditioning,
        )  # fmt: skip
        return np.asarray(out.logits, np.float32)

    sc32 = model.apply(
        {"params": p_den}, jnp.asarray(ref["sc_logits"]), method=lambda m, x: m.embedder.encode_logits(x)
    )
    zeros = jnp.zeros((b, cl, c["d_model"]), jnp.bfloat16)
    dm = {
        "native_nosc": denoise(model, local_mask(window), zeros),
        "hf_masks_nosc": denoise(hf_model, local_mask(window - 1), zeros),
        "hf_masks_sc_f32": denoise(hf_model, local_mask(window - 1), sc32),
        "hf_masks_sc_bf16": denoise(hf_model, local_mask(window - 1), sc32.astype(jnp.bfloat16)),
        "native_sc_bf16": denoise(model, local_mask(window), sc32.astype(jnp.bfloat16)),
    }
    res = {"shape": shape, "prompt": n, "canvas": cl, "sliding_window": window}
    for other in ("psd", "hf"):
        if f"{other}_logits_nosc" not in ref:
            continue
        for k, v in dm.items():
            want = ref[f"{other}_logits_{'nosc' if k.endswith('nosc') else 'sc'}"]
            res[f"max_abs_diff[{k} vs {other}]"] = float(np.abs(v - want).max())
        res[f"max_abs_{other}_logit"] = float(np.abs(ref[f"{other}_logits_nosc"]).max())
    if "hf_logits_nosc" in ref:
        res["max_abs_diff[psd vs hf]_nosc"] = float(np.abs(ref["psd_logits_nosc"] - ref["hf_logits_nosc"]).max())
        res["max_abs_diff[psd vs hf]_sc"] = float(np.abs(ref["psd_logits_sc"] - ref["hf_logits_sc"]).max())
    return res


if __name__ == "__main__":
    for shape in sys.argv[1:] or ["tiny"]:
        print(json.dumps(run(shape), indent=1))
