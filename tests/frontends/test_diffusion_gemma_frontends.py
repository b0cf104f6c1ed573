"""DiffusionGemma through the front ends: its settings as ``DecodeConfig`` fields (the release's
``generation_config.json`` as defaults, lengths in whole canvases, every other family's fields
refused by name and its fields refused on them), ``python -m psd_jax.generate --replay-draws``
reproducing upstream's decodes as a command and in-process, the Python API's replay, and what the
family does not do (a likelihood, a served trace, a modeled device's prices) refused in one line.
On a mesh and on several processes: tests/parallel/."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from cli_errors import one_line_error as _one_line_error
from diffusion_gemma_goldens import TINY, golden_case, tiny_with_tokenizer
from paths import GOLDENS
from served import client, running

from psd_jax import DecodeConfig, DecodeConfigError, InputError, load_model
from psd_jax.cli.bench import main as bench_main
from psd_jax.cli.generate import main as generate_main
from psd_jax.core.entropy_bound import EntropyBoundSettings
from psd_jax.diffusion_gemma_api import read_draws
from psd_jax.model_dir import checked_settings, model_settings, release_settings
from psd_jax.serve import build_app
from psd_jax.tuning.cli import main as tune_main

CASES_FILE = GOLDENS / "diffusion_gemma_cases.safetensors"
LLADA = GOLDENS / "llada-tiny"


def case_argv(name: str) -> list[str]:
    """``python -m psd_jax.generate``'s arguments for golden case ``name``: its prompts (unpadded),
    its settings as flags and its recorded draws."""
    c = golden_case(f"generate_{name}")
    argv = ["--model", str(TINY), "--json"]
    for ids, mask in zip(c["prompt"], c["attention_mask"]):
        argv += ["--prompt-ids", ",".join(map(str, ids[mask.astype(bool)]))]
    confidence = float(c["confidence_threshold"])
    argv += [
        "--gen-length", str(int(c["max_new_tokens"])),
        "--max-denoising-steps", str(int(c["max_denoising_steps"])),
        "--entropy-bound", repr(float(c["entropy_bound"])),
        "--t-min", repr(float(c["t_min"])),
        "--t-max", repr(float(c["t_max"])),
        "--stability-threshold", str(max(int(c["stability_threshold"]), 0)),
        "--confidence-threshold", repr(max(confidence, 0.0)),  # -1 (upstream's None): 0, no adaptive stopping
        "--replay-draws", f"{CASES_FILE}:diffusion-gemma-tiny.generate_{name}",
    ]  # fmt: skip
    return argv


def check_rows(rows: list[dict], name: str) -> None:
    """Each JSON row against the golden: its canvases' ids, upstream's ``decoder_passes``, and
    ``nfe`` = the batch's denoiser calls until the row ended (upstream's ``nfe`` at batch 1)."""
    c = golden_case(f"generate_{name}")
    want = c["output"][:, c["prompt"].shape[1] :]
    assert len(rows) == want.shape[0]
    canvas = int(c["canvas_length"])
    for row, got in enumerate(rows):
        # upstream returns the canvases it ran; a row here holds gen_length ids, pad after its end
        assert got["output_ids"][: want.shape[1]] == want[row].tolist()
        assert len(got["output_ids"]) == int(c["max_new_tokens"]) and not any(got["output_ids"][want.shape[1] :])
        assert got["decoder_passes"] == int(c["decoder_passes"][row])
        eos = np.flatnonzero(np.isin(want[row], c["eos_token_ids"]))
        last_canvas = eos[0] // canvas if eos.size else want.shape[1] // canvas - 1
        assert got["nfe"] == int((c["trace_canvas_index"] <= last_canvas).sum())
    if want.shape[0] == 1:
        assert rows[0]["nfe"] == int(c["nfe"])


def test_generate_replays_an_upstream_batch_as_a_command():
    """As a user runs it: rows stopping adaptively at different steps of a batch of 2."""
    name = "eb1_s32_stop_batch_p0p2"
    done = subprocess.run(
        [sys.executable, "-m", "psd_jax.generate", *case_argv(name)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    check_rows([json.loads(line) for line in done.stdout.splitlines()], name)


@pytest.mark.parametrize("name", ["default_p0"])
def test_generate_replays_upstream_in_process(name, capsys):
    """The released defaults with an end in the first canvas (a batch whose rows end in different
    canvases: the command above; three canvases without adaptive stopping: the Python API below)."""
    assert generate_main(case_argv(name)) == 0
    check_rows([json.loads(line) for line in capsys.readouterr().out.splitlines()], name)


def test_the_python_api_replays_with_draws_read_from_a_file():
    c = golden_case("generate_eb2_s8_nostop_batch_p0p2")
    lm = load_model(TINY)
    prompts = [ids[mask.astype(bool)].tolist() for ids, mask in zip(c["prompt"], c["attention_mask"])]
    draws = read_draws(f"{CASES_FILE}:diffusion-gemma-tiny.generate_eb2_s8_nostop_batch_p0p2")
    out = lm.generate(
        prompts, gen_length=96, max_denoising_steps=8, entropy_bound=2.0, t_min=0.2, t_max=1.0,
        stability_threshold=0, confidence_threshold=0.0, draws=draws, prompt_bucket=None, trace=True,
    )  # fmt: skip
    want = c["output"][:, c["prompt"].shape[1] :]  # every canvas ran: gen_length ids
    assert [g.output_ids for g in out] == want.tolist()
    for g in out:  # the trace (same tokens and calls): each token's step from which it stayed, within its canvas's
        steps = g.trace["step"]
        ends = [i for i, t in enumerate(g.output_ids) if t in lm.config.eos_ids] + [len(steps)]
        assert all((s == 0) == (i > ends[0]) for i, s in enumerate(steps))  # 0: the padding after the end
        for k in range(3):  # 3 canvases of 32 ids, 8 steps each
            assert all(8 * k < s <= 8 * (k + 1) for s in steps[32 * k : min(32 * (k + 1), ends[0] + 1)])
        assert set(g.trace["kind"]) <= {"settled", "none"} and g.trace["first"] == g.output_ids
    assert [g.stats["decoder_passes"] for g in out] == c["decoder_passes"].tolist()
    np.testing.assert_allclose([g.stats["tokens_per_forward"] for g in out], c["tokens_per_forward"], rtol=1e-6)
    # The engine's own draws: a row decodes the same alone as in a batch (keyed by its seed and place),
    # again the same, and another seed another way.
    own = lm.generate(prompts, seed=5, gen_length=40, max_denoising_steps=6)
    alone = lm.generate(prompts[:1], seed=5, gen_length=40, max_denoising_steps=6)
    assert own[0].output_ids == alone[0].output_ids and len(own[0].output_ids) == 64  # whole canvases
    again, other = (lm.generate(prompts[:1], seed=s, gen_length=40, max_denoising_steps=6)[0] for s in (5, 6))
    assert again.output_ids == alone[0].output_ids and other.output_ids != alone[0].output_ids


def test_settings_default_to_the_release_and_round_up_to_whole_canvases():
    release = release_settings(TINY)
    assert release == {
        "gen_length": 256, "max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8,
        "stability_threshold": 1, "confidence_threshold": 0.005, "entropy_bound": 0.1,
    }  # fmt: skip
    settings = model_settings(TINY)
    assert (settings.gen_length, settings.block_length) == (256, 32)
    assert model_settings(TINY, {"gen_length": 33}).gen_length == 64
    assert checked_settings(TINY, {}, "recommended")[0] == settings  # without a tuned file: the release's
    off = EntropyBoundSettings.of(model_settings(TINY, {"confidence_threshold": 0}))
    assert (off.stability_threshold, off.confidence_threshold, off.adaptive) == (None, None, False)
    on = EntropyBoundSettings.of(settings)
    assert (on.stability_threshold, on.confidence_threshold, on.gen_length) == (1, 0.005, 256)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"policy": "threshold"}, r"policy='threshold': not used by DiffusionGemma's entropy-bound sampler"),
        ({"decoder": "psd", "depth": 2}, r"decoder='psd', depth=2: not used by DiffusionGemma"),
        ({"temperature": 0.5}, r"temperature=0.5: not used by DiffusionGemma"),
        ({"block_length": 16}, r"block_length 16: DiffusionGemma decodes in canvases of 32"),
        ({"t_min": 0.9}, r"t_min 0.9 exceeds t_max 0.8"),
        ({"t_min": 0.0}, r"t_min must be in \[0.0001, 100\], got 0.0"),
        ({"entropy_bound": -1.0}, r"entropy_bound must be in \[0, 1e\+06\], got -1.0"),
        ({"max_denoising_steps": 0}, r"max_denoising_steps must be in \[1, 4096\], got 0"),
        ({"stability_threshold": 49}, r"stability_threshold 49 exceeds max_denoising_steps 48"),
        ({"confidence_threshold": float("nan")}, r"confidence_threshold must be finite"),
        ({"gen_length": 131072}, r"gen_length 131072 leaves no room for a prompt"),
    ],
)
def test_settings_the_sampler_cannot_use_are_refused_by_name(fields, message):
    with pytest.raises(DecodeConfigError, match=message):
        checked_settings(TINY, fields)


def test_fields_given_at_their_defaults_are_refused_too(capsys):
    """A field the family does not read is refused even at its default value, where the settings
    alone cannot tell it was given: on the command line and through the Python API."""
    assert generate_main(["--model", str(TINY), "--prompt-ids", "2,5", "--threshold", "0.9"]) == 2
    assert "threshold=0.9: not used by DiffusionGemma's entropy-bound sampler" in _one_line_error(capsys)
    assert generate_main(["--model", str(LLADA), "--prompt-ids", "1,2", "--entropy-bound", "0.1"]) == 2
    assert "entropy_bound=0.1: used only by DiffusionGemma's entropy-bound sampler, not by llada" in _one_line_error(
        capsys
    )
    with pytest.raises(DecodeConfigError, match=r"cache='none': not used by DiffusionGemma"):
        load_model(TINY).settings(None, {"cache": "none"})


def test_mask_families_refuse_the_sampler_fields_by_name(capsys):
    with pytest.raises(DecodeConfigError, match=r"entropy_bound=0.5: used only by DiffusionGemma's .* not by llada"):
        checked_settings(LLADA, {"entropy_bound": 0.5})
    assert generate_main(["--model", str(LLADA), "--prompt-ids", "1,2", "--replay-draws", "x:y"]) == 2
    assert "--replay-draws replays DiffusionGemma's sampler; this model is llada" in _one_line_error(capsys)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-colon", "replay draws must be given as FILE:PREFIX, got 'no-colon'"),
        ("/nonexistent/file:x", "replay draws: /nonexistent/file is not a file"),
        (f"{TINY / 'config.json'}:x", "is not a safetensors file"),
        (f"{CASES_FILE}:nothing", "has no nothing.init_canvas, nothing.sample, nothing.renoise"),
        # the draws of another run: they do not fit these prompts' batch
        (
            f"{CASES_FILE}:diffusion-gemma-tiny.generate_default_batch_p0p2",
            "'init_canvas' must be [n, batch 1, canvas 32], got (2, 2, 32)",
        ),
    ],
)
def test_bad_replay_draws_are_one_line(spec, message, capsys):
    argv = ["--model", str(TINY), "--prompt-ids", "2,5,7", "--gen-length", "32", "--replay-draws", spec]
    assert generate_main(argv) == 2
    assert message in _one_line_error(capsys)


def test_draws_that_are_not_ids_are_refused(tmp_path):
    from safetensors.numpy import save_file

    file = tmp_path / "draws.safetensors"
    save_file({f"r.{n}": np.zeros((1, 1, 32), np.float32) for n in ("init_canvas", "sample", "renoise")}, str(file))
    with pytest.raises(InputError, match="r.init_canvas holds float32, not token ids"):
        read_draws(f"{file}:r")
    save_file({f"r.{n}": np.full((1, 1, 32), 512, np.int32) for n in ("init_canvas", "sample", "renoise")}, str(file))
    with pytest.raises(InputError, match=r"recorded draws 'init_canvas' hold ids outside the vocabulary \[0, 512\)"):
        load_model(TINY).generate([[2, 5]], gen_length=32, draws=read_draws(f"{file}:r"))


def test_int8_decodes_from_the_command_line_and_impossible_meshes_are_refused(capsys):
    argv = ["--model", str(TINY), "--prompt-ids", "2,5", "--gen-length", "32", "--max-denoising-steps", "4", "--json"]
    assert generate_main([*argv, "--quantize", "int8"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert len(row["output_ids"]) == 32 and row["nfe"] >= 1
    assert generate_main([*argv, "--mesh", "data=2"]) == 2
    assert "data=2 does not divide the 1 devices" in _one_line_error(capsys)


def test_tune_searches_the_samplers_settings_and_writes_what_generate_decodes(tmp_path, capsys):
    """``python -m psd_jax.tune`` on DiffusionGemma: the release's settings are the base, the small
    space's entropy-bound names the candidates; the choice is the cheapest within the loss, and
    ``--write`` stores it so that ``generate --settings recommended`` decodes it with the calls the
    tuner logged. A modeled device is refused in one line (the family's calls are not priced)."""
    from psd_jax.recommended import read_recommended

    model_dir = tiny_with_tokenizer(tmp_path / "model")
    data = tmp_path / "dev.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    out = tmp_path / "tune"
    argv = [
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--space",
        "small",
        "--confirm",
        "2",
        "--rungs",
        "4",
        "--batch",
        "2",
        "--gen-length",
        "64",
        "--base",
        "entropy-bound-0.1-s6",
        "--max-loss",
        "0",
        "--confirm-z",
        "0",
    ]  # fmt: skip  (no bound certifies a loss of 0 on 2 problems: the point estimate)
    assert tune_main([*argv, "--out", str(out), "--write"]) == 0
    report = json.loads((out / "tune.json").read_text())
    assert report["base"]["name"] == "entropy-bound-0.1-s6"  # candidates over the base: its 6 steps
    assert set(report["candidates"]) == {"entropy-bound-1-s6", "entropy-bound-1-s24"}
    within = [c for c in report["candidates"].values() if c["status"] in ("within max loss", "chosen")]
    chosen = report["candidates"][report["choice"]]
    assert chosen["cost_per_prompt"] == min(c["cost_per_prompt"] for c in within)
    rec = read_recommended(model_dir)
    tuned_at = {**rec.settings, "gen_length": 64}  # a recommendation holds no length: the user's
    assert rec.tuned and model_settings(model_dir, tuned_at) == DecodeConfig(**chosen["settings"])
    logged = {}
    for entry in map(json.loads, (out / "tune.jsonl").read_text().splitlines()):
        if entry["name"] == report["choice"]:
            logged.update(zip(entry["problems"], entry["nfe"]))
    capsys.readouterr()
    question = json.loads(data.read_text().splitlines()[0])["question"]
    argv_generate = ["--model", str(model_dir), "--settings", "recommended", "--gen-length", "64", "--json"]
    assert generate_main([*argv_generate, "--prompt", question]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["nfe"] == logged[0]
    assert tune_main([*argv, "--out", str(tmp_path / "h200"), "--device", "h200"]) == 2
    assert "--device h200: DiffusionGemma's decodes are ranked by their own seconds" in _one_line_error(capsys)


def test_bench_times_named_settings_against_the_release_as_generate_decodes_them(tmp_path, capsys):
    """``python -m psd_jax.bench`` on DiffusionGemma: the release's settings first (the baseline),
    then the named ones; each row's tokens, calls and upstream's TPF (ids written per denoising
    pass) are ``generate``'s on the same batch. Names of another grammar and the mask families'
    flags are refused in one line."""
    model = tiny_with_tokenizer(tmp_path / "model")
    data = tmp_path / "problems.jsonl"
    problems = [{"question": "What is 2+3?", "answer": "5"}, {"question": "Say 7", "answer": "7"}]
    data.write_text("".join(json.dumps(p) + "\n" for p in problems))
    argv = ["--model", str(model), "--data", str(data), "--batch", "2", "--gen-length", "40"]
    named = "entropy-bound-2-s6-stop0.5"  # a flag over the release's settings changes the baseline too:
    argv += ["--max-denoising-steps", "6"]
    assert bench_main([*argv, "--decoders", named, "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["meta"]["baseline"] == "entropy-bound-0.1-s6"
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == ["entropy-bound-0.1-s6", named]
    lm = load_model(model)
    for name, settings in [("entropy-bound-0.1-s6", dict(max_denoising_steps=6)),
                           (named, dict(entropy_bound=2.0, max_denoising_steps=6, confidence_threshold=0.5))]:  # fmt: skip
        out = lm.generate([p["question"] for p in problems], gen_length=40, **settings)
        row = rows[name]
        assert row["settings"]["gen_length"] == 64  # rounded up to whole canvases, as upstream does
        assert row["tokens"] == sum(g.tokens for g in out) and row["nfe_per_prompt"] == sum(g.nfe for g in out) / 2
        passes = sum(g.stats["decoder_passes"] for g in out)
        assert row["decoder_passes"] == passes
        assert row["tpf"] == pytest.approx(sum(g.stats["generated_ids"] for g in out) / passes)
    assert rows[named]["speedup_tokens_per_second"] > 0 and rows[named]["baseline"] == "entropy-bound-0.1-s6"
    capsys.readouterr()
    for extra, message in [
        (["--decoders", "threshold-0.9"], "unknown DiffusionGemma setting name 'threshold-0.9'"),
        (["--cache", "dual"], "cache='dual': not used by DiffusionGemma's entropy-bound sampler"),
    ]:
        assert bench_main([*argv, *extra, "--out", str(tmp_path / "bad")]) == 2
        assert message in _one_line_error(capsys)


def test_server_batches_rows_at_canvas_boundaries_and_answers_as_generate(tmp_path):
    """``/v1/completions`` on DiffusionGemma: concurrent requests of one and two canvases, with their
    own seeds, share batches (rows join between canvases) and each gets ``generate([prompt],
    seed=seed)``'s answer and calls; a stream sends one chunk per canvas; a field the sampler does
    not use is a 400 naming it."""
    model_dir = tiny_with_tokenizer(tmp_path / "model")
    lm = load_model(model_dir)
    defaults = lm.settings(None, {"gen_length": 64, "max_denoising_steps": 6})
    app = build_app(lm, defaults, name="dg", batch_sizes=(1, 2), max_wait_ms=10, prompt_bucket=32)
    asks = [dict(prompt=p, max_tokens=(32, 64)[i % 2], seed=i) for i, p in enumerate(["What is 2+3?", "Say 7", "Hi!"])]
    with running(app) as url:
        api = client(url)
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda kw: api.completions.create(model="dg", **kw), asks))
        for kw, answer in zip(asks, got):
            (want,) = lm.generate([kw["prompt"]], defaults.replace(gen_length=kw["max_tokens"]), seed=kw["seed"])
            assert answer.choices[0].token_ids == want.output_ids[: want.tokens] and answer.choices[0].text == want.text
            assert answer.usage.model_calls == want.nfe
        (want,) = lm.generate(["Say 7"], defaults, seed=1)
        chunks = [c.choices[0].text for c in api.completions.create(model="dg", prompt="Say 7", seed=1, stream=True)]
        assert "".join(chunks) == want.text and len(chunks) == 1 + (want.tokens >= 32)
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="dg", prompt="Say 7", temperature=0.5)
        assert refused.value.body["param"] == "temperature" and "not used by DiffusionGemma" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:  # at its default value too
            api.completions.create(model="dg", prompt="Say 7", extra_body={"threshold": 0.9})
        assert refused.value.body["param"] == "threshold"
        with pytest.raises(openai.BadRequestError) as refused:  # generate records it; serving not yet
            api.completions.create(model="dg", prompt="Say 7", extra_body={"trace": True})
        assert refused.value.body["param"] == "trace" and "records no trace yet" in refused.value.message


def test_rows_of_other_bounds_temperatures_and_confidences_share_a_session_and_decode_as_alone():
    """The entropy bound, the temperatures and the stopping confidence are each row's runtime
    values: rows differing in them share one program and one batch, and each decodes as
    ``generate([prompt], settings, seed=seed)`` alone (its calls at least alone's: a row stopped
    early waits for the others' steps of the canvas). Steps or stopping on and off are programs of
    their own, refused in one batch."""
    lm = load_model(TINY)
    base = lm.settings(None, {"gen_length": 64, "max_denoising_steps": 6})
    rows = [base, base.replace(entropy_bound=2.0, t_min=0.2, t_max=1.0), base.replace(confidence_threshold=2.0)]
    prompts, seeds = [[2, 5, 9], [2, 7], [2, 40, 41, 42]], [1, 2, 3]
    assert len({lm.program_key(s, 64) for s in rows}) == 1
    run = lm.start_rows(prompts, rows, seeds)
    while not run.done:
        progress = run.advance()
    for r, settings in enumerate(rows):
        (want,) = lm.generate([prompts[r]], settings, seed=seeds[r])
        assert progress.generated[r].tolist() == want.output_ids and progress.nfe[r] >= want.nfe
    with pytest.raises(InputError, match="differ in steps or stopping"):
        lm.start_rows(prompts[:2], [base, base.replace(max_denoising_steps=4)], seeds[:2])


def test_harness_generate_until_equals_generate_and_likelihood_is_refused(tmp_path):
    """lm-evaluation-harness requests through the psd_jax model on DiffusionGemma: a batch decodes as
    ``generate`` does with the same settings (a model argument over the release's), ``max_gen_toks``
    caps the length in whole canvases and cuts the text, and loglikelihood requests are refused in
    one line (the family has no mask token to score with)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from psd_jax.evaluate.harness import PsdJaxLM

    model_dir = tiny_with_tokenizer(tmp_path / "model")
    model = PsdJaxLM(pretrained=str(model_dir), batch_size=2, max_denoising_steps=6, gen_length=64)
    prompts = ["What is 2+3?", "Say 7"]
    lm = load_model(model_dir)
    want = lm.generate([model._encode(p) for p in prompts], max_denoising_steps=6, gen_length=64)
    request = lambda p, kw: Instance("generate_until", kw, (p, kw), 0, ("t", 0, 1))  # noqa: E731

    def plain(text: str) -> str:  # the harness removes special tokens from its answers
        for special in lm.tokenizer.all_special_tokens:
            text = text.replace(special, "")
        return text

    texts = model.generate_until([request(p, {"until": []}) for p in prompts])
    assert texts == [plain(g.text) for g in want] and any(texts)
    short = lm.generate([model._encode(prompts[0])], max_denoising_steps=6, gen_length=32)[0]
    capped = model.generate_until([request(prompts[0], {"until": [], "max_gen_toks": 5})])[0]
    assert capped == plain(lm.decode_text(short.output_ids[:5]))
    with pytest.raises(InputError, match="DiffusionGemma has no likelihood estimate"):
        model.loglikelihood([Instance("loglikelihood", {}, ("2+3=", "5"), 0, ("t", 0, 1))])


def test_decode_config_keeps_the_release_defaults():
    """The dataclass's own defaults are the released generation_config.json's, so the Python API
    without a directory (``DecodeConfig()``) and the CLI agree."""
    d = DecodeConfig()
    assert {k: getattr(d, k) for k in release_settings(TINY) if k != "gen_length"} == {
        k: v for k, v in release_settings(TINY).items() if k != "gen_length"
    }
