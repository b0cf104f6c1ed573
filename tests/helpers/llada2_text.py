"""llada2-tiny with a tokenizer, so the text front ends (benchmark, evaluation, server) can run on
the block-diffusion family.

The golden checkpoint ships no tokenizer (its 512-id vocabulary is random). ``with_tokenizer`` makes
a directory beside it: the checkpoint's files linked, a word-level tokenizer over the held-out
problems' words (ids below 508; decoding joins words with spaces), LLaDA2.0's special tokens at the ids of ``decode.json`` (EOS 508,
mask 511) plus ``<|role_end|>`` (LLaDA2.0's end of turn), the real LLaDA2.0-mini chat template, and
a few held-out problems as the directory's ``test.jsonl``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from paths import DEFAULT_MODEL, GOLDENS, HF_CONFIGS

TINY = GOLDENS / "llada2-tiny"
HELD_OUT = DEFAULT_MODEL / "test.jsonl"
SPECIAL = {508: "<|endoftext|>", 509: "<|startoftext|>", 510: "<|role_end|>", 511: "<|mask|>"}
ROLE_TAGS = ["<role>", "</role>"]  # the chat template's tags, kept whole
TEMPLATE_WORDS = ["SYSTEM", "HUMAN", "ASSISTANT", "detailed", "thinking", "off"]
WORD = re.compile(r"\w+|[^\w\s]+")  # the Whitespace pre-tokenizer's split
# Words take ids in a fixed random order: under this one the random model writes text for most
# chat-templated held-out problems instead of ending its answer at once.
ID_ORDER_SEED = 3


def vocabulary(texts: list[str]) -> dict[str, int]:
    words = dict.fromkeys(["[UNK]", *ROLE_TAGS, *TEMPLATE_WORDS])
    for text in texts:
        words.update(dict.fromkeys(WORD.findall(text)))
    n = min(SPECIAL)
    words = list(words)[:n]
    words += [f"<unused_{i}>" for i in range(len(words), n)]
    ids = np.random.default_rng(ID_ORDER_SEED).permutation(n)
    vocab = {word: int(i) for word, i in zip(words, ids)}
    vocab.update({token: i for i, token in SPECIAL.items()})
    return vocab


def with_tokenizer(directory: Path, problems: int = 6) -> Path:
    """Write llada2-tiny + tokenizer into ``directory`` (created) and return it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "decode.json"):
        (directory / name).symlink_to(TINY / name)
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines()]
    tokenizer = Tokenizer(models.WordLevel(vocabulary([r["question"] + " " + r["answer"] for r in rows]), "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_tokens([AddedToken(tag, special=False) for tag in ROLE_TAGS])
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL.values()])
    tokenizer.save(str(directory / "tokenizer.json"))
    real = json.loads((HF_CONFIGS / "LLaDA2.0-mini" / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "<|mask|>",
                "additional_special_tokens": ["<|role_end|>"],
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
                "chat_template": real["chat_template"],
            }
        )
    )
    (directory / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:problems]))
    return directory
