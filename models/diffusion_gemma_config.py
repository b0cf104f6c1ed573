"""DiffusionGemma's configuration (upstream ``DiffusionGemmaConfig`` and its ``text_config``), read
from a Hugging Face ``config.json``, and the parameter counts implied by its shapes.

The family has no mask token: a canvas starts as uniformly random ids and rejected positions are
re-noised, so the config carries no ``mask_id`` and the mask-token families' fields do not apply.
Only the text stack is read; the vision tower's fields are ignored (no front end takes images).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .config_error import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
GROUPS = {SLIDING: "sliding", FULL: "full"}  # layer type -> parameter group


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaConfig:
    """The text stack both modes run (encoder and denoiser share every weight but ``layer_scalar``)."""

    vocab_size: int
    d_model: int
    layer_types: tuple[str, ...]  # "sliding_attention" or "full_attention" per layer
    n_heads: int
    n_kv_heads: int  # sliding layers
    head_dim: int  # sliding layers
    n_global_kv_heads: int  # full layers
    global_head_dim: int  # full layers
    sliding_window: int  # a sliding layer's query sees keys q - window < k <= q (cache: window - 1)
    rope_theta: float  # sliding layers: every dim rotated
    global_rope_theta: float  # full layers: "proportional", the first partial_rotary_factor of the dims
    global_partial_rotary: float
    mlp_hidden: int  # the dense branch's (and self-conditioning's) intermediate size
    n_experts: int
    n_experts_per_tok: int
    moe_hidden: int
    final_softcap: float
    norm_eps: float
    canvas_length: int
    max_length: int
    pad_id: int
    bos_id: int
    eos_ids: tuple[int, ...]
    family: str = "diffusion_gemma"

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.eos_ids

    @property
    def embed_scale(self) -> float:
        return self.d_model**0.5

    def group_layers(self, group: str) -> tuple[int, ...]:
        """The layer indices of parameter group ``group`` ("sliding" or "full"), in order."""
        return tuple(i for i, kind in enumerate(self.layer_types) if GROUPS[kind] == group)

    def kv_shape(self, group: str) -> tuple[int, int]:
        """(kv heads, head dim) of a layer of ``group``."""
        return (
            (self.n_kv_heads, self.head_dim) if group == "sliding" else (self.n_global_kv_heads, self.global_head_dim)
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config") -> DiffusionGemmaConfig:
        """Parse upstream's config dict (``model_type`` "diffusion_gemma"); errors name the field."""
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: a diffusion_gemma config needs a text_config object")

        def field(name: str, kind: type = int, where: dict = text) -> Any:
            if name not in where:
                raise ConfigError(f"{source}: text_config.{name} is missing")
            value = where[name]
            ok = (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                if kind is float
                else isinstance(value, kind) and not isinstance(value, bool)
            )
            if not ok or (kind is int and value <= 0 and name != "pad_token_id"):
                raise ConfigError(f"{source}: text_config.{name} must be a positive {kind.__name__}, got {value!r}")
            return kind(value)

        layer_types = text.get("layer_types")
        if not isinstance(layer_types, list) or not layer_types or any(t not in GROUPS for t in layer_types):
            raise ConfigError(f"{source}: text_config.layer_types must list {SLIDING!r} or {FULL!r} per layer")
        if len(layer_types) != field("num_hidden_layers"):
            raise ConfigError(
                f"{source}: text_config.layer_types has {len(layer_types)} entries for num_hidden_layers {text['num_hidden_layers']}"
            )
        rope = text.get("rope_parameters") or {}
        full, sliding = rope.get(FULL) or {}, rope.get(SLIDING) or {}
        if full.get("rope_type", "proportional") != "proportional" or sliding.get("rope_type", "default") != "default":
            raise ConfigError(
                f"{source}: text_config.rope_parameters: only proportional (full) and default (sliding) RoPE are supported"
            )
        activation = text.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ConfigError(
                f"{source}: text_config.hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)"
            )
        if text.get("attention_bias"):
            raise ConfigError(f"{source}: text_config.attention_bias is not supported")
        eos = cfg.get("eos_token_id", text.get("eos_token_id", 1))
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        out = cls(
            vocab_size=field("vocab_size"),
            d_model=field("hidden_size"),
            layer_types=tuple(layer_types),
            n_heads=field("num_attention_heads"),
            n_kv_heads=field("num_key_value_heads"),
            head_dim=field("head_dim"),
            n_global_kv_heads=field("num_global_key_value_heads"),
            global_head_dim=field("global_head_dim"),
            sliding_window=field("sliding_window"),
            rope_theta=float(sliding.get("rope_theta", 10000.0)),
            global_rope_theta=float(full.get("rope_theta", 1000000.0)),
            global_partial_rotary=float(full.get("partial_rotary_factor", 1.0)),
            mlp_hidden=field("intermediate_size"),
            n_experts=field("num_experts"),
            n_experts_per_tok=field("top_k_experts"),
            moe_hidden=field("moe_intermediate_size"),
            final_softcap=float(text.get("final_logit_softcapping") or 0.0),
            norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            canvas_length=field("canvas_length", where=cfg),
            max_length=field("max_position_embeddings"),
            pad_id=int(text.get("pad_token_id", 0)),
            bos_id=int(text.get("bos_token_id", 2)),
            eos_ids=tuple(int(i) for i in eos_ids),
        )
        for heads, name in (
            (out.n_kv_heads, "num_key_value_heads"),
            (out.n_global_kv_heads, "num_global_key_value_heads"),
        ):
            if out.n_heads % heads:
                raise ConfigError(f"{source}: num_attention_heads {out.n_heads} is not divisible by {name} {heads}")
        for name, value in (
            ("pad_token_id", out.pad_id),
            ("bos_token_id", out.bos_id),
            *(("eos_token_id", i) for i in out.eos_ids),
        ):
            if not 0 <= value < out.vocab_size:
                raise ConfigError(f"{source}: {name} {value} is outside the vocabulary ({out.vocab_size})")
        return out


def generation_eos_ids(model_dir: str | Path) -> dict[str, Any]:
    """The end-of-sequence ids of ``generation_config.json`` when it names them (upstream's
    ``generate`` stops on those: the released file lists 1 and 106, <end_of_turn>, where
    config.json's text_config has only 1)."""
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file() and "eos_token_id" in (gen := json.loads(generation.read_text())):
        return {"eos_token_id": gen["eos_token_id"]}
    return {}


def diffusion_gemma_config(cfg: dict[str, Any], source: str, special_ids: dict[str, Any]) -> DiffusionGemmaConfig:
    """config.json with the end-of-sequence ids ``special_ids`` gives (``generation_eos_ids``)."""
    return DiffusionGemmaConfig.from_dict({**cfg, **special_ids}, source)
