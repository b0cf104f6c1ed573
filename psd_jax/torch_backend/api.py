"""``load_torch_model(path)`` -> ``TorchLM``: the PyTorch backend behind the same API as ``load_model``.

``TorchLM.generate`` takes the same prompts and ``DecodeConfig`` as ``LoadedModel.generate``,
left-pads prompts to the same bucket, and returns the same ``Generation`` records (output ids,
text, nfe, sequence_forwards, tokens, tpf, seconds, compile_seconds, decoder stats).

``compile=True`` runs the forward (and logits -> prediction) through ``torch.compile``; the first
``generate`` for a new (batch, padded length, settings) is then a warm-up whose wall time is
reported as ``compile_seconds`` (as the JAX backend reports XLA compilation), and ``seconds`` of
that call is the warm-up decode itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convert.safetensors_dir import INDEX_FILE, SINGLE_FILE, CheckpointError
from models import ModelConfig, load_config

from ..core.config import DecodeConfig
from ..core.records import DecodeOutput, Generation, generations
from ..model_dir import default_model_path
from ..prompts import PromptIO, left_pad
from ..tokenizer import load_tokenizer, resolve_special_ids
from .decode import Predictor, check_supported
from .model import TORCH_DTYPES, TorchDiffusionLM, load_hf_torch
from .run import generate


class TorchLM(PromptIO):
    """A PyTorch model, its config (special ids resolved) and tokenizer (``None`` if absent)."""

    def __init__(self, model: TorchDiffusionLM, tokenizer, path: Path | None, *, compile: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.config: ModelConfig = resolve_special_ids(model.config, tokenizer, str(path))
        self.compile = compile
        self.device = next(model.parameters()).device
        self._predictors: dict[DecodeConfig, Predictor] = {}
        self._warm: set[tuple] = set()

    # ------------------------------------------------------------------------------ logits
    @torch.inference_mode()
    def logits(self, input_ids, attention_mask=None) -> torch.Tensor:
        """Raw (unshifted) model outputs [B, N, V] in float32."""
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=self.device)
        mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask), device=self.device)
        return self.model(ids, mask)

    def settings(self, settings: DecodeConfig | None = None, overrides: dict[str, Any] | None = None) -> DecodeConfig:
        """``PromptIO.settings`` (checked against the model), refusing first what this backend does
        not implement (``check_supported``: block-causal families, top-p/top-k)."""
        check_supported(self.config)
        dcfg = super().settings(settings, overrides)
        check_supported(self.config, dcfg)
        return dcfg

    def predictor(self, dcfg: DecodeConfig) -> Predictor:
        if dcfg not in self._predictors:
            self._predictors[dcfg] = Predictor(self.model, self.config, dcfg, compile=self.compile)
        return self._predictors[dcfg]

    # --------------------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        settings: DecodeConfig | None = None,
        *,
        seed: int = 0,
        chat: bool | None = None,
        prompt_bucket: int | None = 32,
        **overrides: Any,
    ) -> list[Generation]:
        """Decode a batch of prompts (text or token ids); one ``Generation`` per prompt (as
        ``LoadedModel.generate``: the same chat rule, checks and records)."""
        dcfg, ids = self.request(prompts, settings, overrides, seed, chat, prompt_bucket)
        prompt_ids, prompt_mask = left_pad(ids, self.config, dcfg.gen_length, prompt_bucket)
        prompt_ids, prompt_mask = prompt_ids.astype(np.int64), prompt_mask.astype(np.int64)
        args = (torch.from_numpy(prompt_ids).to(self.device), torch.from_numpy(prompt_mask).to(self.device))
        predictor = self.predictor(dcfg)
        compile_seconds = 0.0
        warm_key = (args[0].shape, bool(prompt_mask.all()), dcfg)
        if self.compile and warm_key not in self._warm:
            start = time.perf_counter()  # torch.compile traces and compiles on first use: a warm-up run
            self._run(args, dcfg, predictor, seed)
            compile_seconds = time.perf_counter() - start
            self._warm.add(warm_key)
        start = time.perf_counter()
        out = self._run(args, dcfg, predictor, seed)
        seconds = time.perf_counter() - start
        return self._results(out, prompt_ids.shape[1], seconds, compile_seconds)

    def _run(self, args, dcfg: DecodeConfig, predictor: Predictor, seed: int) -> DecodeOutput:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        out = generate(self.model, *args, dcfg, self.config, generator=generator, predictor=predictor)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def _results(self, out: DecodeOutput, prompt_length: int, seconds: float, compile_seconds: float):
        return generations(
            out,
            prompt_length,
            self.config.stop_ids,
            self.decode_text,
            seconds,
            compile_seconds,
            to_numpy=lambda t: t.cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t),
        )


def load_torch_model(
    path: str | Path | None = None,
    dtype: str = "float32",
    *,
    device: str | torch.device | None = None,
    compile: bool = False,
) -> TorchLM:
    """Load a Hugging Face LLaDA/Dream directory into PyTorch; ``None`` = the shipped model.

    ``device`` defaults to CUDA when available, else CPU. A block-causal checkpoint (LLaDA2.0) is
    refused by name (``InputError``) before any weight is read.
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(TORCH_DTYPES)}")
    path = Path(path) if path is not None else default_model_path()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not ((path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()):
        raise CheckpointError(
            f"{path}: the PyTorch backend reads Hugging Face safetensors directories "
            f"({SINGLE_FILE} or {INDEX_FILE}); convert Orbax checkpoints back with convert.export"
        )
    check_supported(load_config(path))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_hf_torch(path, TORCH_DTYPES[dtype], device)
    tokenizer = load_tokenizer(path, model.config.family)
    return TorchLM(model, tokenizer, path, compile=compile)
