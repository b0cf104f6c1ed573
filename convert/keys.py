"""Hugging Face tensor names -> our parameters: one regex table per family.

Each row maps a source key (``{i}`` = layer index) to a parameter of ``models.DiffusionLM``;
``transpose`` marks torch ``Linear`` weights ([out, in]) that we store as [in, out].
``expected_keys`` expands a table for a given config into the exact set of source tensors with
their expected source shapes, which is what the completeness and shape checks compare against.
"""

from __future__ import annotations

import dataclasses

from models import ModelConfig, param_shapes


@dataclasses.dataclass(frozen=True)
class Target:
    param: str  # parameter name in DiffusionLM
    layer: int | None  # index into the stacked layer axis, or None for top-level params
    transpose: bool
    source_shape: tuple[int, ...]  # shape the tensor must have in the Hugging Face file


# (source pattern, parameter, transpose)
LLADA_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("model.transformer.wte.weight", "embed", False),
    ("model.transformer.ln_f.weight", "final_norm", False),
    ("model.transformer.ff_out.weight", "lm_head", True),
    ("model.transformer.blocks.{i}.attn_norm.weight", "attn_norm", False),
    ("model.transformer.blocks.{i}.q_proj.weight", "wq", True),
    ("model.transformer.blocks.{i}.k_proj.weight", "wk", True),
    ("model.transformer.blocks.{i}.v_proj.weight", "wv", True),
    ("model.transformer.blocks.{i}.q_proj.bias", "bq", False),
    ("model.transformer.blocks.{i}.k_proj.bias", "bk", False),
    ("model.transformer.blocks.{i}.v_proj.bias", "bv", False),
    ("model.transformer.blocks.{i}.attn_out.weight", "wo", True),
    ("model.transformer.blocks.{i}.ff_norm.weight", "mlp_norm", False),
    ("model.transformer.blocks.{i}.ff_proj.weight", "w_gate", True),  # the SiLU-gated branch
    ("model.transformer.blocks.{i}.up_proj.weight", "w_up", True),
    ("model.transformer.blocks.{i}.ff_out.weight", "w_down", True),
)

DREAM_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("model.embed_tokens.weight", "embed", False),
    ("model.norm.weight", "final_norm", False),
    ("lm_head.weight", "lm_head", True),
    ("model.layers.{i}.input_layernorm.weight", "attn_norm", False),
    ("model.layers.{i}.self_attn.q_proj.weight", "wq", True),
    ("model.layers.{i}.self_attn.k_proj.weight", "wk", True),
    ("model.layers.{i}.self_attn.v_proj.weight", "wv", True),
    ("model.layers.{i}.self_attn.q_proj.bias", "bq", False),
    ("model.layers.{i}.self_attn.k_proj.bias", "bk", False),
    ("model.layers.{i}.self_attn.v_proj.bias", "bv", False),
    ("model.layers.{i}.self_attn.o_proj.weight", "wo", True),
    ("model.layers.{i}.post_attention_layernorm.weight", "mlp_norm", False),
    ("model.layers.{i}.mlp.gate_proj.weight", "w_gate", True),
    ("model.layers.{i}.mlp.up_proj.weight", "w_up", True),
    ("model.layers.{i}.mlp.down_proj.weight", "w_down", True),
)

TABLES = {"llada": LLADA_TABLE, "dream": DREAM_TABLE}


def expected_keys(cfg: ModelConfig) -> dict[str, Target]:
    """Every source tensor the config implies, with where it goes and the shape it must have."""
    shapes = param_shapes(cfg)
    out: dict[str, Target] = {}
    for pattern, param, transpose in TABLES[cfg.family]:
        if param not in shapes:  # e.g. no biases, or a tied LM head
            continue
        shape = shapes[param]
        layers = range(cfg.n_layers) if "{i}" in pattern else [None]
        for layer in layers:
            per = shape[1:] if layer is not None else shape
            source_shape = tuple(reversed(per)) if transpose else tuple(per)
            key = pattern.replace("{i}", str(layer)) if layer is not None else pattern
            out[key] = Target(param, layer, transpose, source_shape)
    return out
