"""Frozen model configs parsed from a Hugging Face ``config.json``: ``ModelConfig`` for the dense
LLaDA and Dream families, ``LLaDA2Config`` for LLaDA2.0 (``llada2_moe``, mixture of experts) and
``LLaDAMoEConfig`` for LLaDA-MoE (bidirectional mixture of experts; its ``model_type`` is "llada" as
dense LLaDA's, told apart by its architecture name or its MoE fields: ``is_lladamoe``) and
``SDARConfig`` for SDAR (block diffusion on the Qwen3 layout).

Configs are hashable so they can be static arguments of ``jax.jit``. Both expose uniformly what
decoding needs (mask/EOS/pad ids, logit shift, position rule, stop ids, parameter count) so
decoders never special-case a family: LLaDA and LLaDA2.0 predict position ``i`` at logit ``i``;
Dream (an AR-initialised model) predicts position ``i`` at logit ``i - 1``, hence ``logit_shift = 1``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from .config_error import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what a model's weights may be held in (``--dtype``)
# Side files of a LLaDA2.0 or LLaDA-MoE directory that may name the special ids (their config.json
# names no mask id).
DECODE_IDS_FILE = "decode.json"


_Config = TypeVar("_Config", bound="_SharedConfig")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _SharedConfig:
    """The fields every family's config has, and what decoding derives from them and the family's own
    ``family`` field. Keyword-only, so that they follow each family's fields in ``__init__``."""

    rope_theta: float
    norm_eps: float
    max_length: int
    mask_id: int
    eos_id: int
    pad_id: int
    eot_id: int | None = None  # end-of-turn token (LLaDA's <|eot_id|>), when the tokenizer has one
    BLOCK_CAUSAL: ClassVar[bool] = False  # see ``block_causal``

    @property
    def logit_shift(self) -> int:
        """How far logits are shifted right before decoding: Dream predicts position ``i`` at logit
        ``i - 1`` (1); LLaDA and LLaDA2.0 at logit ``i`` (0)."""
        return 1 if self.family == "dream" else 0

    @property
    def positions_from_mask(self) -> bool:
        """Dream derives positions from the attention mask (cumsum - 1); LLaDA and LLaDA2.0 keep
        absolute ones (upstream's ``arange``)."""
        return self.family == "dream"

    @property
    def block_causal(self) -> bool:
        """Whether the family was trained for block diffusion (LLaDA2.0, SDAR): decoding attends
        block-causally, with blocks aligned from each row's position 0, and finished blocks'
        keys/values never change."""
        return self.BLOCK_CAUSAL

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end an answer (EOS, and EOT when known)."""
        ids = [self.eos_id] + ([self.eot_id] if self.eot_id is not None else [])
        return tuple(dict.fromkeys(ids))

    def replace(self: _Config, **changes: Any) -> _Config:
        """A copy with ``changes`` applied to its fields."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ModelConfig(_SharedConfig):
    family: Literal["llada", "dream"]
    vocab_size: int  # rows of the embedding / columns of the LM head
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int
    qkv_bias: bool = False
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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


def is_lladamoe(cfg: dict) -> bool:
    """Whether a ``model_type: "llada"`` config is LLaDA-MoE's, not dense LLaDA's: upstream gives both
    the same model type, so the architecture name (``LLaDAMoEModelLM``) or an MoE field decides."""
    return "LLaDAMoEModelLM" in (cfg.get("architectures") or []) or any(
        key in cfg for key in ("num_experts", "moe_layer_freq", "expert_intermediate_size")
    )


def llada_config(cfg: dict, source: str, special_ids: dict[str, Any] | None = None) -> ModelConfig:
    """A dense LLaDA config.json (its ids are in it: ``special_ids`` is not read)."""
    return _checked_flat(_llada(cfg, source), source)


def dream_config(cfg: dict, source: str, special_ids: dict[str, Any] | None = None) -> ModelConfig:
    """A Dream config.json (its ids are in it: ``special_ids`` is not read)."""
    return _checked_flat(_dream(cfg, source), source)


def _checked_flat(out: ModelConfig, source: str) -> ModelConfig:
    if out.d_model % out.n_heads:
        raise ConfigError(f"{source}: d_model {out.d_model} is not divisible by n_heads {out.n_heads}")
    _check_heads_and_ids(out, source, ("mask_token_id",))
    return out


_ID_FIELDS = {"mask_token_id": "mask_id", "eos_token_id": "eos_id", "pad_token_id": "pad_id"}


def _check_heads_and_ids(
    out: ModelConfig | LLaDA2Config | LLaDAMoEConfig | SDARConfig, source: str, ids: tuple[str, ...]
) -> None:
    """Refuse query heads that do not split into the kv heads' groups, or any of the special ``ids``
    (config.json names: ``mask_token_id``, ...) outside the vocabulary."""
    if out.n_heads % out.n_kv_heads:
        raise ConfigError(f"{source}: n_heads {out.n_heads} is not divisible by n_kv_heads {out.n_kv_heads}")
    for name in ids:
        value = getattr(out, _ID_FIELDS[name])
        if not 0 <= value < out.vocab_size:
            raise ConfigError(f"{source}: {name} {value} is outside the vocabulary ({out.vocab_size})")


# ---------------------------------------------------------------------------------------- LLaDA2.0


@dataclasses.dataclass(frozen=True)
class LLaDA2Config(_SharedConfig):
    """LLaDA2.0 (``llada2_moe``): fused-QKV GQA attention with per-head q/k RMSNorm and partial
    RoPE; ``n_dense_layers`` dense SwiGLU layers, then mixture-of-experts layers (sigmoid router
    with a selection bias, group-limited top-k, shared experts). Block diffusion: decoding attends
    block-causally, which ``models.llada2.LLaDA2MoE`` takes as ``block_length``."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int  # the first ``rotary_dim`` dims of each head are rotated, the rest pass through
    mlp_hidden: int  # intermediate size of the dense layers
    n_dense_layers: int  # first_k_dense_replace
    n_experts: int
    n_experts_per_tok: int
    n_group: int
    topk_group: int
    moe_hidden: int  # intermediate size of one routed expert
    n_shared_experts: int  # the shared expert is one SwiGLU of n_shared_experts * moe_hidden
    routed_scaling_factor: float
    family: Literal["llada2_moe"] = "llada2_moe"
    BLOCK_CAUSAL: ClassVar[bool] = True

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def param_count(self, include_expert_bias: bool = False) -> int:
        """Parameters implied by the shapes, as torch counts them: the routers' ``expert_bias``
        are buffers (persistent, in the state dict, but not parameters), so they are excluded
        unless ``include_expert_bias``."""
        d, hd, E = self.d_model, self.head_dim, self.n_experts
        attn = d * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * d + 2 * hd
        dense = 3 * d * self.mlp_hidden
        moe = d * E + E * 3 * d * self.moe_hidden + 3 * d * self.n_shared_experts * self.moe_hidden
        per_layer = attn + 2 * d
        total = self.n_layers * per_layer + self.n_dense_layers * dense + self.n_moe_layers * moe
        total += 2 * self.vocab_size * d + d
        return total + (self.n_moe_layers * E if include_expert_bias else 0)

    def active_param_count(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (embedding and
        LM head included, as upstream's count)."""
        idle = self.n_experts - self.n_experts_per_tok
        return self.param_count() - self.n_moe_layers * idle * 3 * self.d_model * self.moe_hidden


# option -> the only value supported (None: absent is fine too)
_LLADA2_FIXED: dict[str, Any] = {
    "use_sliding_window": False,
    "use_qkv_bias": False,
    "use_bias": False,  # upstream's default is True (a bias on the output projection), so it must be stated
    "use_qk_norm": True,
    "norm_head": False,
    "norm_softmax": False,
    "norm_topk_prob": True,  # upstream always normalises the top-k weights
    "score_function": "sigmoid",
    "router_dtype": "fp32",
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_rmsnorm": True,
}
_LLADA2_DEFAULTS = {"use_bias": True, "use_qk_norm": True, "tie_word_embeddings": False}


def llada2_config(cfg: dict, source: str, special_ids: dict[str, int]) -> LLaDA2Config:
    """Parse a ``llada2_moe`` config dict; ``special_ids`` supply mask/eos (and pad) ids when the
    config has none (the real one has none: upstream ``generate`` takes them as arguments). A config
    with several faults gets the error of the first part below that refuses it."""
    _refuse_llada2_options(cfg, source)
    heads = _llada2_heads(cfg, source)
    n_layers = _require(cfg, "num_hidden_layers", source)
    routing = _llada2_routing(cfg, source)
    first_dense = _llada2_first_dense(cfg, n_layers, source)
    ids = _side_special_ids(cfg, special_ids, source, "LLaDA2.0")
    out = LLaDA2Config(
        vocab_size=_require(cfg, "vocab_size", source),
        n_layers=n_layers,
        **heads,
        mlp_hidden=_llada2_dense_mlp(cfg, first_dense, source),
        n_dense_layers=first_dense,
        **routing,
        moe_hidden=_require(cfg, "moe_intermediate_size", source),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_length=_require(cfg, "max_position_embeddings", source),
        **ids,
    )
    _check_heads_and_ids(out, source, ("mask_token_id", "eos_token_id", "pad_token_id"))
    return out


def _refuse_llada2_options(cfg: dict, source: str) -> None:
    """Refuse an option whose value this implementation does not run (``_LLADA2_FIXED``), or RoPE scaling."""
    for key, ok in _LLADA2_FIXED.items():
        value = cfg.get(key, _LLADA2_DEFAULTS.get(key, ok))
        if value is not None and value != ok:
            raise ConfigError(f"{source}: LLaDA2.0 option {key}={value!r} is not supported (only {ok!r})")
    if cfg.get("rope_scaling"):
        raise ConfigError(f"{source}: LLaDA2.0 rope_scaling={cfg['rope_scaling']!r} is not supported")


def _llada2_heads(cfg: dict, source: str) -> dict[str, int]:
    """The attention's shape: ``d_model``, query and kv heads, ``head_dim`` and ``rotary_dim``
    (``head_dim * partial_rotary_factor``: an explicit ``rotary_dim`` must agree, and it must be even
    and in (0, head_dim])."""
    n_heads = _require(cfg, "num_attention_heads", source)
    d_model = _require(cfg, "hidden_size", source)
    head_dim = cfg.get("head_dim") or d_model // n_heads
    rotary_dim = int(head_dim * float(cfg.get("partial_rotary_factor", 0.5)))
    if cfg.get("rotary_dim") is not None and cfg["rotary_dim"] != rotary_dim:
        raise ConfigError(
            f"{source}: rotary_dim {cfg['rotary_dim']} disagrees with head_dim * partial_rotary_factor = {rotary_dim}"
        )
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(f"{source}: LLaDA2.0 rotary dims {rotary_dim} must be even and in (0, head_dim]")
    n_kv_heads = cfg.get("num_key_value_heads") or n_heads
    return dict(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim)


def _llada2_routing(cfg: dict, source: str) -> dict[str, int]:
    """The experts and the router's groups, checked to fit together: groups of 2 or more experts,
    the top-k within the kept groups, at least one shared expert."""
    n_experts = _require(cfg, "num_experts", source)
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or n_group)
    top_k = _require(cfg, "num_experts_per_tok", source)
    shared = cfg.get("num_shared_experts")
    if not isinstance(shared, int) or shared < 1:
        raise ConfigError(f"{source}: LLaDA2.0 num_shared_experts={shared!r} is not supported (a positive integer)")
    if n_experts % n_group or n_experts // n_group < 2:
        raise ConfigError(f"{source}: num_experts {n_experts} must split into n_group {n_group} groups of 2 or more")
    if not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * (n_experts // n_group):
        raise ConfigError(
            f"{source}: topk_group {topk_group} / num_experts_per_tok {top_k} do not fit {n_group} groups "
            f"of {n_experts // n_group} experts"
        )
    return dict(
        n_experts=n_experts, n_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, n_shared_experts=shared
    )


def _llada2_first_dense(cfg: dict, n_layers: int, source: str) -> int:
    """How many layers, first, are dense (``first_k_dense_replace``, in [0, n_layers])."""
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    if not 0 <= first_dense <= n_layers:
        raise ConfigError(f"{source}: first_k_dense_replace {first_dense} is outside [0, {n_layers}]")
    return first_dense


def _llada2_dense_mlp(cfg: dict, first_dense: int, source: str) -> int:
    """The dense layers' MLP size (``intermediate_size``), required only when there are dense layers."""
    return _require(cfg, "intermediate_size", source) if first_dense else int(cfg.get("intermediate_size") or 0)


def _side_special_ids(cfg: dict, special_ids: dict[str, int], source: str, family: str) -> dict[str, int]:
    """mask/eos/pad ids of a ``family`` whose config.json may lack them: config.json's own win over
    ``special_ids`` (the side files'); mask and eos are required, pad defaults to eos."""
    ids = {**special_ids, **{k: cfg[k] for k in ("mask_token_id", "eos_token_id") if cfg.get(k) is not None}}
    for key in ("mask_token_id", "eos_token_id"):
        if ids.get(key) is None:
            raise ConfigError(
                f"{source}: no {key} for {family}: config.json has none; give it in {DECODE_IDS_FILE} beside "
                "config.json or in the tokenizer files (tokenizer_config.json / tokenizer.json)"
            )
    pad = cfg.get("pad_token_id", ids.get("pad_token_id"))
    mask, eos = int(ids["mask_token_id"]), int(ids["eos_token_id"])
    return {"mask_id": mask, "eos_id": eos, "pad_id": int(pad) if pad is not None else eos}


def special_ids_from_dir(model_dir: str | Path) -> dict[str, int]:
    """mask/eos/pad ids from a directory's side files, for configs that do not carry them.

    ``decode.json`` (``{"mask_token_id", "eos_token_id", "pad_token_id"}``) wins; otherwise the
    token strings that ``tokenizer_config.json`` / ``special_tokens_map.json`` declare
    (``mask_token``, ``eos_token``, ``pad_token``) are looked up in ``tokenizer_config.json``'s
    ``added_tokens_decoder`` or ``tokenizer.json``'s added tokens and vocabulary. Read as JSON
    (no tokenizer library), so a config parses without one."""
    model_dir = Path(model_dir)
    decode = model_dir / DECODE_IDS_FILE
    if decode.is_file():
        values = json.loads(decode.read_text())
        return {k: int(values[k]) for k in ("mask_token_id", "eos_token_id", "pad_token_id") if k in values}
    strings: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later file wins
        file = model_dir / name
        if file.is_file():
            data = json.loads(file.read_text())
            for role in ("mask", "eos", "pad"):
                token = data.get(f"{role}_token")
                token = token.get("content") if isinstance(token, dict) else token
                if isinstance(token, str):
                    strings[role] = token
    if not strings:
        return {}
    vocab: dict[str, int] = {}
    tok_json = model_dir / "tokenizer.json"
    if tok_json.is_file():
        data = json.loads(tok_json.read_text())
        vocab.update((data.get("model") or {}).get("vocab") or {})
        vocab.update({t["content"]: int(t["id"]) for t in data.get("added_tokens", [])})
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        decoder = json.loads(tok_cfg.read_text()).get("added_tokens_decoder") or {}
        vocab.update({t["content"]: int(i) for i, t in decoder.items()})
    return {f"{role}_token_id": vocab[token] for role, token in strings.items() if token in vocab}


# ---------------------------------------------------------------------------------------- LLaDA-MoE


@dataclasses.dataclass(frozen=True)
class LLaDAMoEConfig(_SharedConfig):
    """LLaDA-MoE (upstream ``LLaDAMoEModelLM``, e.g. LLaDA-MoE-7B-A1B): the OLMoE layout run fully
    bidirectionally. GQA attention with separate q/k/v projections and a per-head RMSNorm on q and k
    before RoPE (rotate-half, every dim); per layer (``moe_layer_freq``) a mixture of experts (float32
    softmax router over all experts, top-k weights *not* renormalised, SwiGLU experts, an optional
    shared expert) or a dense SwiGLU MLP; final RMSNorm and an untied LM head.

    Decoding treats it like dense LLaDA (``logit_shift`` 0, absolute positions, not block-causal):
    upstream decodes it with LLaDA's ``generate.py`` and Fast-dLLM."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int  # dense_intermediate_size: the MLP of the dense layers (0 when there are none)
    moe_layers: tuple[bool, ...]  # per layer: a mixture of experts (moe_layer_freq[i] != 0) or dense
    n_experts: int
    n_experts_per_tok: int
    moe_hidden: int  # expert_intermediate_size: one routed expert's SwiGLU width
    shared_hidden: int  # shared_expert_intermediate_size on every MoE layer; 0: no shared expert
    family: Literal["lladamoe"] = "lladamoe"

    @property
    def head_dim(self) -> int:
        """``d_model // n_heads`` (upstream derives it so, whatever a ``head_dim`` field says)."""
        return self.d_model // self.n_heads

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    def segments(self) -> tuple[tuple[str, int, int], ...]:
        """The layers in order as runs of one kind: ``(group, first, count)`` with ``group`` "dense"
        or "moe" and ``first`` the run's index among that group's layers. Each run is one
        ``lax.scan`` over the group's stacked weights (the released model is one run of MoE layers)."""
        runs: list[tuple[str, int, int]] = []
        seen = {"dense": 0, "moe": 0}
        for is_moe in self.moe_layers:
            group = "moe" if is_moe else "dense"
            if runs and runs[-1][0] == group:
                runs[-1] = (group, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((group, seen[group], 1))
            seen[group] += 1
        return tuple(runs)

    def param_count(self) -> int:
        """Parameters implied by the shapes (upstream's count: embedding, LM head and router included)."""
        d, hd = self.d_model, self.head_dim
        attn = d * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * d + 2 * hd + 2 * d
        dense = 3 * d * self.mlp_hidden
        moe = d * self.n_experts + self.n_experts * 3 * d * self.moe_hidden + 3 * d * self.shared_hidden
        total = self.n_layers * attn + self.n_dense_layers * dense + self.n_moe_layers * moe
        return total + 2 * self.vocab_size * d + d

    def active_param_count(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        idle = self.n_experts - self.n_experts_per_tok
        return self.param_count() - self.n_moe_layers * idle * 3 * self.d_model * self.moe_hidden


# option -> the values this implementation runs (the upstream code's behaviour for them is known)
_LLADAMOE_ALLOWED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", None),
    "attention_bias": (False, None),
    "clip_qkv": (None,),
    "qk_layernorm": (True,),
    "rope_scaling": (None, {}),
    "partial_rotary_factor": (1.0, None),
    "moe_router_score_function": ("softmax", None),
    "moe_router_enable_expert_bias": (False, None),
    "router_num_group": (None,),
    "router_topk_group": (None,),
    "routed_scaling_factor": (1.0, None),
    "tie_word_embeddings": (False, None),
}


def lladamoe_config(cfg: dict, source: str, special_ids: dict[str, int]) -> LLaDAMoEConfig:
    """Parse a LLaDA-MoE config dict (``is_lladamoe``); ``special_ids`` supply the mask id, which the
    config lacks (upstream ``generate`` takes it as an argument). ``norm_topk_prob`` is ignored:
    upstream never renormalises the top-k weights, whatever the config says."""
    for key, allowed in _LLADAMOE_ALLOWED.items():
        if (value := cfg.get(key)) not in allowed:
            raise ConfigError(f"{source}: LLaDA-MoE option {key}={value!r} is not supported (only {allowed[0]!r})")
    n_layers = _require(cfg, "num_hidden_layers", source)
    moe_layers = _lladamoe_layer_kinds(cfg, n_layers, source)
    out = LLaDAMoEConfig(
        vocab_size=_require(cfg, "vocab_size", source),
        n_layers=n_layers,
        **_lladamoe_heads(cfg, source),
        mlp_hidden=_lladamoe_dense_mlp(cfg, moe_layers, source),
        moe_layers=moe_layers,
        **_lladamoe_experts(cfg, any(moe_layers), source),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_length=_require(cfg, "max_position_embeddings", source),
        **_side_special_ids(cfg, special_ids, source, "LLaDA-MoE"),
    )
    _check_heads_and_ids(out, source, ("mask_token_id", "eos_token_id", "pad_token_id"))
    return out


def _lladamoe_heads(cfg: dict, source: str) -> dict[str, int]:
    """``d_model``, query and kv heads; head_dim is ``d_model // n_heads`` (an explicit ``head_dim``
    must agree: upstream ignores it)."""
    n_heads = _require(cfg, "num_attention_heads", source)
    d_model = _require(cfg, "hidden_size", source)
    if d_model % n_heads:
        raise ConfigError(f"{source}: hidden_size {d_model} is not divisible by num_attention_heads {n_heads}")
    if cfg.get("head_dim") not in (None, d_model // n_heads):
        raise ConfigError(
            f"{source}: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads = {d_model // n_heads}"
        )
    return dict(d_model=d_model, n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads)


def _lladamoe_layer_kinds(cfg: dict, n_layers: int, source: str) -> tuple[bool, ...]:
    """Per layer, whether it is a mixture of experts: ``moe_layer_freq`` [n_layers] of 0 (dense) / 1 (MoE)."""
    freq = _require(cfg, "moe_layer_freq", source)
    if not isinstance(freq, list) or len(freq) != n_layers or any(v not in (0, 1) for v in freq):
        raise ConfigError(f"{source}: moe_layer_freq must list 0 (dense) or 1 (MoE) for each of {n_layers} layers")
    return tuple(bool(v) for v in freq)


def _lladamoe_dense_mlp(cfg: dict, moe_layers: tuple[bool, ...], source: str) -> int:
    """The dense layers' MLP size (``dense_intermediate_size``), required only when there are dense layers."""
    if all(moe_layers):
        return int(cfg.get("dense_intermediate_size") or 0)
    return _require(cfg, "dense_intermediate_size", source)


def _lladamoe_experts(cfg: dict, has_moe: bool, source: str) -> dict[str, int]:
    """Routed experts (required when a layer is MoE; top-k within them) and the shared expert's width."""
    get = (lambda key: _require(cfg, key, source)) if has_moe else (lambda key: int(cfg.get(key) or 0))
    n_experts, top_k, hidden = get("num_experts"), get("num_experts_per_tok"), get("expert_intermediate_size")
    if has_moe and not 1 <= top_k <= n_experts:
        raise ConfigError(f"{source}: num_experts_per_tok {top_k} is not in [1, num_experts = {n_experts}]")
    shared = cfg.get("shared_expert_intermediate_size")
    if shared is not None and (not isinstance(shared, int) or shared < 1):
        raise ConfigError(f"{source}: shared_expert_intermediate_size={shared!r} must be a positive integer or null")
    return dict(n_experts=n_experts, n_experts_per_tok=top_k, moe_hidden=hidden, shared_hidden=shared or 0)


# ---------------------------------------------------------------------------------------- SDAR

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class SDARConfig(_SharedConfig):
    """SDAR (upstream ``SDARForCausalLM``, e.g. SDAR-8B-Chat): block diffusion on the Qwen3 layout.
    Pre-norm layers of GQA attention with separate q/k/v projections (no bias), a per-head RMSNorm on
    q and k (over head_dim) before RoPE (rotate-half, every dim), a dense SwiGLU MLP; final RMSNorm and
    an untied LM head. Decoding attends block-causally (``models.sdar.SDAR`` takes ``block_length``
    as LLaDA2.0's module does). ``eot_id`` is ``<|im_end|>``, so ``stop_ids`` is upstream's stop list
    (``generation_config.json``'s ``eos_token_id``)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    block_size: int  # the block length the model was trained with (config.json ``block_size``)
    family: Literal["sdar"] = "sdar"
    BLOCK_CAUSAL: ClassVar[bool] = True

    @property
    def rotary_dim(self) -> int:
        """Every dim of a head is rotated."""
        return self.head_dim

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers

    @property
    def n_moe_layers(self) -> int:
        return 0

    def param_count(self) -> int:
        """Parameters implied by the shapes (embedding and LM head included)."""
        d, hd = self.d_model, self.head_dim
        attn = d * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * d + 2 * hd + 2 * d
        return self.n_layers * (attn + 3 * d * self.mlp_hidden) + 2 * self.vocab_size * d + d


# option -> the values this implementation runs
_SDAR_ALLOWED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", None),
    "attention_bias": (False, None),
    "use_sliding_window": (False, None),
    "rope_scaling": (None, {}),
    "tie_word_embeddings": (False, None),
}


def sdar_config(cfg: dict, source: str, special_ids: dict[str, Any]) -> SDARConfig:
    """Parse an ``sdar`` config dict. config.json names the mask and EOS ids; ``special_ids`` (the
    directory's side files: ``decode.json``, ``generation_config.json``) may add the pad id and the
    stop list, whose id other than EOS is ``<|im_end|>`` (``eot_id``)."""
    for key, allowed in _SDAR_ALLOWED.items():
        if (value := cfg.get(key)) not in allowed:
            raise ConfigError(f"{source}: SDAR option {key}={value!r} is not supported (only {allowed[0]!r})")
    n_heads = _require(cfg, "num_attention_heads", source)
    d_model = _require(cfg, "hidden_size", source)
    ids = _side_special_ids(cfg, special_ids, source, "SDAR")
    stops = [int(i) for i in special_ids.get("stop_token_ids", []) if int(i) != ids["eos_id"]]
    if len(stops) > 1:
        raise ConfigError(
            f"{source}: SDAR stop list {special_ids['stop_token_ids']} has more than EOS and one end of turn"
        )
    out = SDARConfig(
        vocab_size=_require(cfg, "vocab_size", source),
        d_model=d_model,
        n_layers=_require(cfg, "num_hidden_layers", source),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or d_model // n_heads,
        mlp_hidden=_require(cfg, "intermediate_size", source),
        block_size=int(cfg.get("block_size") or 4),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_length=_require(cfg, "max_position_embeddings", source),
        eot_id=stops[0] if stops else None,
        **ids,
    )
    _check_heads_and_ids(out, source, ("mask_token_id", "eos_token_id", "pad_token_id"))
    if out.eot_id is not None and not 0 <= out.eot_id < out.vocab_size:
        raise ConfigError(f"{source}: stop id {out.eot_id} is outside the vocabulary ({out.vocab_size})")
    return out


def stop_ids_from_dir(model_dir: str | Path) -> list[int]:
    """The stop list of a directory: ``generation_config.json``'s ``eos_token_id`` (an id or a list),
    else ``decode.json``'s ``stop_token_ids``; empty when neither names one."""
    model_dir = Path(model_dir)
    for name, key in ((GENERATION_CONFIG_FILE, "eos_token_id"), (DECODE_IDS_FILE, "stop_token_ids")):
        file = model_dir / name
        if file.is_file():
            value = json.loads(file.read_text()).get(key)
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


def sdar_side_ids(model_dir: str | Path) -> dict[str, Any]:
    """An SDAR directory's special ids and its stop list (``stop_token_ids``)."""
    return {**special_ids_from_dir(model_dir), "stop_token_ids": stop_ids_from_dir(model_dir)}
