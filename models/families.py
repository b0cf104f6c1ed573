"""The one registration of each model family: ``FAMILIES``, by family name.

A row holds everything the library looks a family up by: how its ``config.json`` is recognised
(``model_type``, and ``claims`` where two families share one) and parsed (``parse``, with the ids
its side files give: ``side_ids``), its config class, the module with its parameter table and
logical axes, the module class that runs it, the dtype each stored parameter takes, whether it
quantizes at load, and how its upstream decoder samples and stops (``sampling_rules``; read by the
decode). Adding a family is its module (config and model), its key table in ``convert/keys.py``,
and its row here."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax.numpy as jnp

from . import diffusion_gemma, llada2, lladamoe, sdar, transformer
from .config import (
    LLaDA2Config,
    LLaDAMoEConfig,
    ModelConfig,
    SDARConfig,
    dream_config,
    is_lladamoe,
    llada2_config,
    llada_config,
    lladamoe_config,
    sdar_config,
    sdar_side_ids,
    special_ids_from_dir,
)
from .config_error import ConfigError
from .diffusion_gemma import DiffusionGemma
from .diffusion_gemma_config import DiffusionGemmaConfig, diffusion_gemma_config, generation_eos_ids
from .llada2 import LLaDA2MoE
from .lladamoe import LLaDAMoE
from .sampling_rules import BlockStopRules, Sampler
from .sdar import SDAR
from .transformer import DiffusionLM

AnyConfig = ModelConfig | LLaDA2Config | LLaDAMoEConfig | SDARConfig | DiffusionGemmaConfig
# (config.json, its path for messages, the ids its side files give) -> the family's config
Parser = Callable[[dict[str, Any], str, dict[str, Any]], Any]


def stored_as_given(name: str, dtype) -> jnp.dtype:
    """A family whose parameters are all stored in the model's dtype."""
    return jnp.dtype(dtype)


def every_config(cfg: dict[str, Any]) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's registration.

    - ``name``: its ``config.family``; ``title``: how messages name it.
    - ``model_type``: config.json's; ``claims``: whether a config of that type is this family's
      (LLaDA and LLaDA-MoE share "llada"); ``parse``: config.json -> the config; ``side_ids``: the
      ids its directory gives beside config.json (``parse``'s third argument).
    - ``config``, ``module`` (``param_shapes``, ``logical_axes``), ``model``: its classes and module;
      ``param_dtype``: the dtype each stored parameter takes for a model of a given dtype.
    - ``sampler``: how its upstream sampler treats temperature, top-p and top-k (None: it decodes by
      a sampler of its own, DiffusionGemma's entropy bound); ``stops``: a block-causal family's stop
      rules (``config.block_causal``)."""

    name: str
    title: str
    model_type: str
    config: type
    module: ModuleType
    model: type
    parse: Parser
    sampler: Sampler | None
    stops: BlockStopRules | None = None
    claims: Callable[[dict[str, Any]], bool] = every_config
    side_ids: Callable[[Path], dict[str, Any]] | None = None
    param_dtype: Callable[[str, Any], jnp.dtype] = stored_as_given
    quantizes: bool = True  # int8/int4 at load (``models.quantize``)


LLADA_SAMPLER = Sampler("LLaDA generate.py get_transfer_index", ("top_p", "top_k"), "logits", False)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llada", "LLaDA", "llada", ModelConfig, transformer, DiffusionLM, llada_config, LLADA_SAMPLER,
            claims=lambda cfg: not is_lladamoe(cfg),
        ),
        Family(
            "dream", "Dream", "Dream", ModelConfig, transformer, DiffusionLM, dream_config,
            Sampler("Dream generation_utils.sample_tokens", ("top_p", "top_k"), "sampled", True),
        ),
        Family(
            "llada2_moe", "LLaDA2.0", "llada2_moe", LLaDA2Config, llada2, LLaDA2MoE, llada2_config,
            Sampler("LLaDA2.0 generate _sample_with_temperature_topk_topp", ("top_k", "top_p"), "sampled", False),
            BlockStopRules(always_at_block_end=True, mid_block=True, cut_after_eos=True),
            side_ids=special_ids_from_dir,
            param_dtype=llada2.param_dtype,  # its router bias stays float32
        ),
        Family(
            "lladamoe", "LLaDA-MoE", "llada", LLaDAMoEConfig, lladamoe, LLaDAMoE, lladamoe_config,
            LLADA_SAMPLER,  # its model card decodes it with LLaDA's generate.py
            claims=is_lladamoe,
            side_ids=special_ids_from_dir,
        ),
        Family(
            "sdar", "SDAR", "sdar", SDARConfig, sdar, SDAR, sdar_config,
            Sampler("SDAR generate.py sample_with_temperature_topk_topp", ("top_k", "top_p"), "sampled", True),
            BlockStopRules(always_at_block_end=False, mid_block=False, cut_after_eos=False),
            side_ids=sdar_side_ids,
        ),
        Family(
            "diffusion_gemma", "DiffusionGemma", "diffusion_gemma", DiffusionGemmaConfig, diffusion_gemma,
            DiffusionGemma, diffusion_gemma_config, None, side_ids=generation_eos_ids,
        ),
    )
}  # fmt: skip


def family_of(cfg: AnyConfig) -> Family:
    """``cfg``'s registration (by its ``family``; a config of no registered family is refused by name)."""
    family = FAMILIES.get(getattr(cfg, "family", None))  # type: ignore[arg-type]
    if family is None or not isinstance(cfg, family.config):
        raise TypeError(f"no model family is registered for {type(cfg).__name__}")
    return family


def family_of_config_json(cfg: dict[str, Any], source: str) -> Family:
    """The family a ``config.json`` belongs to, by its ``model_type`` (and ``claims``)."""
    model_type = cfg.get("model_type")
    for family in FAMILIES.values():
        if family.model_type == model_type and family.claims(cfg):
            return family
    by_type: dict[str, list[str]] = {}
    for family in FAMILIES.values():
        by_type.setdefault(family.model_type, []).append(family.title)
    supported = ", ".join(f"{t!r} ({' and '.join(titles)})" for t, titles in by_type.items())
    raise ConfigError(f"{source}: unknown model_type {model_type!r}; supported: {supported}")


def config_from_dict(cfg: dict, source: str = "config", special_ids: dict[str, Any] | None = None) -> Any:
    """Parse a Hugging Face config dict of a registered family; errors name the offending field.

    ``special_ids`` (``mask_token_id``/``eos_token_id``/``pad_token_id``, SDAR's ``stop_token_ids``)
    fill in what config.json lacks; ``load_config`` reads them from the directory's side files."""
    return family_of_config_json(cfg, source).parse(cfg, source, special_ids or {})


def load_config(model_dir: str | Path) -> Any:
    """Read ``model_dir/config.json`` and the side files its family reads ids from (LLaDA2.0's,
    LLaDA-MoE's and SDAR's special ids and stop list, DiffusionGemma's generation_config.json
    end-of-sequence ids): the family's config."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in model directory {model_dir}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    family = family_of_config_json(cfg, str(path))
    try:
        side = family.side_ids(Path(model_dir)) if family.side_ids else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{model_dir}: cannot read the files beside config.json ({exc})") from exc
    return family.parse(cfg, str(path), side)


def check_family(family: str) -> None:
    """Refuse quantizing a family that does not quantize at load."""
    if not FAMILIES[family].quantizes:
        supported = ", ".join(name for name, f in FAMILIES.items() if f.quantizes)
        raise ValueError(f"quantize is not supported for the {family} family yet (supported: {supported})")
