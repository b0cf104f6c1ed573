"""Bad input on every front end: one clear line, exit code 2, no traceback, no hang, nothing
silently replaced; and the settings the CLI derives from ``DecodeConfig``."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest
from cli_errors import one_line_error as _one_line_error
from paths import GOLDENS

from psd_jax import DecodeConfig, DecodeConfigError, InputError, load_model
from psd_jax.cli import bench
from psd_jax.cli.flags import decode_fields, flag_name
from psd_jax.cli.generate import build_parser
from psd_jax.cli.generate import main as generate_main
from psd_jax.core.config import FIELD_HELP, RECOMMENDED, USED_ONLY_WITH, settings_from
from psd_jax.model_dir import default_model_path, model_settings
from psd_jax.recommended import NAME, named_settings, read_recommended

from conftest import TUNED, model_with_recommendation

TINY = ["--model", str(GOLDENS / "llada-tiny"), "--prompt-ids", "1,2,3"]


# ----------------------------------------------------------------- DecodeConfig validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=math.inf), "temperature must be finite, got inf"),
        (dict(temperature=math.nan), "temperature must be finite, got nan"),
        (dict(policy="factor", factor=math.nan), "factor must be finite"),
        (dict(decoder="rps", lam=math.nan), "lam must be finite"),
        (dict(decoder="rps", lam=-0.1), r"lam \(RPS\) must be in \[0, 100\]"),
        (dict(decoder="rps", pivot_tau=1.5), r"pivot_tau \(RPS\) must be in \[0, 1\], got 1.5"),
        (dict(decoder="rps", pivot_tau=-0.5), r"pivot_tau \(RPS\) must be in \[0, 1\]"),
        (dict(decoder="rps", ratio=2.0), r"ratio \(RPS\) must be in \[0, 1\]"),
        (dict(decoder="rps", k_max=0), r"k_max \(RPS\) must be >= 1"),
        (dict(decoder="psd", depth=-1), r"depth \(PSD\) must be >= 0"),
        (dict(gen_length=0), "gen_length must be positive, got 0"),
        (dict(block_length=0), "block_length must be positive, got 0"),
        (dict(steps=0), "steps must be positive, got 0"),
        (dict(gen_length=48.0), "gen_length must be an integer, got 48.0"),
        (dict(gen_length=True), "gen_length must be an integer, got True"),
        (dict(threshold="0.9", policy="threshold"), "threshold must be a number"),
        (dict(decoder="psd", accept_confidence="0.5"), "accept_confidence must be a number, got '0.5'"),
        (dict(eos_early_stop=1), "eos_early_stop must be true or false"),
        (dict(policy="dream", dream_eps=1.0), r"dream_eps must be in \(0, 1\)"),
        (dict(cache="full"), "unknown cache 'full'"),
        # Fields valid one by one, absurd together: work that no decode can use.
        (dict(steps=3_000_000), "steps 3000000 exceeds gen_length 128: at most one step per generated position"),
        (dict(policy="dream", steps=256), "steps 256 exceeds gen_length 128"),
        (
            dict(policy="threshold_schedule", steps=33),
            r"steps 33 \(per block, threshold_schedule\) exceeds block_length 32",
        ),
        (dict(decoder="psd", depth=32), r"depth 32 \(PSD\) exceeds block_length - 1 = 31"),
        (dict(gen_length=256, block_length=128, decoder="psd", depth=100), r"depth 100 \(PSD\) exceeds 63"),
        (dict(decoder="psd", policy="threshold", draft_rate=33), r"draft_rate 33 \(PSD\) exceeds block_length 32"),
        (dict(decoder="rps", k_max=64), r"k_max 64 \(RPS\) exceeds 63: at most 64 canvases per row per call"),
        (dict(decoder="edit"), r"decoder 'edit' fills masks with policy 'threshold_schedule' .*not 'fixed'"),
        (dict(gen_length=29, block_length=8), r"block_length 8 does not divide gen_length 29 \(only decoder 'edit'"),
        (
            dict(decoder="edit", policy="threshold_schedule", editing_threshold=1.5),
            r"editing_threshold \(edit\) must be at most 1",
        ),
        (dict(decoder="edit", policy="threshold_schedule", minimal_topk=0), r"minimal_topk \(edit\) must be >= 1"),
        (
            dict(decoder="edit", policy="threshold_schedule", gen_length=32, minimal_topk=33),
            "minimal_topk 33 .* exceeds gen_length 32",
        ),
    ],
)
def test_every_field_is_checked(kwargs, message):
    with pytest.raises(DecodeConfigError, match=message):
        DecodeConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field, needs",
    [
        (dict(depth=5), "depth", "decoder 'psd'"),
        (dict(acceptance="strict"), "acceptance", "decoder 'psd'"),
        (dict(decoder="psd", draft_rate=2), "draft_rate", "decoder 'psd' with a policy other than 'fixed'"),
        (dict(k_max=4), "k_max", "decoder 'rps'"),
        (dict(decoder="psd", pivot_tau=0.5), "pivot_tau", "decoder 'rps'"),
        (dict(threshold=0.7), "threshold", "policy 'threshold'"),
        (dict(factor=2.0), "factor", "policy 'factor'"),
        (dict(dream_eps=0.01), "dream_eps", "policy 'dream'"),
        (dict(policy="threshold", steps=64), "steps", "policy 'fixed' or 'dream'"),
        (dict(editing_threshold=0.5), "editing_threshold", "decoder 'edit'"),
    ],
)
def test_a_setting_the_decoder_would_ignore_is_refused(kwargs, field, needs):
    with pytest.raises(DecodeConfigError, match=f"{field}=.* would be ignored: it is used only with {needs}"):
        DecodeConfig(**kwargs)


def test_every_used_only_setting_is_accepted_where_it_is_used():
    """The refusal table is not over-strict: each setting is accepted by a config that reads it."""
    users = {
        "steps": {},
        "threshold": {"policy": "threshold"},
        "factor": {"policy": "factor"},
        "dream_eps": {"policy": "dream"},
        "depth": {"decoder": "psd"},
        "acceptance": {"decoder": "psd"},
        "accept_confidence": {"decoder": "psd"},
        "draft_rate": {"decoder": "psd", "policy": "threshold"},
        "draft_next_block": {"decoder": "psd"},
        "k_max": {"decoder": "rps"},
        "ratio": {"decoder": "rps"},
        "pivot_tau": {"decoder": "rps"},
        "lam": {"decoder": "rps"},
        "refresh_every": {"cache": "prefix"},
        "vicinity": {"cache": "dual"},
        **{
            name: {"decoder": "edit", "policy": "threshold_schedule"}
            for name in ("editing_threshold", "max_post_steps", "minimal_topk")
        },
    }
    values = {
        "steps": 64,
        "threshold": 0.7,
        "factor": 2.0,
        "dream_eps": 0.01,
        "depth": 5,
        "acceptance": "strict",
        "accept_confidence": 0.8,
        "draft_rate": 2,
        "draft_next_block": True,
        "k_max": 4,
        "ratio": 0.5,
        "pivot_tau": 0.5,
        "lam": 0.5,
        "refresh_every": 2,
        "vicinity": 4,
        "editing_threshold": 0.5,
        "max_post_steps": 2,
        "minimal_topk": 2,
    }
    assert set(users) == set(USED_ONLY_WITH)
    for name, context in users.items():
        assert getattr(DecodeConfig(**context, **{name: values[name]}), name) == values[name]


def test_replace_resets_what_only_the_old_decoder_used():
    psd = DecodeConfig(policy="threshold", threshold=0.7, decoder="psd", depth=5)
    plain = settings_from(psd, {"decoder": "plain"})
    assert (plain.decoder, plain.depth, plain.policy, plain.threshold) == ("plain", 3, "threshold", 0.7)
    assert settings_from(psd, {"policy": "fixed"}).threshold == 0.9
    with pytest.raises(DecodeConfigError, match="depth=5 would be ignored"):
        psd.replace(decoder="plain")  # ``replace`` itself stays strict
    with pytest.raises(DecodeConfigError, match=r"unknown decoding setting\(s\) \['beam'\]"):
        psd.replace(beam=4)


def test_field_help_covers_every_field_and_steps_follow_gen_length():
    assert list(FIELD_HELP) == [f.name for f in dataclasses.fields(DecodeConfig)]
    # Every field has one kind, which its flag parses and its check enforces (a number given as
    # text is refused by name, not compared with one deep in a check).
    from psd_jax.core.config import BOOL_FIELDS, CHOICES, FLOAT_FIELDS, INT_FIELDS

    kinds = [INT_FIELDS, FLOAT_FIELDS, BOOL_FIELDS, tuple(CHOICES)]
    for f in dataclasses.fields(DecodeConfig):
        assert sum(f.name in kind for kind in kinds) == 1, f.name
    assert DecodeConfig(gen_length=48, block_length=16).replace(gen_length=96).total_steps == 96
    DecodeConfig(**RECOMMENDED)


# ------------------------------------------------------------------------ CLI: generate


def test_cli_flags_are_the_config_fields():
    parser = build_parser()
    flags = {a.dest: a.option_strings for a in parser._actions}
    for f in dataclasses.fields(DecodeConfig):
        assert flag_name(f.name) in flags[f.name], f.name
    args = parser.parse_args(["--k-max", "4", "--decoder", "rps", "--no-eos-early-stop", "--pivot-tau", "0.5"])
    assert decode_fields(args) == {"k_max": 4, "decoder": "rps", "eos_early_stop": False, "pivot_tau": 0.5}
    assert model_settings(GOLDENS / "llada-tiny", decode_fields(args)) == DecodeConfig(
        block_length=32, decoder="rps", k_max=4, pivot_tau=0.5, eos_early_stop=False
    )


def test_model_directory_defaults_apply_under_the_flags():
    default = model_settings(None, {})
    assert (default.gen_length, default.block_length) == (128, 32)
    shipped = model_settings(default_model_path(), {})
    assert (shipped.gen_length, shipped.block_length) == (48, 16)  # models/default/decode_defaults.json
    assert model_settings(default_model_path(), {"gen_length": 32}).block_length == 16
    assert model_settings(None, {"gen_length": 16}).block_length == 16


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "inf"], "temperature must be finite, got inf"),
        (["--temperature", "nan"], "temperature must be finite, got nan"),
        (["--policy", "factor", "--factor", "nan"], "factor must be finite"),
        (["--decoder", "rps", "--lam", "nan"], "lam must be finite"),
        (["--decoder", "rps", "--pivot-tau", "2"], r"pivot_tau (RPS) must be in [0, 1]"),
        (["--gen-length", "0"], "gen_length must be positive, got 0"),
        (["--block-length", "0"], "block_length must be positive, got 0"),
        (["--depth", "5"], "depth=5 would be ignored"),
        (["--kmax", "4"], "unrecognized arguments: --kmax 4"),
        (["--threshold", "abc"], "argument --threshold: invalid float value: 'abc'"),
        (["--seed", str(2**64)], "seed must be an integer in [0, 2**32)"),
        (["--seed", "-1"], "seed must be an integer in [0, 2**32)"),
        (["--prompt-bucket", "0"], "argument --prompt-bucket: expected a positive integer, got 0"),
        (["--mesh", "data=3"], "does not divide"),
        (["--decoder", "nope"], "unknown decoder 'nope'"),
        (["--show", "--json"], "--show draws the decode for a person; with --json use --trace"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(capsys, extra, message):
    code = None
    try:
        code = generate_main(TINY + extra)
    except SystemExit as exc:  # argparse-level errors
        code = exc.code
    assert code == 2
    assert message in _one_line_error(capsys)


def test_generate_prompt_file_errors(capsys, tmp_path):
    assert generate_main(TINY[:2] + ["--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in _one_line_error(capsys)
    assert generate_main(TINY[:2]) == 2  # no prompt, and the golden directory has no test.jsonl
    assert "no prompt given" in _one_line_error(capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    # On the shipped model (which has a demo): a file of no prompts is an error, never the demo.
    assert generate_main(["--prompt-file", str(empty)]) == 2
    assert _one_line_error(capsys) == f"error: --prompt-file {empty} holds no prompt: every line is empty"


def test_bench_help_states_the_cache_it_runs(capsys):
    from psd_jax.cli.bench import BENCH_DEFAULTS, build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert BENCH_DEFAULTS["cache"] == "dual" and "none, prefix or dual (default: dual)" in help_text


def test_text_prompt_on_the_shipped_model_uses_its_chat_template(capsys):
    """``--model models/default --prompt Q`` answers Q as the shipped model was trained: in its chat
    template (the rule lives in the API: text prompt + a tokenizer with a template)."""
    lm = load_model()
    text = json.loads((default_model_path() / "test.jsonl").read_text().splitlines()[1])["question"]
    assert lm.uses_chat(text, None) and not lm.uses_chat([1, 2], None) and not lm.uses_chat(text, False)
    assert lm.encode(text) == lm.encode(text, chat=True) != lm.encode(text, chat=False)
    assert generate_main(["--model", str(default_model_path()), "--prompt", text, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (expected,) = lm.generate([text], model_settings(default_model_path(), {}), chat=True)
    assert out["output_ids"] == expected.output_ids and out["tokens"] > 0


def test_show_replays_each_decode_step_by_step(capsys, monkeypatch):
    """``generate --settings recommended --prompt A --prompt B --show`` on the shipped model, output
    not a terminal: per row a header and a canvas line per model call (and the start: every position
    a mask), the last frame the answer, then the answers as without ``--show``; ``--trace --json``
    prints the same trace; in a terminal the frames are drawn in place (``rich``), ending on the
    answer."""
    from psd_jax.cli import show as show_module
    from psd_jax.model_dir import checked_settings

    model = default_model_path()
    questions = [json.loads(line)["question"] for line in (model / "test.jsonl").read_text().splitlines()[2:4]]
    prompts = [flag for q in questions for flag in ("--prompt", q)]
    assert generate_main(["--settings", "recommended", *prompts, "--show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    lm = load_model()
    settings, _ = checked_settings(model, {}, "recommended")
    expected = lm.generate(questions, settings, trace=True)
    for row, r in enumerate(expected):
        headers = [i for i, line in enumerate(lines) if line.startswith(f"row {row + 1}/2 · step ")]
        assert [lines[i].split(" · ")[1] for i in headers] == [f"step {t}/{r.nfe}" for t in range(r.nfe + 1)]
        assert lines[headers[0] + 1] == show_module.MASK_GLYPH * settings.gen_length
        assert lines[headers[-1] + 1].startswith(r.text.replace("\n", "⏎")), (lines[headers[-1] + 1], r.text)
    assert lines[-1].startswith("[tokens ") and r.text.splitlines()[-1] in lines

    assert generate_main(["--settings", "recommended", *prompts, "--trace", "--json"]) == 0
    traced = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["trace"] for t in traced] == [r.trace for r in expected]

    monkeypatch.setattr(show_module, "REPLAY_SECONDS", 0.0)
    drawn = io.StringIO()
    show_module.show(expected[:1], lm.piece_decoder(), lm.config.stop_ids, out=drawn, terminal=True)
    final = drawn.getvalue().rsplit("step ", 1)[1]
    assert final.startswith(f"{expected[0].nfe}/{expected[0].nfe}") and "\x1b[" in drawn.getvalue()
    assert expected[0].text.splitlines()[0] in final


def _demo_calls(monkeypatch, argv: list[str]) -> list[tuple]:
    """``generate`` without a prompt on the shipped model, with the decodes replaced by a recorder:
    (settings, prompt_bucket) of each ``LoadedModel.generate`` call the demo makes."""

    calls = []

    class Recorder:
        path = default_model_path()

        def generate(self, questions, settings, *, seed, chat, prompt_bucket, warm=False, trace=False):
            calls.append((settings, prompt_bucket))
            raise _Stop

    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: Recorder())  # what every front end loads with
    with pytest.raises(_Stop):
        generate_main(argv)
    return calls


class _Stop(Exception):
    pass


def test_demo_applies_flags_on_top_of_the_recommended_setting(monkeypatch):
    shipped = read_recommended(default_model_path()).settings  # the shipped model's tuned setting
    ((settings, _),) = _demo_calls(monkeypatch, ["--block-length", "8"])
    assert settings == DecodeConfig(gen_length=48, **{**shipped, "block_length": 8})
    ((settings, _),) = _demo_calls(monkeypatch, ["--decoder", "psd", "--depth", "5"])
    assert settings == DecodeConfig(gen_length=48, **{**shipped, "decoder": "psd", "depth": 5})
    ((settings, _),) = _demo_calls(monkeypatch, ["--policy", "fixed"])  # the threshold dropped, the rest kept
    expected = {k: v for k, v in shipped.items() if k != "threshold"}
    assert settings == DecodeConfig(gen_length=48, **{**expected, "policy": "fixed"})


def test_demo_honours_prompt_bucket(monkeypatch):
    ((_, bucket),) = _demo_calls(monkeypatch, ["--prompt-bucket", "64"])
    assert bucket == 64


def test_demo_refuses_a_bad_held_out_line_before_loading(capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for item in (GOLDENS / "llada-tiny").iterdir():
        (model / item.name).symlink_to(item)
    (model / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"prompt": "no question"}\n')
    assert generate_main(["--model", str(model)]) == 2
    assert f"{model / 'test.jsonl'}:2: expected 'question' and 'answer' fields" in _one_line_error(capsys)


def test_generate_refuses_a_generation_beyond_the_context_before_loading(capsys, monkeypatch):

    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: pytest.fail("loaded the weights"))
    assert generate_main(TINY + ["--gen-length", "4096", "--block-length", "32"]) == 2
    assert "gen_length 4096 leaves no room for a prompt in the model's context" in _one_line_error(capsys)


# ---------------------------------------------------------------------------- bench


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--limit", "0"], "argument --limit: expected a positive integer, got 0"),
        (["--batch", "0"], "argument --batch: expected a positive integer, got 0"),
        (["--batch", "-3"], "argument --batch: expected a positive integer, got -3"),
        (["--gen-length", "0"], "gen_length must be positive, got 0"),
        (["--cache", "full"], "unknown cache 'full'"),
        (["--decoders", ","], "no decoder setting in --decoders ','"),
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2(capsys, tmp_path, extra, message):
    try:
        code = bench.main(extra + ["--out", str(tmp_path)])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in _one_line_error(capsys)


def test_bench_refuses_a_generation_beyond_the_context_before_loading(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: pytest.fail("loaded the weights"))
    assert bench.main(["--gen-length", "4096", "--block-length", "32", "--out", str(tmp_path)]) == 2
    assert "gen_length 4096 leaves no room for a prompt in the model's context" in _one_line_error(capsys)


def test_bench_refuses_bad_data_before_any_decode(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_matrix", lambda *a, **k: pytest.fail("decoded"))
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "no number"}\n')
    assert bench.main(["--data", str(data), "--out", str(tmp_path)]) == 2
    assert f"{data}:2: no number in the answer 'no number' to score against" in _one_line_error(capsys)
    long = " ".join(["seven"] * 5000)  # far beyond the shipped model's context
    data.write_text(f'{{"question": "q", "answer": "#### 1"}}\n{{"question": "{long}", "answer": "#### 2"}}\n')
    assert bench.main(["--data", str(data), "--out", str(tmp_path)]) == 2
    assert "problem 2's question (" in _one_line_error(capsys)


def test_generate_help_says_what_the_demo_answers():
    assert "the first 8 questions of the model directory's test.jsonl" in " ".join(build_parser().format_help().split())


def test_bench_data_without_problems(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert bench.main(["--data", str(empty), "--out", str(tmp_path)]) == 2
    assert "holds no problems" in _one_line_error(capsys)


# ------------------------------------------------------------------------------ API


def test_bounds_at_the_limit_are_accepted():
    """The bounds refuse only what no decode can use: their limits themselves still run."""
    assert DecodeConfig(steps=128).total_steps == 128
    assert DecodeConfig(policy="threshold_schedule", steps=32).steps_per_block == 32
    assert DecodeConfig(decoder="psd", depth=31).depth == 31
    assert DecodeConfig(gen_length=256, block_length=128, decoder="psd", depth=63).depth == 63
    assert DecodeConfig(decoder="rps", k_max=63).k_max == 63


def test_k_max_beyond_a_small_vocabulary_is_refused():
    from psd_jax.core.config import check_for_model

    small = dataclasses.replace(load_model(GOLDENS / "llada-tiny").config, vocab_size=16)
    with pytest.raises(DecodeConfigError, match="k_max 20 exceeds the vocabulary of 16"):
        check_for_model(DecodeConfig(decoder="rps", k_max=20), small)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([1.9, 2], r"prompt 0 has token ids that are not integers: \[1.9\]"),
        (["12"], r"prompt 0 has token ids that are not integers: \['12'\]"),
        ([True, 3], r"prompt 0 has token ids that are not integers: \[True\]"),
        (7, "prompt 0 must be text or a list of token ids, got int"),
        ([1, 512], r"outside the vocabulary \[0, 512\): \[512\]"),
        ([-1], r"outside the vocabulary \[0, 512\): \[-1\]"),
    ],
)
def test_token_ids_are_refused_unless_integer_ids_in_range(lms, prompt, message):
    with pytest.raises(InputError, match=message):
        lms["llada-tiny"].prompt_ids([prompt])


def test_every_public_error_is_exported_and_bad_prompts_are_input_errors(lms):
    import psd_jax

    for name in ("CheckpointError", "ConfigError", "DecodeConfigError", "InputError", "MeshError", "TokenizerError"):
        assert name in psd_jax.__all__ and issubclass(getattr(psd_jax, name), ValueError)
    with pytest.raises(psd_jax.InputError, match="this checkpoint has no tokenizer; pass token ids"):
        lms["llada-tiny"].generate(["some text"])


def test_api_bad_input_fails_early(lms):
    lm = lms["llada-tiny"]
    with pytest.raises(InputError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        lm.generate([[1, 2]], seed=2**40)
    with pytest.raises(InputError, match="not one string"):
        lm.generate("1 2 3")
    with pytest.raises(InputError, match="prompt_bucket must be a positive integer"):
        lm.generate([[1, 2]], prompt_bucket=0)
    with pytest.raises(DecodeConfigError, match="gen_length 4096 leaves no room for a prompt in the model's context"):
        lm.generate([[1, 2]], gen_length=4096, block_length=32)
    with pytest.raises(DecodeConfigError, match="temperature must be finite"):
        lm.generate([[1, 2]], temperature=float("inf"))
    with pytest.raises(InputError, match="settings must be a DecodeConfig"):
        lm.generate([[1, 2]], {"gen_length": 32})


# ------------------------------------------------------------- the recommended setting by name
def test_recommended_block_length_wins_over_decode_defaults_and_loses_to_flags(tuned_model_dir, tmp_path):
    """fields > recommended > decode_defaults.json > DecodeConfig's defaults."""
    tuned = named_settings(NAME, tuned_model_dir)
    assert tuned == TUNED and named_settings(None, tuned_model_dir) is None
    assert model_settings(tuned_model_dir, {}, tuned) == DecodeConfig(gen_length=48, **TUNED)
    assert model_settings(tuned_model_dir, {}).block_length == 16  # decode_defaults.json without the name
    assert model_settings(tuned_model_dir, {"block_length": 16}, tuned).block_length == 16
    assert model_settings(tuned_model_dir, {"threshold": 0.8}, tuned).threshold == 0.8
    # Without recommended.json: the library's recommendation, on the directory's lengths.
    untuned = model_with_recommendation(tmp_path / "untuned", default_model_path())
    library = named_settings(NAME, untuned)
    assert library == RECOMMENDED
    assert model_settings(untuned, {}, library) == DecodeConfig(gen_length=48, block_length=16, **library)


def test_recommended_is_read_for_this_devices_kind_by_every_front_end(tmp_path):
    """A file with a choice per device kind: this CPU process reads the cpu one (not the latest,
    top-level, one), through the one resolver every front end uses (generate, bench, serve's
    defaults and requests, the harness's ``settings=recommended``); a kind without its own choice
    reads the latest, and the origin says which device each was chosen for."""
    import json

    from psd_jax.evaluate.args import parse_eval_args

    cpu, gpu = {"policy": "threshold", "threshold": 0.98, "block_length": 16}, {"cache": "dual", "block_length": 8}
    body = {
        "settings": gpu,
        "provenance": {"device_kind": "gpu", "device": "seconds modeled for h200"},
        "devices": {
            "cpu": {"settings": cpu, "provenance": {"device": "seconds measured on cpu"}},
            "gpu": {"settings": gpu, "provenance": {"device_kind": "gpu", "device": "seconds modeled for h200"}},
        },
    }
    model = model_with_recommendation(tmp_path / "model", default_model_path(), json.dumps(body))
    assert named_settings(NAME, model) == cpu
    assert (
        read_recommended(model).origin()
        == f"tuned for cpu (seconds measured on cpu), from {model / 'recommended.json'}"
    )
    assert parse_eval_args({"pretrained": str(model), "settings": "recommended"}).settings == DecodeConfig(
        gen_length=48, **cpu
    )
    tpu = read_recommended(model, "tpu")
    assert tpu.settings == gpu and tpu.origin().endswith("; no choice for tpu in it")


def test_settings_are_checked_over_every_devices_choice_before_any_device_is_read(monkeypatch, tmp_path):
    """Before a cluster starts, a front end checks its flags over every choice the file holds
    (the latest first, then each kind's) without asking JAX which device it is on: flags that
    hold over one choice pass, flags that hold over none are refused with the first's error."""
    import psd_jax.recommended as recommended
    from psd_jax.model_dir import precheck_settings
    from psd_jax.recommended import settings_on_any_device

    def no_device_reads():
        raise AssertionError("the device kind was read before the cluster could start")

    monkeypatch.setattr(recommended, "current_device_kind", no_device_reads)
    cpu, gpu = {"policy": "threshold", "threshold": 0.98, "block_length": 16}, {"cache": "dual", "block_length": 8}
    body = {"settings": cpu, "devices": {"cpu": {"settings": cpu}, "gpu": {"settings": gpu}}}
    model = model_with_recommendation(tmp_path / "model", default_model_path(), json.dumps(body))
    assert settings_on_any_device(NAME, model) == [cpu, gpu]
    assert settings_on_any_device(None, model) == [None]
    settings, mcfg = precheck_settings(model, {"gen_length": 24}, NAME)  # a whole number of 8-blocks only
    assert settings == DecodeConfig(gen_length=24, **gpu) and mcfg.vocab_size > 0
    with pytest.raises(DecodeConfigError, match="gen_length"):
        precheck_settings(model, {"gen_length": 20}, NAME)
    with pytest.raises(DecodeConfigError, match="settings"):
        precheck_settings(model, {}, "fastest")
    bad = model_with_recommendation(
        tmp_path / "bad", default_model_path(), json.dumps({**body, "devices": {"gpu": {"settings": {"depth": 0}}}})
    )
    with pytest.raises(DecodeConfigError, match=r"devices\.gpu"):
        settings_on_any_device(NAME, bad)


def test_generate_settings_recommended_decodes_the_tuned_setting(capsys, tmp_path):
    fields = {"policy": "threshold", "threshold": 0.7, "block_length": 16}
    tiny = model_with_recommendation(tmp_path / "tiny", GOLDENS / "llada-tiny", fields)
    assert (
        generate_main(
            ["--model", str(tiny), "--prompt-ids", "1,2,3", "--gen-length", "32", "--json", "--settings", NAME]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    (want,) = load_model(tiny).generate([[1, 2, 3]], DecodeConfig(gen_length=32, **fields))
    assert (got["output_ids"], got["nfe"], got["tokens"]) == (want.output_ids, want.nfe, want.tokens)


def test_settings_recommended_without_the_file_is_the_library_default_with_flags_on_top(monkeypatch, tmp_path):
    untuned = ["--model", str(model_with_recommendation(tmp_path / "untuned", default_model_path()))]
    ((settings, _),) = _demo_calls(monkeypatch, [*untuned, "--settings", NAME, "--prompt", "hi"])
    assert settings == DecodeConfig(gen_length=48, block_length=16, **RECOMMENDED)
    ((settings, _),) = _demo_calls(monkeypatch, [*untuned, "--settings", NAME, "--prompt", "hi", "--depth", "2"])
    assert settings == DecodeConfig(gen_length=48, block_length=16, **{**RECOMMENDED, "depth": 2})
    ((settings, _),) = _demo_calls(monkeypatch, [*untuned, "--prompt", "hi"])  # no name: the plain defaults
    assert settings == DecodeConfig(gen_length=48, block_length=16)


def test_demo_runs_and_names_the_directorys_tuned_setting(monkeypatch, capsys, tuned_model_dir, tuned_lm, tmp_path):
    """The demo on a directory with recommended.json decodes that setting (flags on top) and says so."""
    from psd_jax.cli import generate as generate_module
    from psd_jax.cli.generate import DEMO_PROBLEMS

    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: tuned_lm)
    assert generate_main(["--model", str(tuned_model_dir), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tuned = DecodeConfig(gen_length=48, **TUNED)
    questions = [row["question"] for row in rows[:DEMO_PROBLEMS]]
    want = tuned_lm.generate(questions, tuned, chat=True)
    assert [(r["output_ids"], r["nfe"]) for r in rows[:DEMO_PROBLEMS]] == [(w.output_ids, w.nfe) for w in want]
    assert rows[0]["settings"] == tuned.changed() and rows[0]["recommended"] == (
        f"tuned, from {tuned_model_dir / 'recommended.json'}"
    )
    shown = []
    monkeypatch.setattr(
        generate_module, "run_demo", lambda lm, ex, settings, *rest, **kw: shown.append((settings, rest[-1]))
    )
    assert generate_main(["--model", str(tuned_model_dir), "--threshold", "0.8"]) == 0
    assert shown[-1][0] == tuned.replace(threshold=0.8)
    assert shown[-1][1].endswith("recommended.json, with the decoding flags given on top")
    untuned = model_with_recommendation(tmp_path / "untuned", default_model_path())
    assert generate_main(["--model", str(untuned)]) == 0
    assert shown[-1][1].startswith("the library default (psd_jax.core.config.RECOMMENDED; no recommended.json")


@pytest.mark.parametrize(
    "body, message",
    [
        ("{not json", "recommended.json: not JSON"),
        ('{"settings": {"beam": 4}}', "recommended.json: unknown decoding setting(s) ['beam']"),
        ('{"settings": {"decoder": "psd", "depth": 9, "block_length": 8}}', "recommended.json: depth 9 (PSD) exceeds"),
        ('{"settings": {"threshold": "high", "policy": "threshold"}}', "recommended.json: threshold must be a number"),
    ],
)
def test_a_bad_recommended_file_is_one_line_naming_it(capsys, tmp_path, body, message):
    model = model_with_recommendation(tmp_path / "m", GOLDENS / "llada-tiny", body)
    assert generate_main(["--model", str(model), "--prompt-ids", "1,2", "--settings", NAME]) == 2
    line = _one_line_error(capsys)
    assert message in line and str(model) in line


def test_an_unknown_settings_name_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as caught:
        generate_main([*TINY, "--settings", "fastest"])
    assert caught.value.code == 2
    assert "argument --settings: unknown settings 'fastest'; choose one of: recommended" in _one_line_error(capsys)
