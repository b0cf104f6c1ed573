"""psd-jax's DiffusionGemma parameters -> DeepMind's gemma (``gemma.diffusion``) model and param tree.

Runs in the gemma venv (its own venv, scripts/peers/deepmind_gemma/README.md). Input: a directory written by
``export_weights.py`` (``params.npz`` in psd-jax's layout, ``psd_config.json``).

    from dm_params import load
    model, params_denoiser, params_encoder, cfg = load("build/peers/weights/tiny")

``model`` is ``gemma.diffusion.DiffusionGemma_26B_A4B`` (the released class) with its
``config`` replaced by a ``TransformerConfig`` of the checkpoint's shape and
``self_conditioning_config`` sized to it. The two param trees differ only in
``layer_{i}/skip_scale``: DeepMind's block has ONE ``skip_scale`` per layer
(gemma/gm/nn/gemma4/_modules.py:499, applied at :662) used for both the prefill/append-to-cache
pass and the denoiser pass, where the Hugging Face checkpoint has two buffers per layer
(``model.decoder.layers.N.layer_scalar`` = psd-jax ``*_denoiser_scalar`` and
``model.encoder.language_model.layers.N.layer_scalar`` = ``*_encoder_scalar``).
``params_denoiser`` carries the denoiser's scalars (what the denoising forward and thus the
sampler's hot loop should use); ``params_encoder`` the encoder's. Running DeepMind's sampler with one
tree therefore uses that scalar for both passes; the forward comparison in ``compare_forward.py``
prefills with ``params_encoder`` and denoises with ``params_denoiser`` to match the checkpoint.

Mapping (psd-jax name [shape] -> DeepMind path [shape]); d = d_model, N heads, K kv heads,
hd head dim, F dense hidden, E experts, H expert hidden; ``L`` the layer's index in its group:

  embed [V, d]                    -> embedder/input_embedding [V, d]  (tied: also the LM head)
  final_norm [d]                  -> final_norm/scale
  sc_pre_norm [d]                 -> self_conditioner/pre_norm/scale
  sc_gate, sc_up [d, F]           -> self_conditioner/ffw/gating_einsum [2, F, d] (gate.T, up.T)
  sc_down [F, d]                  -> self_conditioner/ffw/linear [F, d]
  (self_conditioner/post_norm has no scale; psd-jax's outer norm has none either)
 per layer i (psd-jax's layer<i>_<name>, written g_<name> below; g = sliding|full):
  g_input_norm                    -> layer_i/pre_attention_norm/scale
  g_wq [d, N*hd]                  -> layer_i/attn/q_einsum/w [N, d, hd]
  sliding: g_wk, g_wv [d, K*hd]   -> layer_i/attn/kv_einsum/w [2, K, d, hd]
  full:    g_wk [d, K*hd]         -> layer_i/attn/k_einsum/w [K, d, hd]   (k_eq_v: value = raw key)
  g_q_norm, g_k_norm [hd]         -> layer_i/attn/query_norm/scale, key_norm/scale
  g_wo [N*hd, d]                  -> layer_i/attn/attn_vec_einsum/w [N, hd, d]
  g_post_attention_norm           -> layer_i/post_attention_norm/scale
  DENSE branch (HF mlp, pre_feedforward_layernorm, post_feedforward_layernorm_1):
  g_pre_ff_norm                   -> layer_i/pre_ffw2_norm/scale
  g_w_gate, g_w_up [d, F]         -> layer_i/mlp2/gating_einsum [2, F, d]
  g_w_down [F, d]                 -> layer_i/mlp2/linear [F, d]
  g_post_ff_norm_1                -> layer_i/post_ffw2_norm/scale
  EXPERT branch (HF router/experts, pre_feedforward_layernorm_2, post_feedforward_layernorm_2):
  g_pre_ff_norm_2                 -> layer_i/pre_ffw_norm/scale
  g_router [d, E]                 -> layer_i/mlp/router_logits/w [d, E]
  g_router_scale [d]              -> layer_i/mlp/router_scale [d]
  g_expert_scale [E]              -> layer_i/mlp/per_expert_scale [E]
  g_expert_gate_up [E, d, 2H] (gate at even columns, up at odd) -> layer_i/mlp/gating_einsum/w [E, 2, H, d]
  g_expert_down [E, H, d]         -> layer_i/mlp/linear/w [E, H, d]
  g_post_ff_norm_2                -> layer_i/post_ffw1_norm/scale
  g_post_ff_norm                  -> layer_i/post_ffw_norm/scale
  g_denoiser_scalar / g_encoder_scalar [] -> layer_i/skip_scale [1]  (see above)

i.e. DeepMind's "mlp"/"ffw"/"ffw1" names are the EXPERT branch and "mlp2"/"ffw2" the DENSE
branch, the reverse of the checkpoint's numbering (gemma/gm/nn/gemma4/_modules.py:566-586,
:676-686).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"


def dm_config(c: dict):
    """DeepMind ``TransformerConfig`` for psd-jax's ``DiffusionGemmaConfig`` (as a dict)."""
    from gemma.gm.nn.gemma4 import _config, _modules

    if abs(c["norm_eps"] - 1e-6) > 1e-12:
        raise ValueError(f"DeepMind's RMSNorm hard-codes eps 1e-6; this config has {c['norm_eps']}")
    types = {SLIDING: _modules.AttentionType.LOCAL_SLIDING, FULL: _modules.AttentionType.GLOBAL}
    return _config.TransformerConfig(
        num_embed=c["vocab_size"],
        embed_dim=c["d_model"],
        hidden_dim=c["mlp_hidden"],  # self-conditioning MLP's hidden (DiffusionGemma_26B_A4B.setup)
        num_heads=c["n_heads"],
        head_dim=c["head_dim"],
        num_kv_heads=c["n_kv_heads"],
        final_logit_softcap=c["final_softcap"] or None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=tuple(types[t] for t in c["layer_types"]),
        attn_logits_soft_cap=None,
        sliding_window_size=c["sliding_window"],
        qk_norm_with_scale=True,
        num_global_kv_heads=c["n_global_kv_heads"],
        global_key_size=c["global_head_dim"],
        k_eq_v_global=True,
        global_rope_proportion=c["global_partial_rotary"],
        local_rope_proportion=1.0,
        local_base_frequency=int(c["rope_theta"]),
        global_base_frequency=int(c["global_rope_theta"]),
        per_layer_input_dim=0,
        kv_cache_sharing_config=None,
        vision_encoder=None,
        audio_encoder=None,
        enable_moe=True,
        num_experts=c["n_experts"],
        expert_dim=c["moe_hidden"],
        top_k_experts=c["n_experts_per_tok"],
        moe_dense_hidden_dim=c["mlp_hidden"],
        use_bidirectional_attention=None,
    )


def dm_model(c: dict, *, sliding_window_size: int | None = None):
    """The released ``DiffusionGemma_26B_A4B`` class with this shape's config (text only).
    ``sliding_window_size`` overrides the config's window (the forward comparison uses it)."""
    import dataclasses

    from gemma.diffusion import _models, _transformer

    cfg = dm_config(c)
    if sliding_window_size is not None:
        cfg = dataclasses.replace(cfg, sliding_window_size=sliding_window_size)
    return _models.DiffusionGemma_26B_A4B(
        config=cfg,
        self_conditioning_config=_transformer.SelfConditioningConfig(features=c["d_model"], hidden_dim=c["mlp_hidden"]),
    )


def abstract_params(model, c: dict) -> dict:
    """DeepMind's param tree (ShapeDtypeStructs) for ``model``, from ``model.init`` traced abstractly."""
    b, length = 1, 4
    return jax.eval_shape(
        lambda: model.init(
            jax.random.PRNGKey(0),
            tokens=jnp.ones((b, length), jnp.int32),
            sc_embeddings=jnp.ones((b, length, c["d_model"]), jnp.float32),
            attention_mask=jnp.ones((b, length, length), bool),
            method=model.call_with_self_conditioning,
        )["params"]
    )


def map_params(p: dict[str, np.ndarray], c: dict, *, scalar: str = "denoiser") -> dict:
    """DeepMind's nested param dict from psd-jax's flat params ``p``; ``scalar`` picks which of the
    checkpoint's two layer scalars becomes ``skip_scale`` ("denoiser" or "encoder")."""
    d, n = c["d_model"], c["n_heads"]
    T = lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))  # noqa: E731
    out = {
        "embedder": {"input_embedding": p["embed"]},
        "final_norm": {"scale": p["final_norm"]},
        "self_conditioner": {
            "pre_norm": {"scale": p["sc_pre_norm"]},
            "ffw": {"gating_einsum": np.stack([T(p["sc_gate"]), T(p["sc_up"])]), "linear": p["sc_down"]},
        },
    }
    for i, t in enumerate(c["layer_types"]):
        g = "sliding" if t == SLIDING else "full"
        w = lambda name, i=i: p[f"layer{i}_{name}"]  # noqa: E731
        kv, hd = (c["n_kv_heads"], c["head_dim"]) if g == "sliding" else (c["n_global_kv_heads"], c["global_head_dim"])
        attn = {
            "q_einsum": {"w": w("wq").reshape(d, n, hd).transpose(1, 0, 2)},
            "attn_vec_einsum": {"w": w("wo").reshape(n, hd, d)},
            "query_norm": {"scale": w("q_norm")},
            "key_norm": {"scale": w("k_norm")},
        }
        k = w("wk").reshape(d, kv, hd).transpose(1, 0, 2)
        if g == "sliding":
            v = w("wv").reshape(d, kv, hd).transpose(1, 0, 2)
            attn["kv_einsum"] = {"w": np.stack([k, v])}
        else:
            attn["k_einsum"] = {"w": k}
        out[f"layer_{i}"] = {
            "pre_attention_norm": {"scale": w("input_norm")},
            "attn": attn,
            "post_attention_norm": {"scale": w("post_attention_norm")},
            # dense branch (checkpoint: mlp, pre_feedforward_layernorm, post_feedforward_layernorm_1)
            "pre_ffw2_norm": {"scale": w("pre_ff_norm")},
            "mlp2": {"gating_einsum": np.stack([T(w("w_gate")), T(w("w_up"))]), "linear": w("w_down")},
            "post_ffw2_norm": {"scale": w("post_ff_norm_1")},
            # expert branch (checkpoint: router, experts, pre_feedforward_layernorm_2, post_..._2)
            "pre_ffw_norm": {"scale": w("pre_ff_norm_2")},
            "mlp": {
                "router_logits": {"w": w("router")},
                "router_scale": w("router_scale"),
                "per_expert_scale": w("expert_scale"),
                "gating_einsum": {
                    "w": np.stack([T(w("expert_gate_up")[..., 0::2]), T(w("expert_gate_up")[..., 1::2])], axis=1)
                },
                "linear": {"w": w("expert_down")},
            },
            "post_ffw1_norm": {"scale": w("post_ff_norm_2")},
            "post_ffw_norm": {"scale": w("post_ff_norm")},
            "skip_scale": np.asarray(w(f"{scalar}_scalar"), np.float32).reshape(1),
        }
    return out


def check_against(tree: dict, abstract: dict) -> int:
    """Assert ``tree`` has exactly ``abstract``'s keys and shapes (per key); returns the key count."""
    flat = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    want = dict(jax.tree_util.tree_flatten_with_path(abstract)[0])
    name = lambda path: "/".join(str(getattr(k, "key", k)) for k in path)  # noqa: E731
    got_n = {name(k): v for k, v in flat.items()}
    want_n = {name(k): v for k, v in want.items()}
    missing, extra = sorted(set(want_n) - set(got_n)), sorted(set(got_n) - set(want_n))
    assert not missing and not extra, f"missing {missing[:8]} extra {extra[:8]}"
    for k, v in want_n.items():
        assert tuple(got_n[k].shape) == tuple(v.shape), f"{k}: mapped {got_n[k].shape}, DeepMind wants {v.shape}"
    return len(want_n)


def load(weights_dir: str | Path, *, dtype=jnp.float32, sliding_window_size: int | None = None):
    """(model, params with the denoiser's skip_scale, params with the encoder's, psd config dict)."""
    weights_dir = Path(weights_dir)
    c = json.loads((weights_dir / "psd_config.json").read_text())
    with np.load(weights_dir / "params.npz") as z:
        p = {k: z[k] for k in z.files}
    model = dm_model(c, sliding_window_size=sliding_window_size)
    abstract = abstract_params(model, c)
    trees = []
    for scalar in ("denoiser", "encoder"):
        tree = map_params(p, c, scalar=scalar)
        check_against(tree, abstract)
        trees.append(jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), tree))
    return model, trees[0], trees[1], c


if __name__ == "__main__":
    import sys

    for wd in sys.argv[1:] or ["build/peers/weights/tiny"]:
        c = json.loads((Path(wd) / "psd_config.json").read_text())
        model = dm_model(c)
        abstract = abstract_params(model, c)
        with np.load(Path(wd) / "params.npz") as z:
            p = {k: z[k] for k in z.files}
        n = check_against(map_params(p, c), abstract)
        total = sum(int(np.prod(v.shape)) for v in jax.tree_util.tree_leaves(abstract))
        print(f"{wd}: {n} DeepMind param keys, every shape checked; {total} parameters")
        if "-v" in sys.argv or len(sys.argv) <= 2:
            for path, v in jax.tree_util.tree_flatten_with_path(abstract)[0]:
                print("  " + "/".join(str(getattr(k, "key", k)) for k in path), tuple(v.shape))
