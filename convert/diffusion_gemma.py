"""DiffusionGemma's Hugging Face tensors -> ``models.DiffusionGemma`` parameters: a key table with a
shape check per tensor.

Upstream's checkpoint stores the text stack once, under ``model.decoder.*``: every encoder text
weight (``model.encoder.language_model.{embed_tokens,layers.N.*,norm}``) and ``lm_head.weight``
are tied to it and not written. Only the ``layer_scalar`` buffers differ between the two modes,
so they are read under both names. A tied weight is accepted under either of its names (a
checkpoint written with the ties broken holds the encoder copy too; it must then be equal). The
vision tower (``model.encoder.vision_tower.*``, ``model.encoder.embed_vision.*``) is skipped by
name: no front end takes images.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from models.diffusion_gemma import layer_shapes, param_shapes
from models.diffusion_gemma_config import GROUPS, DiffusionGemmaConfig
from models.moe import interleave_gate_up

from .safetensors_dir import CheckpointError, SafetensorsDir

DECODER, ENCODER = "model.decoder.", "model.encoder.language_model."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")

# (checkpoint name under model.decoder., parameter, how the tensor becomes it)
T = "transpose"
TOP_TABLE: tuple[tuple[str, str, str | None], ...] = (
    ("embed_tokens.weight", "embed", None),
    ("norm.weight", "final_norm", None),
    ("self_conditioning.pre_norm.weight", "sc_pre_norm", None),
    ("self_conditioning.gate_proj.weight", "sc_gate", T),
    ("self_conditioning.up_proj.weight", "sc_up", T),
    ("self_conditioning.down_proj.weight", "sc_down", T),
)
LAYER_TABLE: tuple[tuple[str, str, str | None], ...] = (
    ("input_layernorm.weight", "input_norm", None),
    ("self_attn.q_proj.weight", "wq", T),
    ("self_attn.k_proj.weight", "wk", T),
    ("self_attn.v_proj.weight", "wv", T),  # sliding layers only
    ("self_attn.q_norm.weight", "q_norm", None),
    ("self_attn.k_norm.weight", "k_norm", None),
    ("self_attn.o_proj.weight", "wo", T),
    ("post_attention_layernorm.weight", "post_attention_norm", None),
    ("pre_feedforward_layernorm.weight", "pre_ff_norm", None),
    ("mlp.gate_proj.weight", "w_gate", T),
    ("mlp.up_proj.weight", "w_up", T),
    ("mlp.down_proj.weight", "w_down", T),
    ("post_feedforward_layernorm_1.weight", "post_ff_norm_1", None),
    ("router.proj.weight", "router", T),
    ("router.scale", "router_scale", None),
    ("router.per_expert_scale", "expert_scale", None),
    ("pre_feedforward_layernorm_2.weight", "pre_ff_norm_2", None),
    ("experts.gate_up_proj", "expert_gate_up", "interleave"),  # [E, 2F, D]: gate rows, then up rows
    ("experts.down_proj", "expert_down", "experts_transpose"),  # [E, D, F]
    ("post_feedforward_layernorm_2.weight", "post_ff_norm_2", None),
    ("post_feedforward_layernorm.weight", "post_ff_norm", None),
)


def _source_shape(shape: tuple[int, ...], how: str | None) -> tuple[int, ...]:
    if how == T:
        return tuple(reversed(shape))
    if how == "experts_transpose":
        return (shape[0], shape[2], shape[1])
    return shape


def params_from_hf(get: Callable[[str], np.ndarray | None], cfg: DiffusionGemmaConfig) -> dict[str, np.ndarray]:
    """Every parameter of ``param_shapes(cfg)`` from the checkpoint's tensors (``get(name)``: the
    tensor, or None when the checkpoint has no such name), each shape checked against the config."""
    shapes = param_shapes(cfg)

    def read(name: str, want: tuple[int, ...], tied: bool = True) -> np.ndarray:
        names = [DECODER + name] + ([ENCODER + name] if tied else [])
        if name == "embed_tokens.weight":
            names.append("lm_head.weight")
        found = [(n, t) for n in names if (t := get(n)) is not None]
        if not found:
            raise CheckpointError(f"the checkpoint has no {names[0]} (nor {', '.join(names[1:])})")
        for n, t in found:
            if tuple(t.shape) != want:
                raise CheckpointError(f"{n} has shape {tuple(t.shape)}; this config needs {want}")
        for n, t in found[1:]:
            if not np.array_equal(t, found[0][1]):
                raise CheckpointError(f"{n} differs from {found[0][0]}, to which the model ties it")
        return found[0][1]

    out: dict[str, np.ndarray] = {}
    for source, param, how in TOP_TABLE:
        out[param] = _converted(read(source, _source_shape(shapes[param], how)), how)
    for i, kind in enumerate(cfg.layer_types):
        own, prefix, layer = layer_shapes(cfg, GROUPS[kind]), f"layers.{i}.", f"layer{i}_"
        for source, param, how in LAYER_TABLE:
            if param == "wv" and "wv" not in own:
                if get(DECODER + prefix + source) is not None:
                    raise CheckpointError(
                        f"{DECODER + prefix + source}: layer {i} is a full-attention layer, which has no v_proj"
                    )
                continue
            if how == "interleave":
                e, d, f2 = own[param]
                both = read(prefix + source, (e, f2, d))
                gate, up = np.swapaxes(both[:, : f2 // 2], 1, 2), np.swapaxes(both[:, f2 // 2 :], 1, 2)
                out[layer + param] = interleave_gate_up(gate, up)
                continue
            out[layer + param] = _converted(read(prefix + source, _source_shape(own[param], how)), how)
        for mode, param in (("decoder", "denoiser_scalar"), ("encoder", "encoder_scalar")):
            base = DECODER if mode == "decoder" else ENCODER
            name = f"{base}{prefix}layer_scalar"
            scalar = get(name)
            if scalar is None:
                raise CheckpointError(f"the checkpoint has no {name} (the {mode}'s own layer scale)")
            if tuple(scalar.shape) not in ((1,), ()):
                raise CheckpointError(f"{name} has shape {tuple(scalar.shape)}; it is one number")
            out[layer + param] = np.asarray(scalar).reshape(())
    for name, shape in shapes.items():
        assert out[name].shape == shape, (name, out[name].shape, shape)
    return out


def _converted(tensor: np.ndarray, how: str | None) -> np.ndarray:
    if how == T:
        return np.ascontiguousarray(tensor.T)
    if how == "experts_transpose":
        return np.ascontiguousarray(np.swapaxes(tensor, 1, 2))
    return tensor


def expected_keys(cfg: DiffusionGemmaConfig) -> dict[str, tuple[int, ...]]:
    """The text tensors ``save_pretrained`` writes for ``cfg``, by name, with their shapes: what a
    full-size checkpoint's index is checked against."""
    shapes = param_shapes(cfg)
    keys = {DECODER + source: _source_shape(shapes[param], how) for source, param, how in TOP_TABLE}
    for i, kind in enumerate(cfg.layer_types):
        group = GROUPS[kind]
        own = layer_shapes(cfg, group)
        for source, param, how in LAYER_TABLE:
            if param == "wv" and "wv" not in own:
                continue
            if how == "interleave":
                e, d, f2 = own[param]
                keys[f"{DECODER}layers.{i}.{source}"] = (e, f2, d)
            else:
                keys[f"{DECODER}layers.{i}.{source}"] = _source_shape(own[param], how)
        keys[f"{DECODER}layers.{i}.layer_scalar"] = (1,)
        keys[f"{ENCODER}layers.{i}.layer_scalar"] = (1,)
    return keys


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def from_mapping(tensors: Mapping[str, np.ndarray], cfg: DiffusionGemmaConfig) -> dict[str, np.ndarray]:
    """``params_from_hf`` over the checkpoint's tensors by name; a name neither text nor vision is
    refused (another model's checkpoint, or this one's for another config)."""
    known = set(expected_keys(cfg)) | {"lm_head.weight"}
    known |= {ENCODER + k[len(DECODER) :] for k in known if k.startswith(DECODER)}
    unknown = sorted(n for n in tensors if n not in known and not is_vision(n))
    if unknown:
        raise CheckpointError(f"the checkpoint has tensors this config does not know: {', '.join(unknown[:5])}")
    return params_from_hf(tensors.get, cfg)


def read_params(model_dir: str | Path, cfg: DiffusionGemmaConfig) -> dict[str, np.ndarray]:
    """The parameters of the Hugging Face directory ``model_dir`` (one or several safetensors files),
    each tensor read when its parameter is made (the vision tower never)."""
    with SafetensorsDir(model_dir) as st:
        return from_mapping(_Lazy(st), cfg)


class _Lazy(Mapping):
    """A ``SafetensorsDir``'s tensors as a mapping that reads a tensor only when it is asked for."""

    def __init__(self, st: SafetensorsDir):
        self.st = st

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.st.shapes:
            raise KeyError(name)
        return self.st.get(name)

    def __iter__(self):
        return iter(self.st.shapes)

    def __len__(self) -> int:
        return len(self.st.shapes)
