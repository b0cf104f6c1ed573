"""One frozen config for both model families, parsed from a Hugging Face ``config.json``.

The config is hashable so it can be a static argument of ``jax.jit``. It exposes uniformly what
decoding needs (mask/EOS/pad ids, logit shift, position rule) so decoders never special-case a
family: LLaDA predicts position ``i`` at logit ``i``; Dream (an AR-initialised model) predicts
position ``i`` at logit ``i - 1``, hence ``logit_shift = 1``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

FAMILIES = ("llada", "dream")


class ConfigError(ValueError):
    """A config.json that this library cannot run, with the reason."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: Literal["llada", "dream"]
    vocab_size: int  # rows of the embedding / columns of the LM head
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int
    rope_theta: float
    norm_eps: float
    max_length: int
    mask_id: int
    eos_id: int
    pad_id: int
    qkv_bias: bool = False
    tie_embeddings: bool = False
    eot_id: int | None = None  # end-of-turn token (LLaDA's <|eot_id|>), when the tokenizer has one

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def logit_shift(self) -> int:
        """How far logits are shifted right before decoding (Dream: 1, LLaDA: 0)."""
        return 1 if self.family == "dream" else 0

    @property
    def positions_from_mask(self) -> bool:
        """Dream derives positions from the attention mask (cumsum - 1); LLaDA keeps absolute ones."""
        return self.family == "dream"

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end an answer (EOS, and EOT when known)."""
        ids = [self.eos_id] + ([self.eot_id] if self.eot_id is not None else [])
        return tuple(dict.fromkeys(ids))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        """Number of parameters implied by the shapes (no allocation)."""
        d, hd, L = self.d_model, self.head_dim, self.n_layers
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        if self.qkv_bias:
            attn += self.n_heads * hd + 2 * self.n_kv_heads * hd
        mlp = 3 * d * self.mlp_hidden
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + L * per_layer + d + head


def _require(cfg: dict, key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: config.json lacks required field '{key}'")
    return cfg[key]


def _llada(cfg: dict, source: str) -> ModelConfig:
    unsupported = {
        "alibi": False,
        "attention_layer_norm": False,
        "input_emb_norm": False,
        "scale_logits": False,
        "include_bias": False,
    }
    for key, ok in unsupported.items():
        if cfg.get(key, ok) != ok:
            raise ConfigError(f"{source}: LLaDA option {key}={cfg[key]!r} is not supported")
    if cfg.get("block_type", "llama") != "llama":
        raise ConfigError(f"{source}: LLaDA block_type {cfg['block_type']!r} is not supported (only 'llama')")
    if cfg.get("layer_norm_type", "rms") != "rms":
        raise ConfigError(f"{source}: LLaDA layer_norm_type {cfg['layer_norm_type']!r} is not supported (only 'rms')")
    if not cfg.get("rope", True):
        raise ConfigError(f"{source}: LLaDA without RoPE is not supported")
    if cfg.get("activation_type", "silu") not in ("silu", "swiglu"):
        raise ConfigError(f"{source}: LLaDA activation_type {cfg['activation_type']!r} is not supported")
    n_heads = _require(cfg, "n_heads", source)
    n_kv = cfg.get("n_kv_heads") or (1 if cfg.get("multi_query_attention") else n_heads)
    mlp_hidden = cfg.get("mlp_hidden_size") or cfg["mlp_ratio"] * cfg["d_model"]
    eos = _require(cfg, "eos_token_id", source)
    return ModelConfig(
        family="llada",
        vocab_size=cfg.get("embedding_size") or _require(cfg, "vocab_size", source),
        d_model=_require(cfg, "d_model", source),
        n_layers=_require(cfg, "n_layers", source),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        mlp_hidden=mlp_hidden,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_length=_require(cfg, "max_sequence_length", source),
        mask_id=_require(cfg, "mask_token_id", source),
        eos_id=eos,
        pad_id=cfg.get("pad_token_id", eos) if cfg.get("pad_token_id") is not None else eos,
        qkv_bias=bool(cfg.get("include_qkv_bias", False)),
        tie_embeddings=bool(cfg.get("weight_tying", False)),
        eot_id=cfg.get("eot_token_id"),
    )


def _dream(cfg: dict, source: str) -> ModelConfig:
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{source}: Dream use_sliding_window=true is not supported")
    if cfg.get("rope_scaling"):
        raise ConfigError(f"{source}: Dream rope_scaling={cfg['rope_scaling']!r} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: Dream hidden_act {cfg['hidden_act']!r} is not supported")
    n_heads = _require(cfg, "num_attention_heads", source)
    eos = _require(cfg, "eos_token_id", source)
    return ModelConfig(
        family="dream",
        vocab_size=_require(cfg, "vocab_size", source),
        d_model=_require(cfg, "hidden_size", source),
        n_layers=_require(cfg, "num_hidden_layers", source),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        mlp_hidden=_require(cfg, "intermediate_size", source),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_length=_require(cfg, "max_position_embeddings", source),
        mask_id=_require(cfg, "mask_token_id", source),
        eos_id=eos,
        pad_id=cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else eos,
        qkv_bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eot_id=cfg.get("eot_token_id"),
    )


def config_from_dict(cfg: dict, source: str = "config") -> ModelConfig:
    """Parse a Hugging Face config dict of a supported family; errors name the offending field."""
    model_type = cfg.get("model_type")
    if model_type == "llada":
        out = _llada(cfg, source)
    elif model_type == "Dream":
        out = _dream(cfg, source)
    else:
        raise ConfigError(
            f"{source}: unknown model_type {model_type!r}; supported: 'llada' (LLaDA) and 'Dream' (Dream)"
        )
    if out.d_model % out.n_heads:
        raise ConfigError(f"{source}: d_model {out.d_model} is not divisible by n_heads {out.n_heads}")
    if out.n_heads % out.n_kv_heads:
        raise ConfigError(f"{source}: n_heads {out.n_heads} is not divisible by n_kv_heads {out.n_kv_heads}")
    if not 0 <= out.mask_id < out.vocab_size:
        raise ConfigError(f"{source}: mask_token_id {out.mask_id} is outside the vocabulary ({out.vocab_size})")
    return out


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in model directory {model_dir}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    return config_from_dict(cfg, source=str(path))
