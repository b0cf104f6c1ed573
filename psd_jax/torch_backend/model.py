"""LLaDA and Dream as a plain PyTorch ``nn.Module``, loaded from the same Hugging Face directories.

The module mirrors ``models.transformer.DiffusionLM`` op for op (same numerics, same config):

- RMSNorm normalises in float32, casts back to the model dtype, then multiplies the weight;
- RoPE (rotate-half) is computed and applied in float32, then cast back, with the inverse
  frequencies of ``models.transformer.rope_inv_freq`` (one host definition for both backends);
- LLaDA keeps absolute positions under left padding (pad keys are masked for every query);
  Dream derives positions from the mask (``cumsum(mask) - 1``, pad positions -> 1);
- attention is ``F.scaled_dot_product_attention`` with grouped-query heads (``enable_gqa``);
- logits are returned in float32 (the LM head runs in the model dtype, then is upcast), and
  only for the positions a caller names (``logit_index``) when it names them;
- ``prefill``/``window`` are the block KV cache's two calls (``DiffusionLM.prefill``/``window``):
  a full forward that also returns every layer's keys (after RoPE) and values, and windows of
  positions attending to [cached keys ; their own fresh keys].

Weights are read tensor by tensor through ``convert.safetensors_dir.SafetensorsDir`` and checked
against the family's key table (``convert.keys.expected_keys``, via ``convert.hf.check_key_set``):
a missing, unexpected or misshapen tensor is an error naming it. Hugging Face stores ``Linear``
weights as ``[out, in]``, which is ``nn.Linear``'s own layout, so no tensor is transposed here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from convert.hf import check_key_set
from convert.safetensors_dir import SafetensorsDir
from models import ModelConfig, load_config
from models.config import DTYPE_NAMES
from models.transformer import rope_inv_freq

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# Parameter names of models.transformer.DiffusionLM -> attribute path in this module.
_LAYER_ATTR = {
    "attn_norm": "attn_norm.weight",
    "wq": "q_proj.weight",
    "wk": "k_proj.weight",
    "wv": "v_proj.weight",
    "bq": "q_proj.bias",
    "bk": "k_proj.bias",
    "bv": "v_proj.bias",
    "wo": "o_proj.weight",
    "mlp_norm": "mlp_norm.weight",
    "w_gate": "gate_proj.weight",
    "w_up": "up_proj.weight",
    "w_down": "down_proj.weight",
}
_TOP_ATTR = {"embed": "embed.weight", "final_norm": "final_norm.weight", "lm_head": "lm_head.weight"}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sin/cos [B, 1, N, head_dim] in float32 for integer positions [B, N] (heads-first layout)."""
    inv_freq = torch.from_numpy(rope_inv_freq(head_dim, theta)).to(positions.device)  # the JAX model's table
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]
    return angles.sin(), angles.cos()


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [B, H, N, hd], in float32."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
        kw = {"dtype": dtype, "device": "meta"}
        self.attn_norm = RMSNorm(d, cfg.norm_eps, dtype)
        self.q_proj = nn.Linear(d, q, bias=cfg.qkv_bias, **kw)
        self.k_proj = nn.Linear(d, kv, bias=cfg.qkv_bias, **kw)
        self.v_proj = nn.Linear(d, kv, bias=cfg.qkv_bias, **kw)
        self.o_proj = nn.Linear(q, d, bias=False, **kw)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, dtype)
        self.gate_proj = nn.Linear(d, cfg.mlp_hidden, bias=False, **kw)
        self.up_proj = nn.Linear(d, cfg.mlp_hidden, bias=False, **kw)
        self.down_proj = nn.Linear(cfg.mlp_hidden, d, bias=False, **kw)

    def project(self, h: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor):
        """q [B, H, N, hd], k and v [B, KV, N, hd] of the residual stream h [B, N, D]; RoPE on q, k."""
        cfg = self.cfg
        b, n, _ = h.shape
        x = self.attn_norm(h)
        q = self.q_proj(x).view(b, n, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        return apply_rope(q, sin, cos), apply_rope(k, sin, cos), v

    def attend(self, q, k, v, key_mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, enable_gqa=cfg.n_kv_heads != cfg.n_heads)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output attn [B, H, N, hd] and the SwiGLU MLP."""
        cfg = self.cfg
        b, n, _ = h.shape
        h = h + self.o_proj(attn.transpose(1, 2).reshape(b, n, cfg.n_heads * cfg.head_dim))
        y = self.mlp_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def forward(
        self,
        h: torch.Tensor,
        sin: torch.Tensor,
        cos: torch.Tensor,
        key_mask: torch.Tensor | None,
        kv: list | None = None,
    ) -> torch.Tensor:
        """One layer over the whole sequence; appends its (keys, values) to ``kv`` when given."""
        q, k, v = self.project(h, sin, cos)
        if kv is not None:
            kv.append((k, v))
        return self.finish(h, self.attend(q, k, v, key_mask))

    def window(
        self, h: torch.Tensor, sin, cos, cache_k: torch.Tensor, cache_v: torch.Tensor, key_mask: torch.Tensor
    ) -> torch.Tensor:
        """One layer over windows h [B*M, W, D] against the cache [B, KV, N, hd] of their rows.

        Each window attends to [its row's cached keys ; its own fresh keys] (``key_mask``
        [B*M, 1, 1, N + W] says which), as ``models.transformer.cached_attention``; the M windows
        of a row are M batch entries, each with its own copy of the row's cache."""
        q, k, v = self.project(h, sin, cos)
        m = h.shape[0] // cache_k.shape[0]
        keys = torch.cat([cache_k.repeat_interleave(m, dim=0), k], dim=2)
        values = torch.cat([cache_v.repeat_interleave(m, dim=0), v], dim=2)
        return self.finish(h, self.attend(q, keys, values, key_mask))


class TorchDiffusionLM(nn.Module):
    """Token ids [B, N] (+ optional 0/1 attention mask) -> raw (unshifted) logits [B, N, V] float32."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        kw = {"dtype": dtype, "device": "meta"}
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, **kw)
        self.layers = nn.ModuleList(Block(cfg, dtype) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, **kw)

    def positions(
        self, attention_mask: torch.Tensor | None, batch: int, length: int, device: torch.device | str
    ) -> torch.Tensor:
        if self.config.positions_from_mask and attention_mask is not None:
            mask = attention_mask.long()
            return torch.where(mask > 0, mask.cumsum(-1) - 1, 1)
        return torch.arange(length, device=device).expand(batch, length)

    def forward(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, logit_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, N, V], or [B, W, V] of the positions ``logit_index`` [B, W] names."""
        return self._head(self._layers(tokens, attention_mask, None), logit_index)

    def prefill(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, logit_index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` that also returns every layer's keys and values (keys after RoPE), the block
        KV cache ``window`` attends to: (logits, keys [L, B, KV, N, hd], values [L, B, KV, N, hd])."""
        kv: list = []
        logits = self._head(self._layers(tokens, attention_mask, kv), logit_index)
        return logits, torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def window(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        key_mask: torch.Tensor,
        out_length: int,
    ) -> torch.Tensor:
        """Logits [B*M, out_length, V] of the first ``out_length`` positions of M windows per row.

        tokens/positions [B*M, W] (rows' windows consecutive); cache_k/cache_v [L, B, KV, N, hd]
        from ``prefill``; key_mask [B*M, N + W]: the cached keys to attend (not pads, not the
        window's own positions, whose fresh keys replace them) and the window's keys to attend."""
        cfg = self.config
        sin, cos = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        mask = key_mask[:, None, None, :]
        h = self.embed(tokens)
        for layer, ck, cv in zip(self.layers, cache_k, cache_v):
            h = layer.window(h, sin, cos, ck, cv, mask)
        return self._head(h[:, :out_length], None)

    def _layers(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None, kv: list | None) -> torch.Tensor:
        cfg = self.config
        batch, length = tokens.shape
        positions = self.positions(attention_mask, batch, length, tokens.device)
        sin, cos = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        # Keys at pad positions are masked for every query; queries are never masked.
        key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, sin, cos, key_mask, kv)
        return h

    def _head(self, h: torch.Tensor, logit_index: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits of hidden states h [B, N, D] (only at ``logit_index`` [B, W] when given)."""
        if logit_index is not None:
            h = h.gather(1, logit_index[..., None].expand(-1, -1, h.shape[-1]))
        h = self.final_norm(h)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()


def _set(module: nn.Module, path: str, value: torch.Tensor) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        module = getattr(module, name)
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def model_from_torch_tensors(
    cfg: ModelConfig, get: Callable[[str], torch.Tensor], dtype: torch.dtype = torch.float32
) -> TorchDiffusionLM:
    """Build the module around torch tensors looked up by Hugging Face key, ``get(hf_key)``, for
    every key of ``convert.keys.expected_keys(cfg)`` (``Linear`` weights in torch's [out, in]).

    The tensors become the parameters as they are (no copy, cast or move), so tensors shared with
    another framework (``torch.from_dlpack``) stay shared; they should be of ``dtype`` and on one
    device. Returns the module in eval mode."""
    from convert.keys import expected_keys

    model = TorchDiffusionLM(cfg, dtype)
    for key, target in expected_keys(cfg).items():
        if target.layer is None:
            _set(model, _TOP_ATTR[target.param], get(key))
        else:
            _set(model.layers[target.layer], _LAYER_ATTR[target.param], get(key))
    leftover = [name for name, p in model.named_parameters() if p.is_meta]
    if leftover:  # cannot happen for a table-complete checkpoint; guards a table/module mismatch
        raise RuntimeError(f"parameters not loaded: {leftover}")
    return model.eval()


def model_from_tensors(
    cfg: ModelConfig,
    get: Callable[[str], np.ndarray],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> TorchDiffusionLM:
    """Build the module from a key-table lookup ``get(hf_key) -> np.ndarray`` (keys checked by the caller)."""

    def to_torch(key: str) -> torch.Tensor:
        host = np.ascontiguousarray(get(key))
        if host.dtype == ml_dtypes.bfloat16:  # numpy has no bfloat16: hand torch the bits
            return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).to(device=device, dtype=dtype)
        return torch.from_numpy(host).to(device=device, dtype=dtype)

    return model_from_torch_tensors(cfg, to_torch, dtype)


def load_hf_torch(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> TorchDiffusionLM:
    """Load a Hugging Face LLaDA/Dream directory into ``TorchDiffusionLM`` (same key table as JAX)."""
    cfg = load_config(model_dir)
    with SafetensorsDir(model_dir) as reader:
        check_key_set(cfg, reader.shapes, str(reader.dir))
        return model_from_tensors(cfg, reader.get, dtype, device)
