"""Tokenizers from the model directory, and the special ids decoding needs.

``AutoTokenizer`` loads a directory with ``tokenizer.json``; Dream's directory (vocab.json +
merges.txt, with a ``DreamTokenizer`` auto_map that needs remote code) loads as ``Qwen2Tokenizer``.
Special ids come from config and tokenizer, never hard-coded: the tokenizer must know the
config's mask token, and the end-of-turn token (``<|eot_id|>`` / ``<|im_end|>`` / ``<|role_end|>``) is looked up.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from types import ModuleType

from models import ModelConfig

from .core.errors import InputError

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
EOT_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|role_end|>")  # LLaDA, Dream, LLaDA2.0


class TokenizerError(InputError):
    """A tokenizer that does not fit the model or the request (text for a checkpoint without a
    tokenizer, ``chat=True`` without a chat template), with the reason; an ``InputError``."""


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


# What transformers logs on import when torch is not installed. This library uses only its tokenizers,
# and torch is an optional extra (the PyTorch backend), so to a user of the default install the
# advice reads like a failure.
NO_TORCH_ADVICE = "PyTorch was not found."


def _other_than_no_torch_advice(record: logging.LogRecord) -> bool:
    """Logging filter: keep every record but the advice."""
    return not record.getMessage().startswith(NO_TORCH_ADVICE)


def import_transformers() -> ModuleType:
    """``transformers``, imported without its advice that PyTorch was not found (``NO_TORCH_ADVICE``);
    every other message it logs passes. The advice is logged once, by the first import, on the
    "transformers" logger, so a filter on that logger for the import's duration is enough."""
    logger = logging.getLogger("transformers")
    logger.addFilter(_other_than_no_torch_advice)
    try:
        import transformers
    finally:
        logger.removeFilter(_other_than_no_torch_advice)
    return transformers


NO_TOKENIZER_LIMIT = int(1e30)  # transformers' own value for "no limit" (VERY_LARGE_INTEGER)


def remote_code_tokenizer(model_dir: str | Path) -> bool:
    """Whether the directory's tokenizer_config.json maps AutoTokenizer to remote code (Dream's)."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        return "AutoTokenizer" in json.loads(path.read_text()).get("auto_map", {})
    except (OSError, ValueError, AttributeError):
        return False


def load_tokenizer(model_dir: str | Path, family: str):
    """The directory's tokenizer, or ``None`` when it ships none."""
    if not has_tokenizer(model_dir):
        return None
    transformers = import_transformers()
    # Loading logs about the checkpoint's own files (Dream's remote-code auto_map, added tokens),
    # not about anything the user can act on: quiet for the load only, the user's level after it.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        if family == "dream" and remote_code_tokenizer(model_dir):
            # Dream's DreamTokenizer is Qwen2's; asking AutoTokenizer first would cost transformers'
            # remote-code prompt (and its timeout) or a refusal after it parses the whole config.
            tokenizer = transformers.Qwen2Tokenizer.from_pretrained(str(model_dir))
        else:
            with warnings.catch_warnings():  # AutoTokenizer parses config.json: LLaDA2.0's rope_scaling warns
                warnings.simplefilter("ignore", FutureWarning)
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as exc:
        raise TokenizerError(f"{model_dir}: cannot load tokenizer: {exc}") from exc
    finally:
        transformers.logging.set_verbosity(verbosity)
    # Prompt lengths are checked against the model's context by every front end (lengths.py), with
    # one error line; the tokenizer's own limit would only add a warning (or truncate).
    tokenizer.model_max_length = NO_TOKENIZER_LIMIT
    return tokenizer


def token_id(tokenizer, token: str) -> int | None:
    """Id of a token string if the tokenizer knows it exactly."""
    ids = tokenizer.convert_tokens_to_ids([token])
    tid = ids[0] if ids else None
    if tid is None or tid == tokenizer.unk_token_id:
        return None
    return int(tid)


def resolve_special_ids(cfg: ModelConfig, tokenizer, source: str) -> ModelConfig:
    """Check the tokenizer against the config's mask id and fill in the end-of-turn id."""
    if tokenizer is None:
        return cfg
    mask_token = tokenizer.convert_ids_to_tokens(cfg.mask_id) if cfg.mask_id < len(tokenizer) else None
    if not mask_token:
        raise TokenizerError(
            f"{source}: the tokenizer lacks the mask token: config.json says mask_token_id={cfg.mask_id}, "
            f"but the tokenizer has only {len(tokenizer)} tokens"
        )
    declared = getattr(tokenizer, "mask_token", None)
    if declared and token_id(tokenizer, declared) not in (None, cfg.mask_id):
        raise TokenizerError(
            f"{source}: the tokenizer's mask token {declared!r} has id {token_id(tokenizer, declared)}, "
            f"but config.json says mask_token_id={cfg.mask_id}"
        )
    if cfg.eot_id is None:
        for token in EOT_TOKENS:
            tid = token_id(tokenizer, token)
            if tid is not None:
                return cfg.replace(eot_id=tid)
    return cfg


def encode_prompt(tokenizer, text: str, chat: bool, source: str) -> list[int]:
    """Token ids of a prompt; with ``chat`` the text is one user turn of the chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerError(f"{source}: --chat needs a chat template, and this tokenizer has none")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
