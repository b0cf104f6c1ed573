"""Model parity with the upstream PyTorch goldens, full-size shapes, conversion and its errors."""

from __future__ import annotations

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from paths import GOLDENS, HF_CONFIGS
from safetensors.numpy import load_file, save_file

from convert import CheckpointError, expected_keys, load_hf_model
from convert.__main__ import main as convert_main
from models import ConfigError, DiffusionLM, config_from_dict, param_shapes
from models.cpu_kernels import JOINED_WINDOWS_MAX, cached_attention_per_head
from models.transformer import (
    attention,
    cached_attention_grouped,
    default_positions,
    matmul,
    rope_inv_freq,
    rope_tables,
    swiglu,
)
from psd_jax import load_model

LOGIT_ATOL = 1e-4  # float32 parity with upstream PyTorch


@pytest.mark.parametrize("name", ["llada-tiny", "llada-tiny-gqa", "dream-tiny"])
def test_forward_logits_match_upstream(lms, cases, name):
    ids = cases[f"{name}.forward.input_ids"]
    logits = np.asarray(lms[name].logits(ids))
    assert logits.dtype == np.float32 and logits.shape == (2, 300, 512)
    np.testing.assert_allclose(logits, cases[f"{name}.forward.logits"], rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("name", ["llada-tiny", "llada-tiny-gqa"])
def test_padded_forward_matches_upstream_at_non_pad_positions(lms, cases, name):
    ids = cases[f"{name}.forward_padded.input_ids"]
    mask = cases[f"{name}.forward_padded.attention_mask"]
    assert (mask == 0).any(), "the case must contain padding"
    logits = np.asarray(lms[name].logits(ids, mask))
    keep = mask.astype(bool)
    np.testing.assert_allclose(logits[keep], cases[f"{name}.forward_padded.logits"][keep], rtol=0, atol=LOGIT_ATOL)


def test_bfloat16_matmul_accumulates_in_float32_and_rounds_once():
    """The layers' bfloat16 products: float32 sums of exact products, one rounding (as torch's)."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (24, 512)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (512, 40)).astype(jnp.bfloat16)
    got = np.asarray(jax.jit(matmul)(x, w).astype(jnp.float32))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    reference = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    # Summation order may move a float32 sum across a rounding boundary: at most one bfloat16 step.
    ulp = 2.0 ** (np.floor(np.log2(np.abs(reference))) - 7)
    assert np.all(np.abs(got - reference) <= ulp)
    assert np.mean(got == reference) > 0.95


def test_bfloat16_swiglu_rounds_once_as_torch():
    """SiLU of a bfloat16 gate evaluated in float32 and rounded once, as torch's kernel (a bfloat16
    ``jax.nn.silu`` rounds after each op and disagrees with torch on about a third of values)."""
    torch = pytest.importorskip("torch")
    kg, ku = jax.random.split(jax.random.key(2))
    gate = (4 * jax.random.normal(kg, (8192,))).astype(jnp.bfloat16)
    up = jax.random.normal(ku, (8192,)).astype(jnp.bfloat16)
    to_torch = lambda a: torch.from_numpy(np.array(a.astype(jnp.float32))).bfloat16()
    want = (torch.nn.functional.silu(to_torch(gate)) * to_torch(up)).float().numpy()
    got = np.asarray(jax.jit(swiglu)(gate, up).astype(jnp.float32))
    # exp differs by a float32 ulp between the libraries: rarely a bfloat16 rounding boundary.
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
    assert np.all(np.abs(got - want) <= ulp)
    assert np.mean(got == want) > 0.999


@pytest.mark.parametrize("name", ["llada-tiny", "dream-tiny"])
def test_bfloat16_logits_are_the_heads_bfloat16_values(name):
    """A bfloat16 model's logits are its LM head's bfloat16 products returned as float32, as upstream's
    ``lm_head(h).float()`` (not the head's unrounded float32 sums): the confidences every decoder
    ranks and thresholds are then read from the values upstream reads them from."""
    model = load_hf_model(GOLDENS / name, dtype=jnp.bfloat16)
    ids = jnp.arange(40, dtype=jnp.int32).reshape(2, 20) % model.config.vocab_size
    logits = np.asarray(jax.jit(lambda t: model(t))(ids))
    assert logits.dtype == np.float32
    np.testing.assert_array_equal(logits, np.asarray(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32)))
    assert len(np.unique(logits)) > 1000  # real values, not a constant that any rounding keeps


def test_rope_tables_match_their_definition():
    positions = jnp.array([[0, 1, 2, 7, 4095], [1, 1, 0, 1, 2]])
    sin, cos = rope_tables(positions, 8, 10000.0)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    angles = np.concatenate([np.asarray(positions)[..., None] * inv_freq] * 2, axis=-1)
    np.testing.assert_allclose(sin, np.sin(angles), rtol=0, atol=2e-6)
    np.testing.assert_allclose(cos, np.cos(angles), rtol=0, atol=2e-6)


def _torch_inv_freq(torch, head_dim: int, theta: float, elementwise: bool = False) -> np.ndarray:
    """Upstream's table, Dream's form; ``elementwise`` takes each power of a 1-element tensor, which
    torch's CPU kernel evaluates with the scalar ``powf`` instead of its vectorised (Sleef) pow."""
    exponent = torch.arange(0, head_dim, 2).float() / head_dim
    if elementwise:
        power = torch.cat([theta ** exponent[i : i + 1] for i in range(len(exponent))])
    else:
        power = theta**exponent
    return (1.0 / power).numpy()


def _rope_pairs() -> list[tuple[str, int, float]]:
    """(name, head_dim, theta) of the real LLaDA-8B and Dream-7B configs and the golden tiny models."""
    dirs = {"LLaDA-8B": HF_CONFIGS / "LLaDA-8B-Instruct", "Dream-7B": HF_CONFIGS / "Dream-v0-Instruct-7B"}
    dirs.update({name: GOLDENS / name for name in ("llada-tiny", "llada-tiny-gqa", "dream-tiny")})
    pairs = []
    for name, path in dirs.items():
        cfg = config_from_dict(json.loads((path / "config.json").read_text()))
        pairs.append((name, cfg.head_dim, cfg.rope_theta))
    return pairs


def test_rope_inv_freq_is_upstream_float32_table_bit_for_bit():
    """The host table is torch's ``1 / theta ** (arange(0, d, 2).float() / d)`` bit for bit on the
    real and golden configs, and on every (head_dim, theta) against torch's scalar pow. torch's
    vectorised pow is within an ulp of its scalar one and differs from it in a few entries (one of
    Dream-7B's 64); which entries it takes depends on the CPU's vector width."""
    torch = pytest.importorskip("torch")
    pairs = _rope_pairs()
    assert {(d, t) for _, d, t in pairs} == {(128, 500000.0), (128, 1e6), (16, 500000.0), (16, 1e6)}
    for name, head_dim, theta in pairs:
        host = rope_inv_freq(head_dim, theta)
        assert host.dtype == np.float32 and host.shape == (head_dim // 2,)
        llada_form = (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))).numpy()
        np.testing.assert_array_equal(llada_form, _torch_inv_freq(torch, head_dim, theta), err_msg=name)
        np.testing.assert_array_equal(host, _torch_inv_freq(torch, head_dim, theta, elementwise=True), err_msg=name)
        ulps = np.abs(host.view(np.int32) - _torch_inv_freq(torch, head_dim, theta).view(np.int32))
        assert ulps.max() <= 1 and (name == "Dream-7B" or ulps.max() == 0), name
    for head_dim in (16, 32, 64, 96, 128):
        for theta in (10000.0, 500000.0, 1e6, 600000.0):
            want = _torch_inv_freq(torch, head_dim, theta, elementwise=True)
            np.testing.assert_array_equal(rope_inv_freq(head_dim, theta), want, err_msg=f"{head_dim}, {theta}")


def test_rope_tables_use_the_host_table():
    """The angles are positions times the host table (one float32 product), not XLA's in-graph pow
    (which differs in a few entries of (16, 1e6), moving sin/cos at long positions)."""
    positions = jnp.array([[0, 1, 299, 4095], [7, 8, 9, 1000]])
    sin, cos = jax.jit(rope_tables, static_argnums=(1, 2))(positions, 16, 1e6)
    freqs = np.asarray(positions, np.float32)[..., None] * rope_inv_freq(16, 1e6)
    angles = jnp.asarray(np.concatenate([freqs, freqs], axis=-1))
    np.testing.assert_array_equal(sin, jax.jit(jnp.sin)(angles))
    np.testing.assert_array_equal(cos, jax.jit(jnp.cos)(angles))


def test_model_positions_method_is_the_position_rule(lms):
    """``DiffusionLM.positions`` (what the decode engine asks) equals ``default_positions``."""
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for name in ("llada-tiny", "dream-tiny"):
        model = lms[name].model
        for m in (mask, None):
            np.testing.assert_array_equal(model.positions(m, 2, 5), default_positions(model.config, m, 2, 5))
    np.testing.assert_array_equal(lms["dream-tiny"].model.positions(mask, 2, 5), [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(lms["llada-tiny"].model.positions(mask, 2, 5), [[0, 1, 2, 3, 4]] * 2)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_attention_matches_jax_dot_product_attention(heads, kv_heads):
    """The per-head attention (CPU) against the library's, with padded keys and grouped kv heads."""
    kq, kk, kv_ = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (3, 20, heads, 16))
    k, v = jax.random.normal(kk, (3, 20, kv_heads, 16)), jax.random.normal(kv_, (3, 20, kv_heads, 16))
    key_mask = (jnp.arange(20)[None, :] < jnp.array([[20], [13], [5]]))[:, None, None, :]
    want = jax.nn.dot_product_attention(q, k, v, mask=key_mask)
    np.testing.assert_allclose(attention(q, k, v, key_mask), want, rtol=0, atol=2e-6)
    np.testing.assert_allclose(attention(q, k, v, None), jax.nn.dot_product_attention(q, k, v), rtol=0, atol=2e-6)


@pytest.mark.parametrize("m", [1, JOINED_WINDOWS_MAX, JOINED_WINDOWS_MAX + 1])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_cached_attention_per_head_matches_grouped(heads, kv_heads, m):
    """The CPU per-head cache attention against the head-batched form, with masked cache keys,
    masked window keys and grouped kv heads, in both of its forms (windows joined with the cache,
    up to ``JOINED_WINDOWS_MAX`` windows per row, or apart)."""
    keys = jax.random.split(jax.random.key(3), 5)
    b, w, n, hd = 2, 4, 10, 16
    q = jax.random.normal(keys[0], (b, m, w, heads, hd))
    k, v = (jax.random.normal(key, (b, m, w, kv_heads, hd)) for key in keys[1:3])
    cache_k, cache_v = (jax.random.normal(key, (b, n, kv_heads, hd)) for key in keys[3:5])
    cache_mask = jnp.arange(n)[None, :] < jnp.array([[10], [6]])
    every_query = jnp.array([[True, True, False, True], [True, True, True, True]])  # [B, W]
    per_query = jnp.broadcast_to(jnp.tril(jnp.ones((w, w), bool)), (b, m, w, w))  # [B, M, W, W], block-causal
    for window_mask in (every_query, per_query):
        args = (q, k, v, cache_k, cache_v, cache_mask, window_mask)
        want = cached_attention_grouped(*args)
        np.testing.assert_allclose(cached_attention_per_head(*args), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "hf_dir, n_keys, n_params",
    [("LLaDA-8B-Instruct", 291, 8_015_581_184), ("Dream-v0-Instruct-7B", 339, 7_615_616_512)],
)
def test_full_size_key_table_and_param_count(hf_dir, n_keys, n_params):
    cfg = config_from_dict(json.loads((HF_CONFIGS / hf_dir / "config.json").read_text()))
    index = json.loads((HF_CONFIGS / hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    keys = expected_keys(cfg)
    assert set(keys) == set(index) and len(keys) == n_keys
    model = nnx.eval_shape(lambda: DiffusionLM(cfg, dtype=jnp.bfloat16))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(leaf.size for leaf in leaves) == n_params == cfg.param_count()
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)


def test_orbax_round_trip_gives_identical_logits(tmp_path, lms):
    out = tmp_path / "converted"
    assert convert_main(["--hf-dir", str(GOLDENS / "dream-tiny"), "--out", str(out), "--dtype", "float32"]) == 0
    assert not (out / "model.safetensors").exists()
    converted = load_model(out)
    ids = np.arange(60).reshape(2, 30) % 500
    np.testing.assert_array_equal(np.asarray(converted.logits(ids)), np.asarray(lms["dream-tiny"].logits(ids)))
    # bfloat16 conversion stores bfloat16 and loads back to the requested dtype.
    out16 = tmp_path / "bf16"
    assert convert_main(["--hf-dir", str(GOLDENS / "llada-tiny"), "--out", str(out16)]) == 0
    lm16 = load_model(out16, dtype="bfloat16")
    assert lm16.model.layer_weights()["wq"].dtype == jnp.bfloat16
    assert lm16.logits(ids).dtype == jnp.float32


def test_converted_checkpoint_has_one_item_per_parameter_and_names_its_faults(tmp_path):
    out = tmp_path / "converted"
    assert convert_main(["--hf-dir", str(GOLDENS / "llada-tiny"), "--out", str(out)]) == 0
    cfg = load_model(out).config
    assert sorted(p.name for p in (out / "params").iterdir()) == sorted(param_shapes(cfg))
    shutil.rmtree(out / "params" / "wq")
    with pytest.raises(CheckpointError, match=r"missing \['wq'\]"):
        load_model(out)
    (out / "psd_jax.json").write_text('{"format": "orbax", "dtype": "bfloat16"}')
    with pytest.raises(CheckpointError, match="format 'orbax'.*convert it again"):
        load_model(out)


def test_converter_checks_the_key_set_before_writing(tmp_path):
    d = _copy_ckpt(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.transformer.blocks.1.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    assert convert_main(["--hf-dir", str(d), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_reader_returns_bf16_and_f32_tensors_exactly(tmp_path):
    """Positioned reads (no memory map) give the stored values and dtypes, bf16 included."""
    import ml_dtypes

    from convert.safetensors_dir import SafetensorsDir

    a = np.arange(-6, 6, dtype=np.float32).reshape(3, 4) / 4  # exactly representable in bf16
    b = np.linspace(0, 1, 5, dtype=np.float32)
    header = {
        "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
        "b": {"dtype": "F32", "shape": [5], "data_offsets": [24, 44]},
    }
    raw = json.dumps(header).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + a.astype(ml_dtypes.bfloat16).tobytes() + b.tobytes())
    with SafetensorsDir(tmp_path) as reader:
        got_a, got_b = reader.get("a"), reader.get("b")
    assert got_a.dtype == ml_dtypes.bfloat16 and got_b.dtype == np.float32
    np.testing.assert_array_equal(got_a.astype(np.float32), a)
    np.testing.assert_array_equal(got_b, b)


def _copy_ckpt(tmp_path, name="llada-tiny"):
    dst = tmp_path / name
    shutil.copytree(GOLDENS / name, dst)
    dst.chmod(0o755)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def test_missing_tensor_is_named(tmp_path):
    d = _copy_ckpt(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.transformer.blocks.1.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.transformer\.blocks\.1\.up_proj\.weight"):
        load_hf_model(d)


def test_unexpected_tensor_is_named(tmp_path):
    d = _copy_ckpt(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.transformer.blocks.9.q_proj.weight"] = tensors["model.transformer.blocks.0.q_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.transformer\.blocks\.9\.q_proj\.weight"):
        load_hf_model(d)


def test_wrong_shape_is_named(tmp_path):
    d = _copy_ckpt(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.transformer.blocks.0.k_proj.weight"] = tensors["model.transformer.blocks.0.k_proj.weight"].T.copy()
    tensors["model.transformer.blocks.0.k_proj.weight"] = np.zeros((64, 32), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.transformer\.blocks\.0\.k_proj\.weight' has shape \(64, 32\), expected \(64, 64\)",
    ):
        load_hf_model(d)


def test_duplicated_tensor_across_shards_is_named(tmp_path):
    d = _copy_ckpt(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:10]}, str(d / "a.safetensors"))
    save_file({k: tensors[k] for k in names[9:]}, str(d / "b.safetensors"))
    weight_map = {k: ("a.safetensors" if i < 10 else "b.safetensors") for i, k in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"duplicated tensor '{names[9]}' in a\.safetensors and b\.safetensors"):
        load_hf_model(d)


def test_sharded_checkpoint_loads_like_single_file(tmp_path, lms):
    d = _copy_ckpt(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:10]}, str(d / "a.safetensors"))
    save_file({k: tensors[k] for k in names[10:]}, str(d / "b.safetensors"))
    weight_map = {k: ("a.safetensors" if i < 10 else "b.safetensors") for i, k in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = np.arange(40).reshape(2, 20)
    np.testing.assert_array_equal(np.asarray(load_model(d).logits(ids)), np.asarray(lms["llada-tiny"].logits(ids)))


def test_truncated_file_is_named(tmp_path):
    d = _copy_ckpt(tmp_path)
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: truncated safetensors file: tensor '.*' needs bytes"
    ):
        load_hf_model(d)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"truncated safetensors file \(5 bytes, no header\)"):
        load_hf_model(d)
    header_len = struct.unpack("<Q", data[:8])[0]
    path.write_bytes(data[: 8 + header_len // 2])
    with pytest.raises(CheckpointError, match=r"truncated safetensors file \(header of"):
        load_hf_model(d)


def test_unknown_model_type_is_named(tmp_path):
    d = _copy_ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json: unknown model_type 'gpt2'"):
        load_model(d)


def test_missing_weights_file_is_named(tmp_path):
    d = _copy_ckpt(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"no weights: neither a Hugging Face safetensors directory \(model.safetensors or .*\) nor a",
    ):
        load_model(d)


def test_dream_real_tokenizer_encodes_and_applies_chat_template():
    from psd_jax.tokenizer import load_tokenizer, resolve_special_ids

    tok = load_tokenizer(HF_CONFIGS / "Dream-v0-Instruct-7B", "dream")
    ids = tok("Hello world", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "Hello world" and len(ids) == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    cfg = config_from_dict(json.loads((HF_CONFIGS / "Dream-v0-Instruct-7B" / "config.json").read_text()))
    assert tok.convert_ids_to_tokens(cfg.mask_id) == "<|mask|>"
    resolved = resolve_special_ids(cfg, tok, "dream")
    assert resolved.eot_id == tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert resolved.stop_ids == (151643, 151645)


def test_dream_logit_shift_is_declared_by_the_model(lms):
    assert lms["dream-tiny"].config.logit_shift == 1 and lms["llada-tiny"].config.logit_shift == 0


@pytest.mark.parametrize("name", ["llada-tiny-gqa", "dream-tiny"])
def test_unrolled_layers_equal_scanned_layers(name):
    """The two layer layouts are one model: the same logits, KV cache and window logits (to the
    float32 tolerance of the goldens: XLA fuses the two graphs differently), decoded tokens and
    call counts."""
    from psd_jax import DecodeConfig

    scanned, unrolled = (load_model(GOLDENS / name, unroll_layers=u) for u in (False, True))
    assert (scanned.model.unrolled, unrolled.model.unrolled) == (False, True)
    assert len(nnx.state(unrolled.model, nnx.Param)["layers"]) == scanned.config.n_layers
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 400)
    mask = jnp.ones_like(tokens).at[0, :3].set(0)
    outs = [lm.model.prefill(tokens, mask) for lm in (scanned, unrolled)]
    for a, b in zip(*outs):  # logits, keys [L, ...], values [L, ...]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=LOGIT_ATOL)
    _, keys, values = outs[0]
    window = (
        tokens[:, None, 8:16],
        jnp.broadcast_to(jnp.arange(8, 16), (2, 1, 8)),
        keys,
        values,
        jnp.ones((2, 24), bool).at[:, 8:16].set(False),
        jnp.ones((2, 8), bool),
        8,
    )
    np.testing.assert_allclose(
        np.asarray(scanned.model.window(*window)), np.asarray(unrolled.model.window(*window)), rtol=0, atol=LOGIT_ATOL
    )
    settings = DecodeConfig(gen_length=32, block_length=8, policy="threshold", threshold=0.7, cache="dual")
    prompts = [[5, 9, 31, 7], [12, 4, 4, 8, 100, 3]]
    a, b = scanned.generate(prompts, settings), unrolled.generate(prompts, settings)
    assert [(g.output_ids, g.nfe) for g in a] == [(g.output_ids, g.nfe) for g in b]


def test_unrolled_model_exports_the_weights_it_loaded(tmp_path):
    from convert.export import export_hf

    export_hf(load_model(GOLDENS / "llada-tiny-gqa", unroll_layers=True).model, tmp_path / "re-exported")
    reloaded = load_file(str(tmp_path / "re-exported" / "model.safetensors"))
    original = load_file(str(GOLDENS / "llada-tiny-gqa" / "model.safetensors"))
    assert reloaded.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(reloaded[key], value.astype(np.float32), err_msg=key)


def test_cpu_loads_unrolled_by_default(lms):
    """On the CPU backend load_model picks the unrolled layout unless told otherwise."""
    assert jax.default_backend() == "cpu"
    assert all(lm.model.unrolled for lm in lms.values())


@pytest.mark.parametrize("unroll", [True, False])
def test_prefill_into_replaces_only_the_given_rows_of_the_cache(unroll):
    """A refresh writes each layer's fresh keys/values into the carried cache: the chosen rows get
    exactly a fresh prefill's, the others keep theirs, in both layer layouts."""
    cfg = config_from_dict(json.loads((GOLDENS / "llada-tiny-gqa" / "config.json").read_text()))
    model = DiffusionLM(cfg, rngs=nnx.Rngs(3), unroll_layers=unroll)
    tokens = jax.random.randint(jax.random.key(1), (3, 20), 0, cfg.vocab_size)
    logits, keys, values = model.prefill(tokens)
    old = (keys + 1.0, values - 1.0)
    rows = jnp.array([True, False, True])
    got_logits, got_k, got_v = model.prefill(tokens, into=(*old, rows))
    np.testing.assert_array_equal(got_logits, logits)
    pick = rows[None, :, None, None, None]
    np.testing.assert_array_equal(got_k, jnp.where(pick, keys, old[0]))
    np.testing.assert_array_equal(got_v, jnp.where(pick, values, old[1]))


def test_compiling_for_traces_the_target_platform_forms():
    """Ahead-of-time compiles for an accelerator from this CPU host trace the accelerator's forms."""
    from models.transformer import compiling_for, default_unroll_layers, on_cpu

    assert on_cpu() and default_unroll_layers()
    with compiling_for("tpu"):
        assert not on_cpu() and not default_unroll_layers()
        with compiling_for("cpu"):
            assert on_cpu()
        assert not on_cpu()
    assert on_cpu()


def test_every_family_has_one_registration_that_every_reader_uses():
    """``models.FAMILIES`` holds each family once, by its name: its golden directory loads through
    it as its own family, the config class of every row is in ``AnyConfig``, a block-causal family
    (and only one) has stop rules, and the decode's samplers are the registration's. A config of no
    registered family is refused by name instead of falling through to another family's module."""
    import typing

    import models
    from psd_jax.core import families

    goldens = {
        "llada": "llada-tiny",
        "dream": "dream-tiny",
        "llada2_moe": "llada2-tiny",
        "lladamoe": "lladamoe-tiny",
        "sdar": "sdar-tiny",
        "diffusion_gemma": "diffusion-gemma-tiny",
    }
    assert set(models.FAMILIES) == set(goldens)
    assert {f.config for f in models.FAMILIES.values()} == set(typing.get_args(models.AnyConfig))
    for name, family in models.FAMILIES.items():
        cfg = models.load_config(GOLDENS / goldens[name])
        assert (cfg.family, type(cfg)) == (name, family.config)
        assert models.family_of(cfg) is family and models.model_class(cfg) is family.model
        assert (family.stops is not None) == bool(getattr(cfg, "block_causal", False))
        if family.sampler is not None:
            assert families.sampler_for(name) is family.sampler
    with pytest.raises(TypeError, match="no model family is registered for object"):
        models.family_of(object())
    with pytest.raises(ValueError, match="'llada' is not block-causal"):
        families.block_stop_rules("llada")
