"""The DiffusionGemma goldens (``shared/goldens``): the tiny checkpoint as a model, and one case's
arrays by name, for every test file that compares against them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from paths import GOLDENS
from safetensors.numpy import load_file

from convert.diffusion_gemma import read_params
from models import load_config
from models.diffusion_gemma import DiffusionGemma

TINY = GOLDENS / "diffusion-gemma-tiny"


def tiny_model() -> DiffusionGemma:
    """The tiny checkpoint through the converter, in float32."""
    cfg = load_config(TINY)
    return DiffusionGemma.from_params(cfg, read_params(TINY, cfg))


@functools.cache
def _cases() -> dict[str, np.ndarray]:
    return load_file(GOLDENS / "diffusion_gemma_cases.safetensors")


def golden_case(name: str) -> dict[str, np.ndarray]:
    """Case ``name``'s fields (``forward_batch``, ``generate_default_p0``, ...) by field name."""
    prefix = f"diffusion-gemma-tiny.{name}."
    fields = {k[len(prefix) :]: v for k, v in _cases().items() if k.startswith(prefix)}
    assert fields, f"no golden case {name!r}"
    return fields


def tiny_with_tokenizer(dest: Path) -> Path:
    """The tiny checkpoint in ``dest`` with a character-level tokenizer that fits its 512-id
    vocabulary (pad 0, end of sequence 1, beginning 2, then one id per printable ASCII character):
    the goldens ship none, and text front ends (the benchmark) need one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (dest / name).symlink_to(TINY / name)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
              "bos_token": "<bos>", "unk_token": "<unk>"}  # fmt: skip
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest
