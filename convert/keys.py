"""Hugging Face tensor names -> our parameters: one table per family.

Each row maps a source key (``{i}`` = layer index, ``{e}`` = expert index) to a parameter of the
family's module (``models.DiffusionLM``, ``models.LLaDA2MoE``, ``models.LLaDAMoE``, ``models.SDAR``);
``transpose`` marks torch ``Linear`` weights ([out, in]) that we store as [in, out].
``expected_keys`` expands a table for a given config into the exact set of source tensors with
their expected source shapes, which is what the completeness and shape checks compare against.
"""

from __future__ import annotations

import dataclasses

from models import AnyConfig, LLaDA2Config, LLaDAMoEConfig, SDARConfig, param_shapes


@dataclasses.dataclass(frozen=True)
class Target:
    param: str  # parameter name in the family's module
    layer: int | None  # index into the stacked layer axis, or None for top-level params
    transpose: bool
    source_shape: tuple[int, ...]  # shape the tensor must have in the Hugging Face file
    expert: int | None = None  # index into the stacked expert axis (after the layer axis)

    @property
    def index(self) -> tuple[int, ...]:
        """Where the tensor goes in the stacked parameter."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


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

# LLaDA2.0 (upstream LLaDA2MoeModelLM's state_dict names). Layer rows go to the ``dense_`` or
# ``moe_`` parameter group by layer index; ``expert_bias`` is a persistent buffer, loaded too.
LLADA2_TOP: tuple[tuple[str, str, bool], ...] = (
    ("model.word_embeddings.weight", "embed", False),
    ("model.norm.weight", "final_norm", False),
    ("lm_head.weight", "lm_head", True),
)
LLADA2_ATTN: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.input_layernorm.weight", "attn_norm", False),
    ("model.layers.{i}.attention.query_key_value.weight", "wqkv", True),  # rows: q heads, k heads, v heads
    ("model.layers.{i}.attention.query_layernorm.weight", "q_norm", False),
    ("model.layers.{i}.attention.key_layernorm.weight", "k_norm", False),
    ("model.layers.{i}.attention.dense.weight", "wo", True),
    ("model.layers.{i}.post_attention_layernorm.weight", "mlp_norm", False),
)
LLADA2_DENSE: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.mlp.gate_proj.weight", "w_gate", True),
    ("model.layers.{i}.mlp.up_proj.weight", "w_up", True),
    ("model.layers.{i}.mlp.down_proj.weight", "w_down", True),
)
LLADA2_MOE: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.mlp.gate.weight", "router", True),
    ("model.layers.{i}.mlp.gate.expert_bias", "expert_bias", False),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "expert_gate", True),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "expert_up", True),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "expert_down", True),
    ("model.layers.{i}.mlp.shared_experts.gate_proj.weight", "shared_gate", True),
    ("model.layers.{i}.mlp.shared_experts.up_proj.weight", "shared_up", True),
    ("model.layers.{i}.mlp.shared_experts.down_proj.weight", "shared_down", True),
)


# LLaDA-MoE (upstream LLaDAMoEModelLM's state_dict names: the OLMoE / Qwen-MoE layout). Layer rows go
# to the ``dense_`` or ``moe_`` group by ``moe_layer_freq``. The shared expert (absent from the
# released model and the golden checkpoint) is the decoder layer's ``shared_expert`` module.
LLADAMOE_TOP: tuple[tuple[str, str, bool], ...] = (
    ("model.embed_tokens.weight", "embed", False),
    ("model.norm.weight", "final_norm", False),
    ("lm_head.weight", "lm_head", True),
)
LLADAMOE_ATTN: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.input_layernorm.weight", "attn_norm", False),
    ("model.layers.{i}.self_attn.q_proj.weight", "wq", True),
    ("model.layers.{i}.self_attn.k_proj.weight", "wk", True),
    ("model.layers.{i}.self_attn.v_proj.weight", "wv", True),
    ("model.layers.{i}.self_attn.q_norm.weight", "q_norm", False),  # [head_dim], shared by the heads
    ("model.layers.{i}.self_attn.k_norm.weight", "k_norm", False),
    ("model.layers.{i}.self_attn.o_proj.weight", "wo", True),
    ("model.layers.{i}.post_attention_layernorm.weight", "mlp_norm", False),
)
LLADAMOE_DENSE = LLADA2_DENSE  # model.layers.{i}.mlp.{gate,up,down}_proj
LLADAMOE_MOE: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.mlp.gate.weight", "router", True),  # [experts, hidden]
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "expert_gate", True),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "expert_up", True),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "expert_down", True),
    ("model.layers.{i}.shared_expert.gate_proj.weight", "shared_gate", True),
    ("model.layers.{i}.shared_expert.up_proj.weight", "shared_up", True),
    ("model.layers.{i}.shared_expert.down_proj.weight", "shared_down", True),
)


def _source_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transpose else tuple(shape)


def _grouped_keys(
    shapes: dict[str, tuple[int, ...]],
    top: tuple[tuple[str, str, bool], ...],
    groups: list[tuple[str, list[int], tuple[tuple[str, str, bool], ...]]],
    n_experts: int,
) -> dict[str, Target]:
    """The source tensors of a family whose layers are stacked in groups (LLaDA2.0, LLaDA-MoE): ``groups``
    are ``(group, source layer indices, table)``, the group's i-th layer at index i of its
    ``<group>_<param>`` stack; per-expert tensors go to [layers, experts, ...]. Rows whose parameter
    the config does not have (a shared expert it lacks) are skipped."""
    out = {key: Target(param, None, t, _source_shape(shapes[param], t)) for key, param, t in top}
    for group, layers, table in groups:
        for pattern, base, transpose in table:
            param = f"{group}_{base}"
            if param not in shapes:
                continue
            per = shapes[param][1:]
            experts = range(n_experts) if "{e}" in pattern else [None]
            for layer, source_layer in enumerate(layers):
                for expert in experts:
                    key = pattern.replace("{i}", str(source_layer)).replace("{e}", str(expert))
                    inner = per[1:] if expert is not None else per
                    out[key] = Target(param, layer, transpose, _source_shape(inner, transpose), expert)
    return out


def llada2_expected_keys(cfg: LLaDA2Config) -> dict[str, Target]:
    """LLaDA2.0's source tensors: the first ``n_dense_layers`` dense, the rest MoE."""
    dense, moe = list(range(cfg.n_dense_layers)), list(range(cfg.n_dense_layers, cfg.n_layers))
    groups = [("dense", dense, LLADA2_ATTN + LLADA2_DENSE), ("moe", moe, LLADA2_ATTN + LLADA2_MOE)]
    return _grouped_keys(param_shapes(cfg), LLADA2_TOP, groups, cfg.n_experts)


def lladamoe_expected_keys(cfg: LLaDAMoEConfig) -> dict[str, Target]:
    """LLaDA-MoE's source tensors: each layer to the group ``moe_layer_freq`` gives it."""
    dense = [i for i, is_moe in enumerate(cfg.moe_layers) if not is_moe]
    moe = [i for i, is_moe in enumerate(cfg.moe_layers) if is_moe]
    groups = [("dense", dense, LLADAMOE_ATTN + LLADAMOE_DENSE), ("moe", moe, LLADAMOE_ATTN + LLADAMOE_MOE)]
    return _grouped_keys(param_shapes(cfg), LLADAMOE_TOP, groups, cfg.n_experts)


def sdar_expected_keys(cfg: SDARConfig) -> dict[str, Target]:
    """SDAR's source tensors (the Qwen3 names): every layer dense, LLaDA-MoE's attention and dense MLP rows."""
    groups = [("dense", list(range(cfg.n_layers)), LLADAMOE_ATTN + LLADAMOE_DENSE)]
    return _grouped_keys(param_shapes(cfg), LLADAMOE_TOP, groups, 0)


def expected_keys(cfg: AnyConfig) -> dict[str, Target]:
    """Every source tensor the config implies, with where it goes and the shape it must have."""
    if isinstance(cfg, LLaDA2Config):
        return llada2_expected_keys(cfg)
    if isinstance(cfg, SDARConfig):
        return sdar_expected_keys(cfg)
    if isinstance(cfg, LLaDAMoEConfig):
        return lladamoe_expected_keys(cfg)
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
