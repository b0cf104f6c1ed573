"""The compiled decode loop: oracle equality, compilation reuse, row independence, EOS, errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import GOLDENS

from psd_jax import DecodeConfig, DecodeConfigError, InputError, load_model
from psd_jax.api import LoadedModel
from psd_jax.cli.generate import main as cli_main
from psd_jax.core.engine import batch_keys, decode, decode_python_loop
from psd_jax.core.predict import predict
from psd_jax.core.runtime import Program, RowValues

PROMPTS = [[474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492], [280, 242, 425, 15, 2, 138, 188]]


def _padded(lm, prompts, length):
    ids = np.full((len(prompts), length), lm.config.pad_id, np.int32)
    mask = np.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, length - len(p) :] = p
        mask[r, length - len(p) :] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize(
    "settings",
    [
        DecodeConfig(gen_length=32, block_length=16, steps=16, policy="fixed"),
        DecodeConfig(gen_length=32, block_length=16, policy="threshold", threshold=0.7, decoder="psd", depth=2),
        DecodeConfig(gen_length=32, block_length=16, policy="factor", decoder="rps", k_max=4, pivot_tau=0.5),
    ],
    ids=["fixed", "threshold-psd", "factor-rps"],
)
def test_while_loop_equals_python_loop(lms, settings):
    lm = lms["llada-tiny"]
    ids, mask = _padded(lm, PROMPTS, 16)
    key = jax.random.key(3)
    values, program = RowValues.of([settings] * len(PROMPTS)), Program.of(settings)
    compiled = decode(lm.graphdef, lm.params, ids, mask, key, values, mcfg=lm.config, program=program)
    oracle = decode_python_loop(lm.model, ids, mask, key, values, mcfg=lm.config, program=program)
    np.testing.assert_array_equal(np.asarray(compiled.canvas), np.asarray(oracle.canvas))
    np.testing.assert_array_equal(np.asarray(compiled.row_nfe), np.asarray(oracle.row_nfe))
    assert int(compiled.nfe) == int(oracle.nfe) and int(compiled.iterations) == int(oracle.iterations)
    assert int(compiled.sequence_forwards) == int(oracle.sequence_forwards)
    np.testing.assert_array_equal(np.asarray(compiled.calls), np.asarray(oracle.calls))
    assert int(np.asarray(compiled.calls).sum()) == int(compiled.nfe)
    for name in compiled.stats:
        np.testing.assert_array_equal(np.asarray(compiled.stats[name]), np.asarray(oracle.stats[name]))


def test_same_bucket_prompt_does_not_recompile(lms):
    lm = lms["llada-tiny"]
    settings = DecodeConfig(gen_length=16, block_length=16, steps=8)
    lm.generate([PROMPTS[0]], settings, prompt_bucket=16)
    programs = lm.compiled_programs
    (again,) = lm.generate([PROMPTS[1]], settings, prompt_bucket=16)  # 7 tokens, same 16-token bucket
    assert lm.compiled_programs == programs and again.compile_seconds == 0.0
    (longer,) = lm.generate([PROMPTS[0] * 2], settings, prompt_bucket=16)  # 24 tokens: the next bucket compiles
    assert lm.compiled_programs == programs + 1 and longer.compile_seconds > 0


@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_rows_decode_independently(lms, policy):
    lm = lms["llada-tiny"]
    settings = DecodeConfig(
        gen_length=32, block_length=16, policy=policy, **({"threshold": 0.7} if policy == "threshold" else {})
    )
    batch = lm.generate(PROMPTS, settings, prompt_bucket=16)
    for prompt, row in zip(PROMPTS, batch):
        (alone,) = lm.generate([prompt], settings, prompt_bucket=16)
        assert alone.output_ids == row.output_ids and alone.nfe == row.nfe
    if policy == "threshold":
        assert batch[0].nfe != batch[1].nfe, "rows should need different numbers of calls"


def _with_eos(lm: LoadedModel, eos: int) -> LoadedModel:
    """The same weights with another token declared EOS (the tiny model emits 62 often)."""
    clone = LoadedModel(lm.model, None, lm.path)
    clone.config = lm.config.replace(eos_id=eos)
    return clone


def test_eos_early_exit_fills_the_row_and_saves_calls(lms):
    lm = lms["llada-tiny"]
    eos_lm = _with_eos(lm, 62)
    settings = DecodeConfig(gen_length=48, block_length=16, steps=48)
    full = eos_lm.generate(PROMPTS, settings.replace(eos_early_stop=False), prompt_bucket=16)
    early = eos_lm.generate(PROMPTS, settings, prompt_bucket=16)
    for f, e in zip(full, early):
        first = f.output_ids.index(62)
        block_end = (first // 16 + 1) * 16
        assert block_end < 48, "the case must stop before the last block"
        assert e.output_ids[:block_end] == f.output_ids[:block_end]
        assert e.output_ids[block_end:] == [62] * (48 - block_end)
        assert e.nfe == block_end and f.nfe == 48
        assert e.tokens == first and e.tpf == pytest.approx(first / block_end)


def test_mask_token_is_never_committed(lms):
    lm = lms["llada-tiny"]
    boosted = load_model(GOLDENS / "llada-tiny")  # a private copy: its weights are edited below
    head = boosted.params["lm_head"][...]
    # The mask column becomes twice the column of token 62, which the model often predicts.
    boosted.params["lm_head"].set_value(head.at[:, lm.config.mask_id].set(2.0 * head[:, 62]))
    canvas = [PROMPTS[0] + [lm.config.mask_id] * 16]
    assert (np.asarray(boosted.logits(canvas)).argmax(-1) == lm.config.mask_id).sum() >= 4
    for settings in [
        DecodeConfig(gen_length=16, block_length=16),
        DecodeConfig(gen_length=16, block_length=16, policy="threshold", decoder="psd"),
    ]:
        (out,) = boosted.generate([PROMPTS[0]], settings)
        assert lm.config.mask_id not in out.output_ids


def test_sampling_is_reproducible_from_seed(lms):
    lm = lms["dream-tiny"]
    settings = DecodeConfig(gen_length=32, block_length=16, steps=16, temperature=1.0)
    a = lm.generate(PROMPTS, settings, seed=7)
    b = lm.generate(PROMPTS, settings, seed=7)
    c = lm.generate(PROMPTS, settings, seed=8)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_ids for r in a] != [r.output_ids for r in c]
    greedy = lm.generate(PROMPTS, settings.replace(temperature=0.0))
    assert [r.output_ids for r in a] != [r.output_ids for r in greedy]


def predict_one(lm, canvas, prompt_length: int, settings: DecodeConfig):
    """``predict`` of one canvas [1, N] with ``settings``' program and values, outside the loop."""
    keys, values = batch_keys(jax.random.key(0), 1), RowValues.of([settings])
    return predict(lm.model, canvas[:, None], None, prompt_length, keys, values, lm.config, Program.of(settings))


def test_cfg_combines_conditional_and_unconditional_logits(lms):
    lm = lms["llada-tiny"]
    canvas = jnp.asarray([PROMPTS[0] + [lm.config.mask_id] * 8])
    p = len(PROMPTS[0])
    settings = DecodeConfig(gen_length=8, block_length=8, cfg_scale=2.0)
    pred = predict_one(lm, canvas, p, settings)
    uncond = canvas.at[:, :p].set(lm.config.mask_id)
    cond_l, uncond_l = np.asarray(lm.logits(canvas)), np.asarray(lm.logits(uncond))
    mixed = uncond_l + 3.0 * (cond_l - uncond_l)
    mixed[..., lm.config.mask_id] = -np.inf
    np.testing.assert_array_equal(np.asarray(pred.token[:, 0, p:]), mixed.argmax(-1)[:, p:])
    (out,) = lm.generate([PROMPTS[0]], settings)
    assert out.sequence_forwards == 2 * out.nfe


@pytest.mark.parametrize("name", ["llada-tiny", "dream-tiny"])
def test_prediction_reads_only_the_generated_positions_logits(lms, name):
    """The vocabulary projection runs from the first logit a generated position reads (Dream's
    shift reads one earlier); the prompt positions of the Prediction predict themselves."""
    lm = lms[name]
    p, shift = len(PROMPTS[0]), lm.config.logit_shift
    canvas = jnp.asarray([PROMPTS[0] + [lm.config.mask_id] * 8])
    full = np.asarray(lm.model(canvas))
    np.testing.assert_allclose(np.asarray(lm.model(canvas, logits_from=p - 1)), full[:, p - 1 :], rtol=0, atol=1e-5)
    expected = full[:, p - shift : full.shape[1] - shift].copy()
    expected[..., lm.config.mask_id] = -np.inf
    settings = DecodeConfig(gen_length=8, block_length=8)
    pred = predict_one(lm, canvas, p, settings)
    assert pred.token.shape == pred.conf.shape == (1, 1, p + 8)
    np.testing.assert_array_equal(np.asarray(pred.token[0, 0, p:]), expected[0].argmax(-1))
    np.testing.assert_array_equal(np.asarray(pred.token[0, 0, :p]), PROMPTS[0])
    assert not np.asarray(pred.conf[0, 0, :p]).any()


def test_logits_eos_inf_and_random_remasking(lms):
    lm = _with_eos(lms["llada-tiny"], 62)
    settings = DecodeConfig(gen_length=32, block_length=16, logits_eos_inf=True)
    (out,) = lm.generate([PROMPTS[0]], settings)
    assert 62 not in out.output_ids and out.tokens == 32
    rnd = DecodeConfig(gen_length=32, block_length=16, confidence="random")
    assert lm.generate([PROMPTS[0]], rnd, seed=1)[0].output_ids != lm.generate([PROMPTS[0]], rnd, seed=2)[0].output_ids


# Runtime values no checked setting can hold (DecodeConfig refuses them), given to the compiled loop
# directly: they turn logits and confidences into NaN and inf (the mask's -inf tempered to NaN,
# inf - inf in guidance, lam * -inf in RPS's scores). Every setting commits at least one position
# per step whatever the scores are, so each row's block takes at most block_length calls.
UNBOUNDED = {
    "psd-sampled": (
        DecodeConfig(gen_length=32, block_length=16, policy="threshold", temperature=0.5, decoder="psd", depth=2),
        {"temperature": np.inf, "threshold": np.nan},
    ),
    "psd-sampled-dual": (
        DecodeConfig(
            gen_length=32, block_length=16, policy="threshold", temperature=0.5, decoder="psd", depth=2, cache="dual"
        ),
        {"temperature": np.float32(3e38), "threshold": np.inf},
    ),
    "rps-guided": (
        DecodeConfig(gen_length=32, block_length=16, policy="factor", cfg_scale=1.0, decoder="rps", k_max=4),
        {"cfg_scale": np.inf, "factor": np.nan, "lam": np.inf, "pivot_tau": np.nan},
    ),
}


@pytest.mark.parametrize("name", list(UNBOUNDED))
def test_decode_ends_whatever_the_runtime_values(lms, name):
    from psd_jax.core.runtime import row_keys

    lm = lms["llada-tiny"]
    settings, unbounded = UNBOUNDED[name]
    ids, mask = _padded(lm, PROMPTS, 16)
    values = RowValues.of([settings] * len(PROMPTS))
    values = values.replace(**{k: np.full(len(PROMPTS), v, np.float32) for k, v in unbounded.items()})
    keys = row_keys([0] * len(PROMPTS), range(len(PROMPTS)))
    out = decode(lm.graphdef, lm.params, ids, mask, keys, values, mcfg=lm.config, program=Program.of(settings))
    canvas, row_nfe = np.asarray(out.canvas), np.asarray(out.row_nfe)
    assert not (canvas[:, 16:] == lm.config.mask_id).any()
    # One call per committed position at most (the first forward, and with the cache a block-start
    # refresh beside each block's window calls).
    calls_per_position = 2 if settings.cache != "none" else 1
    assert (row_nfe <= 1 + calls_per_position * settings.gen_length).all(), row_nfe


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=1e308), r"temperature must be 0 \(greedy\) or in \[0.0001, 100\], got 1e\+308"),
        (dict(temperature=1e-50), r"temperature must be 0 \(greedy\) or in \[0.0001, 100\], got 1e-50"),
        (dict(cfg_scale=1e308), r"cfg_scale must be in \[0, 100\] \(0: off\), got 1e\+308"),
        (dict(policy="factor", factor=1e39), r"factor must be in \(0, 100\], got 1e\+39"),
        (dict(decoder="rps", lam=101.0), r"lam \(RPS\) must be in \[0, 100\], got 101.0"),
        (dict(policy="threshold", threshold=1e-50), r"threshold must be in \(0, 1\], got 1e-50 \(0.0 as float32"),
        (dict(gen_length=48, block_length=20), "block_length 20 does not divide gen_length 48"),
        (dict(gen_length=48, block_length=16, steps=20), "steps 20 is not divisible by the number of blocks 3"),
        (dict(threshold=1.5), r"threshold must be in \(0, 1\], got 1.5"),
        (dict(threshold=0.0), r"threshold must be in \(0, 1\], got 0.0"),
        (dict(policy="greedy"), "unknown policy 'greedy'"),
        (dict(decoder="beam"), "unknown decoder 'beam'"),
        (dict(confidence="logit"), "unknown confidence 'logit'"),
    ],
)
def test_bad_settings_fail_early(kwargs, message):
    with pytest.raises(DecodeConfigError, match=message):
        DecodeConfig(**kwargs)


def test_bad_prompts_fail_early(lms):
    lm = lms["llada-tiny"]
    with pytest.raises(InputError, match="prompt 1 is empty"):
        lm.generate([[1, 2], []])
    with pytest.raises(InputError, match=r"exceeds the model's context of 1024"):
        lm.generate([[1] * 1000], DecodeConfig(gen_length=64, block_length=32))
    with pytest.raises(InputError, match="outside the vocabulary"):
        lm.generate([[1, 9999]])
    with pytest.raises(ValueError, match="no tokenizer"):
        lm.generate(["some text"])


def test_chat_without_template_is_an_error():
    from psd_jax.tokenizer import TokenizerError, encode_prompt

    class NoTemplate:
        chat_template = None

    with pytest.raises(TokenizerError, match="--chat needs a chat template, and this tokenizer has none"):
        encode_prompt(NoTemplate(), "hi", chat=True, source="x")


def test_cli_json_output(capsys):
    args = [
        "--model",
        str(GOLDENS / "llada-tiny"),
        "--prompt-ids",
        "1,2,3",
        "--prompt-ids",
        "4,5",
        "--gen-length",
        "32",
        "--block-length",
        "16",
        "--policy",
        "threshold",
        "--decoder",
        "psd",
        "--depth",
        "2",
        "--json",
    ]
    assert cli_main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        obj = json.loads(line)
        assert len(obj["output_ids"]) == 32 and obj["text"] is None
        assert obj["tokens"] == 32 and obj["tpf"] == pytest.approx(32 / obj["nfe"])
        assert sum(obj["stats"]["accepted_depth"]) == obj["nfe"] - 1
        for field in ("sequence_forwards", "seconds", "compile_seconds"):
            assert field in obj


def test_cli_errors_are_clear(capsys):
    model = ["--model", str(GOLDENS / "llada-tiny")]
    assert cli_main(model + ["--prompt-ids", "1,2", "--gen-length", "30", "--block-length", "16"]) == 2
    assert "block_length 16 does not divide gen_length 30" in capsys.readouterr().err
    assert cli_main(model + ["--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids must be comma-separated integers" in capsys.readouterr().err
    assert cli_main(model + ["--prompt", "hello"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert cli_main(model + ["--prompt-ids", "1", "--decoder", "nope"]) == 2
    assert "unknown decoder 'nope'" in capsys.readouterr().err


def test_clear_programs_releases_every_program_and_decodes_the_same_after():
    """Nothing keeps a cleared program alive, so the runtime can free its code (its memory
    mappings: how many the process holds afterwards is the runtime's and the kernel's business,
    which merge and reuse mappings, so it is not asserted here)."""
    import gc
    import weakref

    lm = load_model(GOLDENS / "llada-tiny")
    dcfg = DecodeConfig(gen_length=8, block_length=8, policy="threshold")
    first = lm.generate([[5, 6, 7]], dcfg)
    assert lm.compiled_programs == 1
    program = weakref.ref(next(iter(lm.placed.programs.values())))
    lm.clear_programs()
    gc.collect()
    assert lm.compiled_programs == 0 and program() is None
    again = lm.generate([[5, 6, 7]], dcfg)
    assert again[0].output_ids == first[0].output_ids and lm.compiled_programs == 1
