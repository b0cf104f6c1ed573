"""SDAR (upstream ``SDARForCausalLM``, e.g. SDAR-8B-Chat) as a Flax NNX module, for block diffusion.

Architecture (upstream ``modeling_sdar.py``, the Qwen3 layout): pre-norm layers of GQA attention with
separate q/k/v projections (no bias), a per-head RMSNorm on q and k (over head_dim) after the
projections and before RoPE (rotate-half on every dim), an output projection and a dense SwiGLU MLP;
final RMSNorm and an untied LM head. Logits are unshifted (position ``i`` predicts token ``i``).

It is LLaDA2.0's block-diffusion module with LLaDA-MoE's attention projections and dense layers
only: ``SDAR`` is an ``LLaDA2MoE`` whose layers are one dense group, so it has the same calls
(``__call__``/``prefill``/``window`` taking ``block_length``: query ``i`` sees key ``j`` iff
``j // block_length <= i // block_length``), the same exact block KV cache and the same
``layouts.BlockCausalLayout``. Numerics as upstream: RMSNorm in float32, rounded, times the weight;
RoPE tables in float32 rounded to the model dtype and applied in it; the LM head rounds to the model
dtype before logits are returned as float32.
"""

from __future__ import annotations

from . import lladamoe
from .config import SDARConfig
from .llada2 import LLaDA2MoE
from .lladamoe import ATTN_PARAMS, DENSE_MLP_PARAMS, LLaDAMoE, attention_shapes, dense_mlp_shapes

TOP_PARAMS = ("embed", "final_norm", "lm_head")


def param_shapes(cfg: SDARConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter by name: ``embed``/``final_norm``/``lm_head`` and the layers stacked
    as ``dense_<name>`` [n_layers, ...] (LLaDA-MoE's dense group)."""
    d = cfg.d_model
    layer = {**attention_shapes(cfg), **dense_mlp_shapes(d, cfg.mlp_hidden)}
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,), "lm_head": (d, cfg.vocab_size)}
    shapes.update({f"dense_{name}": (cfg.n_layers, *shape) for name, shape in layer.items()})
    return shapes


logical_axes = lladamoe.logical_axes


class SDAR(LLaDA2MoE):
    """Token ids [B, N] -> raw logits [B, N, V] in float32, with ``LLaDA2MoE``'s calls (the module
    docstring); the projections are LLaDA-MoE's, and every layer is dense."""

    param_table = staticmethod(param_shapes)

    def group_names(self, group: str) -> list[str]:
        return [*ATTN_PARAMS, *DENSE_MLP_PARAMS]

    _project = LLaDAMoE._project
