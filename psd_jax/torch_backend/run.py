"""``generate``: one decode with the PyTorch backend, uncached (``decode``) or with Fast-dLLM's
block KV cache (``cache``, which builds on ``decode``'s loop pieces); above both, so neither
imports the other back."""

from __future__ import annotations

import torch

from models import ModelConfig

from ..core import policies
from ..core.config import DecodeConfig
from ..core.records import DecodeOutput
from .cache import decode_cached
from .decode import Loop, Predictor, canvas_mask, check_supported, decode_uncached


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    settings: DecodeConfig,
    mcfg: ModelConfig,
    *,
    generator: torch.Generator | None = None,
    predictor: Predictor | None = None,
) -> DecodeOutput:
    """Decode left-padded prompts [B, P] (0/1 mask [B, P] or None) with the JAX engine's semantics;
    ``settings.cache`` "prefix"/"dual" runs Fast-dLLM's block KV cache (``torch_backend.cache``)."""
    dcfg = settings  # checked when made: a cache with classifier-free guidance is refused there
    check_supported(mcfg, dcfg)
    device = prompt_ids.device
    batch, prompt_length = prompt_ids.shape
    counts = policies.step_counts(dcfg)
    loop = Loop(
        mcfg,
        dcfg,
        prompt_length,
        predictor or Predictor(model, mcfg, dcfg),
        None if counts is None else torch.as_tensor(counts, dtype=torch.long, device=device),
        canvas_mask(prompt_mask, dcfg.gen_length),
        generator,
    )
    gen = torch.full((batch, dcfg.gen_length), mcfg.mask_id, dtype=torch.long, device=device)
    canvas = torch.cat([prompt_ids.long(), gen], dim=1)
    return decode_cached(loop, canvas) if dcfg.cache != "none" else decode_uncached(loop, canvas)
