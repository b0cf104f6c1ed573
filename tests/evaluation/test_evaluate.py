"""The harness model psd_jax and python -m psd_jax.evaluate, offline: local tasks over jsonl files.

The end-to-end score test runs the real harness command line in a subprocess; the others call
``psd_jax.evaluate.main`` in this process with the harness's built-in task index switched off
(``include_defaults=False``: the local tasks do not need it, and indexing it costs 9 s a run).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import GOLDENS

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import simple_parse_args_string  # noqa: E402
from paths import ROOT, TEST_DATA

from psd_jax import DecodeConfig, InputError, load_model  # noqa: E402
from psd_jax.cli.bench import decoder_matrix, run_setting  # noqa: E402
from psd_jax.evaluate import cli  # noqa: E402
from psd_jax.evaluate.args import EvalArgsError, parse_eval_args  # noqa: E402
from psd_jax.evaluate.efficiency import efficiency_files  # noqa: E402
from psd_jax.evaluate.loglikelihood import Estimator, LikelihoodScorer  # noqa: E402
from psd_jax.model_dir import DEFAULT_MODEL_DIR, model_settings  # noqa: E402
from psd_jax.scoring import load_jsonl  # noqa: E402

HELD_OUT = DEFAULT_MODEL_DIR / "test.jsonl"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

TASKS = TEST_DATA / "tasks"  # heldout.yaml: the held-out set with GSM8K's filters and psd-scoring

GENERATE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
num_fewshot: 0
metadata:
  version: 1.0
"""

MULTIPLE_CHOICE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
num_fewshot: 0
metadata:
  version: 1.0
"""


def write_task(directory: Path, name: str, template: str, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / f"{name}.yaml").write_text(template.format(name=name, data=data))
    return directory


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda s: s["doc_id"])


@pytest.fixture
def harness_in_process(monkeypatch):
    """``psd_jax.evaluate.main`` here, with the harness's built-in task index off and offline datasets."""
    import lm_eval.tasks

    original = lm_eval.tasks.TaskManager

    def local_only(*args, **kwargs):
        return original(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", local_only)
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    return cli.main


@pytest.fixture(scope="module")
def shipped():
    return load_model()


# ------------------------------------------------------------------------ end to end


def test_harness_score_equals_bench_problem_by_problem(tmp_path):
    """python -m psd_jax.evaluate on the held-out set as a harness task (tests/data/tasks) decodes
    the same text as psd_jax.cli.bench, problem by problem, and its psd-scoring filter (the bench's
    answer rule) gives the bench's score on each problem; the efficiency record is written beside
    the results and into them."""
    n, batch = 8, 8
    fields = {"policy": "threshold", "threshold": 0.9, "decoder": "psd", "depth": 3}
    model_args = ",".join(f"{k}={v}" for k, v in fields.items())
    command = [sys.executable, "-m", "psd_jax.evaluate", "--tasks", "heldout", "--include_path", str(TASKS)]
    command += ["--limit", str(n), "--batch_size", str(batch), "--apply_chat_template", "--log_samples"]
    command += ["--output_path", str(tmp_path / "out"), "--model_args", model_args]
    run = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    logged = [s for s in samples(tmp_path / "out", "heldout") if s["filter"] == "psd-scoring"]
    harness = [int(s["exact_match"]) for s in logged]

    lm = load_model()
    settings = decoder_matrix(model_settings(DEFAULT_MODEL_DIR, {}), ["psd-threshold-0.9-d3"])[
        "psd-threshold-0.9-d3/none"
    ]
    assert settings == parse_eval_args(simple_parse_args_string(model_args)).settings
    examples = load_jsonl(HELD_OUT)[:n]
    row = run_setting(lm, "psd-threshold-0.9-d3", settings, examples, batch, None, 32)
    assert harness == row.correct_by_problem
    texts = [g.text for g in lm.generate([ex["question"] for ex in examples], settings)]
    assert [s["resps"][0][0] for s in logged] == texts

    (record,) = efficiency_files(tmp_path / "out")
    stats = record["tasks"]["heldout"]
    assert stats["requests"] == n and stats["nfe"] == row.nfe and stats["tokens"] == row.tokens
    assert "psd_jax efficiency" in run.stdout and "tokens/s" in run.stdout
    (results,) = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(results.read_text())["config"]["psd_jax"]["tasks"]["heldout"]["nfe"] == row.nfe


def test_multiple_choice_task_through_loglikelihood(tmp_path, harness_in_process, shipped):
    """A multiple-choice task end to end: each choice's log-likelihood the harness logged is the
    estimator's value for that request, and acc is the share of questions whose label wins."""
    rows = []
    for i, ex in enumerate(load_jsonl(HELD_OUT)[:4]):
        right = ex["answer"]
        wrong = [right.rsplit("####", 1)[0] + f"#### {int(right.rsplit('####', 1)[1]) + d}" for d in (1, 7)]
        choices = wrong[: i % 3] + [right] + wrong[i % 3 :]
        rows.append({"question": ex["question"], "choices": choices, "label": i % 3})
    write_task(tmp_path / "tasks", "choice", MULTIPLE_CHOICE, rows)
    args = "mc_num=8,mc_batch=4,seed=3"
    code = harness_in_process(
        ["--tasks", "choice", "--include_path", str(tmp_path / "tasks"), "--apply_chat_template", "--log_samples"]
        + ["--output_path", str(tmp_path / "out"), "--batch_size", "2", "--model_args", args]
    )
    assert code == 0
    logged = samples(tmp_path / "out", "choice")
    scorer = LikelihoodScorer(shipped, Estimator(mc_num=8, mc_batch=4, seed=3, draws_per_call=5))
    from psd_jax.evaluate.harness import CREATED

    model = CREATED[-1]
    correct = []
    for s in logged:
        context = s["arguments"]["gen_args_0"]["arg_0"]
        values = []
        for j, choice in enumerate(rows[s["doc_id"]]["choices"]):
            assert s["arguments"][f"gen_args_{j}"]["arg_1"] == choice  # chat templated: no delimiter
            prep = scorer.prepare(*model._encode_pair(context, choice))
            values.append(scorer.loglikelihoods([prep])[0])
        assert [float(r[0]) for r in s["filtered_resps"]] == pytest.approx(values, rel=1e-5)
        correct.append(int(np.argmax(values) == rows[s["doc_id"]]["label"]))
        assert s["acc"] == correct[-1]
    stats = model.efficiency_record()["tasks"]["choice"]
    assert stats["scored_requests"] == 3 * len(rows) and stats["scoring_calls"] > 0


# ------------------------------------------------------------------------- estimator


def direct_nll_sum(lm, ids: list[int], masked: list[int], cfg: float, prompt_len: int) -> float:
    """Σ CE of the masked positions from ``lm.logits`` on the unpadded sequence (numpy)."""
    noisy = np.array(ids)
    noisy[masked] = lm.config.mask_id
    logits = np.asarray(lm.logits(noisy[None]))[0].astype(np.float64)
    if cfg > 0:
        uncond = noisy.copy()
        uncond[:prompt_len] = lm.config.mask_id
        u = np.asarray(lm.logits(uncond[None]))[0].astype(np.float64)
        logits = u + (cfg + 1) * (logits - u)
    shift = lm.config.logit_shift
    total = 0.0
    for j in masked:
        row = logits[j - shift]
        total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[ids[j]]
    return total


def direct_expectation(lm, context, continuation, group: int, cfg: float) -> float:
    """The estimator's expectation by enumeration, weighted by LLaDA's stratification written
    with torch-style rounding of k + i·T/group (round half to even)."""
    t, ids = len(continuation), [*context, *continuation]
    by_size = {}
    for m in range(1, t + 1):
        subsets = itertools.combinations(range(len(context), len(ids)), m)
        by_size[m] = np.mean([direct_nll_sum(lm, ids, list(s), cfg, len(context)) for s in subsets])
    total = 0.0
    for k in range(1, t + 1):
        counts = [(int(np.round(k + i * t / group)) - 1) % t + 1 for i in range(group)]
        total += np.mean([t / m * by_size[m] for m in counts])
    return total / t


@pytest.mark.parametrize(("name", "cfg"), [("llada-tiny", 0.0), ("dream-tiny", 0.0), ("dream-tiny", 0.5)])
def test_exact_expectation_equals_direct_computation(name, cfg):
    lm = load_model(GOLDENS / name)
    scorer = LikelihoodScorer(lm, Estimator(mc_batch=8, cfg=cfg))
    context, continuation = [5, 17, 33, 101, 7, 9, 250], [44, 12, 300, 8]
    exact = scorer.exact_nll(context, continuation)
    assert exact == pytest.approx(direct_expectation(lm, context, continuation, 8, cfg), rel=1e-5)


@pytest.mark.parametrize("name", ["llada-tiny", "dream-tiny"])
def test_monte_carlo_mean_within_standard_errors_of_exact(name):
    lm = load_model(GOLDENS / name)
    scorer = LikelihoodScorer(lm, Estimator(mc_num=2048, mc_batch=8, draws_per_call=64, seed=11))
    context, continuation = [5, 17, 33, 101, 7, 9], [44, 12, 300]
    exact = scorer.exact_nll(context, continuation)
    draws = scorer.draw_losses([scorer.prepare(context, continuation)])[0]
    standard_error = draws.std(ddof=1) / np.sqrt(len(draws))
    assert abs(draws.mean() - exact) < 4 * standard_error
    assert standard_error < 0.02 * exact  # enough draws for the check to mean something


def test_estimates_do_not_depend_on_batch_mates():
    lm = load_model(GOLDENS / "llada-tiny")
    scorer = LikelihoodScorer(lm, Estimator(mc_num=16, mc_batch=4, draws_per_call=3))
    pairs = [([1, 2, 3], [4, 5]), ([9, 8, 7, 6, 5, 4], [3]), ([11, 12], [13, 14, 15, 16])]
    preps = [scorer.prepare(*p) for p in pairs]
    together = scorer.loglikelihoods(preps)
    alone = [scorer.loglikelihoods([p])[0] for p in reversed(preps)][::-1]
    assert together == pytest.approx(alone, rel=1e-6, abs=1e-6)


def test_greedy_check_recognises_the_greedy_continuation():
    lm = load_model(GOLDENS / "llada-tiny")
    scorer = LikelihoodScorer(lm, Estimator(mc_num=4, mc_batch=4))
    context = [5, 17, 33, 101]
    (greedy,) = lm.generate([context], gen_length=4, block_length=4, eos_early_stop=False)
    other = [(greedy.output_ids[0] + 1) % 500, *greedy.output_ids[1:]]
    preps = [scorer.prepare(context, greedy.output_ids), scorer.prepare(context, other)]
    assert scorer.greedy(preps, batch=2) == [True, False]


# ---------------------------------------------------------------------- generate_until


def request(context: str, task: str = "t", **kwargs) -> Instance:
    return Instance("generate_until", {}, (context, kwargs), 0, (task, 0, 1))


@pytest.fixture(scope="module")
def harness_model():
    from psd_jax.evaluate.harness import PsdJaxLM

    return PsdJaxLM(batch_size=3)


def test_batched_requests_equal_one_at_a_time_and_max_gen_toks(harness_model):
    """Three requests in one batch decode as they do alone; max_gen_toks 20 decodes 32 positions
    (2 blocks of 16, recorded) and the text keeps at most 20 tokens."""
    model = harness_model
    questions = [ex["question"] for ex in load_jsonl(HELD_OUT)[:3]]
    prompts = [model.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    reqs = [request(p, until=["\n\n"], max_gen_toks=20) for p in prompts]
    batched = model.generate_until(reqs)
    model.args = dataclass_replace(model.args, batch_size=1)
    alone = [model.generate_until([r])[0] for r in reqs]
    assert batched == alone and all(batched)
    assert all(len(model._encode(text)) <= 20 for text in batched)
    assert model.efficiency.tasks["t"].gen_lengths == {"20": 32}


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_until_cuts_the_text_and_special_tokens_are_removed(harness_model):
    from psd_jax.evaluate.harness import _GenJob

    model = harness_model
    ids = model._encode("hens 5 * 4 = 20\nQuestion: next<|eot_id|>")
    job = _GenJob(ids, model.args.settings, ["Question:"], None, "t")
    assert model._text(ids, len(ids), job) == "hens 5 * 4 = 20\n"
    job = _GenJob(ids, model.args.settings, [], 3, "t")
    assert model._text(ids, len(ids), job) == model.lm.tokenizer.decode(ids[:3])
    eot = model._encode("a<|eot_id|>b")
    assert model._text(eot, len(eot), _GenJob(eot, model.args.settings, [], None, "t")) == "ab"


def test_chat_template_hooks_give_the_library_prompt(harness_model, shipped):
    model = harness_model
    question = load_jsonl(HELD_OUT)[0]["question"]
    text = model.apply_chat_template([{"role": "user", "content": question}])
    assert model._encode(text) == shipped.encode(question, chat=True)
    assert model.chat_template(True) == shipped.tokenizer.chat_template
    assert model.tokenizer_name.endswith("models__default")


# ------------------------------------------------------------------------- bad input


def test_model_arguments_parse_like_the_harness():
    args = parse_eval_args(simple_parse_args_string("decoder=psd,depth=2,cache=dual,mesh=data=1,model=1,seed=4"))
    assert args.mesh == "data=1,model=1" and args.seed == 4
    assert args.settings.depth == 2 and args.settings.gen_length == 48  # the shipped model's decode default
    assert parse_eval_args({"mesh": "data=1;model=1"}).mesh == "data=1,model=1"
    assert parse_eval_args({"eos_early_stop": "false", "steps": "24"}).settings.steps == 24
    with pytest.raises(EvalArgsError, match="mc_batch 3 does not divide mc_num 8"):
        parse_eval_args({"mc_num": 8, "mc_batch": 3})


def test_default_model_is_inserted():
    assert cli.with_default_model(["--tasks", "x"]) == ["--model", "psd_jax", "--tasks", "x"]
    assert cli.with_default_model(["run", "--tasks", "x"])[:3] == ["run", "--model", "psd_jax"]
    assert cli.with_default_model(["--model", "hf"]) == ["--model", "hf"]
    assert cli.with_default_model(["ls", "tasks"]) == ["ls", "tasks"]


def small_vocab_dir(root: Path) -> Path:
    """The shipped model's config with a 32-token vocabulary beside an empty weights file: a
    directory that passes the pre-check's file checks, whose weights would fail to load if read."""
    root.mkdir(parents=True, exist_ok=True)
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "vocab_size": 32, "embedding_size": 32}))
    (root / "model.safetensors").write_bytes(b"")
    return root


def bad_run_dirs(root: Path) -> dict[str, Path]:
    (root / "empty").mkdir(parents=True)
    (root / "config_only").mkdir()
    (root / "config_only" / "config.json").write_text((DEFAULT_MODEL_DIR / "config.json").read_text())
    return {"empty": root / "empty", "config_only": root / "config_only", "small": small_vocab_dir(root / "small")}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model_args", "foo=1,policy=fixed"], "unknown model argument(s) foo"),
        (["--model_args", "depth=5"], "depth=5 would be ignored"),
        (["--model_args", "policy=threshold,threshold=2"], "threshold must be in (0, 1]"),
        (["--model_args", "mc_num=0"], "mc_num must be an integer >= 1"),
        (["--model_args", "trace=true"], "model argument trace: the harness does not report a decode's trace"),
        (["--model_args", "pretrained={empty}"], "{empty}: not a model directory (no config.json)"),
        (
            ["--model_args", "pretrained={config_only}"],
            "{config_only}: no weights: neither a Hugging Face safetensors directory",
        ),
        (["--model_args", "pretrained={small},decoder=rps,k_max=40"], "k_max 40 exceeds the vocabulary of 32"),
        (
            ["--model_args", "gen_length=512"],
            "gen_length 512 leaves no room for a prompt in the model's context of 512",
        ),
        (["--gen_kwargs", "num_beams=4"], "generation kwarg(s) num_beams=4 cannot be honoured"),
        (["--model_args", "settings=fastest"], "unknown settings 'fastest'; choose one of: recommended"),
        (["--settings", "fastest"], "--settings: unknown settings 'fastest'; choose one of: recommended"),
        (["--settings", "recommended", "--protocol", "llada-gsm8k"], "--settings recommended and --protocol cannot"),
        (
            ["--protocol", "fastdllm-llada-gsm8k-baseline", "--model_args", "settings=recommended", "--dry-run"],
            "the model argument settings=recommended and --protocol fastdllm-llada-gsm8k-baseline cannot be combined",
        ),
        (["--gen_kwargs", "do_sample=true,top_p=0.9"], "top_p=0.9 would be ignored: at temperature 0 this family"),
        (
            ["--model_args", "temperature=0.5", "--gen_kwargs", "do_sample=false"],
            "--gen_kwargs ask for temperature 0 (do_sample=false), but the model argument temperature=0.5 was set",
        ),
    ],
)
def test_bad_arguments_fail_before_the_harness_indexes_tasks(argv, message, tmp_path, capsys, monkeypatch):
    """Model arguments and --gen_kwargs are refused by the pre-check, in one line and exit code 2,
    before the harness makes its task index or any model is loaded."""
    import lm_eval.tasks

    import psd_jax.evaluate.harness

    dirs = bad_run_dirs(tmp_path)
    monkeypatch.setattr(psd_jax.evaluate.harness, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda *a, **k: pytest.fail("tasks indexed"))
    code = cli.main(["--tasks", "nothing", *(a.format(**dirs) for a in argv)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message.format(**dirs) in err[0]


def test_harness_model_checks_the_settings_against_the_model_before_loading(monkeypatch):
    """The Python API's path (the harness making the model) runs the same model-dependent check."""
    import psd_jax.evaluate.harness
    from psd_jax.evaluate.harness import PsdJaxLM

    monkeypatch.setattr(psd_jax.evaluate.harness, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(EvalArgsError, match="gen_length 512 leaves no room for a prompt"):
        PsdJaxLM(gen_length=512)


def test_a_too_old_harness_is_one_line_naming_the_version(capsys, monkeypatch):
    """lm-eval before 0.4.10 has no lm_eval._cli (the pre-check's parser): one error line; the
    floor is pyproject.toml's eval extra."""
    import tomllib

    monkeypatch.setitem(sys.modules, "lm_eval._cli", None)  # import lm_eval._cli fails, as in 0.4.9.2
    code = cli.main(["--tasks", "nothing"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: python -m psd_jax.evaluate needs lm-evaluation-harness >= 0.4.10 (")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["eval"] == [f"lm-eval>={cli.MIN_LM_EVAL}"] and cli.MIN_LM_EVAL == "0.4.10"


def test_evaluation_is_a_subpackage_registering_the_harness_model():
    import importlib.util

    from lm_eval.api.registry import get_model

    from psd_jax.evaluate.harness import PsdJaxLM

    assert get_model("psd_jax") is PsdJaxLM
    assert importlib.util.find_spec("psd_jax.evaluate.__main__") is not None


def generate_task(generation_kwargs: dict) -> str:
    """GENERATE with the task's own ``generation_kwargs``."""
    flow = json.dumps(generation_kwargs).replace("{", "{{").replace("}", "}}")
    return GENERATE + f"generation_kwargs: {flow}\n"


CONTEXT = (
    "error: a long request's prompt (902 tokens, padded to 928) + gen_length 48 exceeds the model's context of 512"
)


@pytest.mark.parametrize(
    ("generation_kwargs", "message"),
    [
        ({"until": [], "repetition_penalty": 1.2}, "error: generation kwarg(s) repetition_penalty=1.2 cannot be"),
        ({"until": [], "num_beams": 4}, "error: generation kwarg(s) num_beams=4 cannot be honoured"),
        (None, CONTEXT),
    ],
)
def test_requests_that_cannot_run_fail_before_any_decode(
    generation_kwargs, message, tmp_path, harness_in_process, capsys, monkeypatch
):
    """A task's generation kwargs that psd_jax cannot honour, or a prompt beyond the context: one
    line, exit code 2, before the first decode."""
    from psd_jax.api import LoadedModel

    monkeypatch.setattr(LoadedModel, "generate", lambda *a, **k: pytest.fail("decoded"))
    rows = [load_jsonl(HELD_OUT)[0]]
    if generation_kwargs is None:
        rows.append({"question": "How many? " * 300, "answer": "#### 1"})
    template = GENERATE if generation_kwargs is None else generate_task(generation_kwargs)
    write_task(tmp_path / "tasks", "long", template, rows)
    code = harness_in_process(["--tasks", "long", "--include_path", str(tmp_path / "tasks")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(err) == 1 and err[0].startswith(message)


def test_gen_kwargs_temperature_and_do_sample_reach_the_decode(tmp_path, harness_in_process, monkeypatch):
    """--gen_kwargs temperature=3.0 over two local tasks: the one whose config says do_sample: false
    decodes greedily (the model arguments' settings, and greedy's text), the other samples at 3.0
    (its settings carry the temperature, and its text is generate's at 3.0 with the run's seed)."""
    from psd_jax.api import LoadedModel
    from psd_jax.evaluate.harness import CREATED

    calls = []
    original = LoadedModel.generate

    def recording(self, prompts, settings, **kwargs):
        calls.append(settings.temperature)
        return original(self, prompts, settings, **kwargs)

    monkeypatch.setattr(LoadedModel, "generate", recording)
    rows = load_jsonl(HELD_OUT)[:2]
    write_task(tmp_path / "tasks", "greedy", generate_task({"until": [], "do_sample": False}), rows)
    write_task(tmp_path / "tasks", "sampled", generate_task({"until": []}), rows)
    tasks = ["--tasks", "greedy,sampled", "--include_path", str(tmp_path / "tasks"), "--apply_chat_template"]
    run = ["--batch_size", "2", "--log_samples", "--output_path", str(tmp_path / "out")]
    code = harness_in_process(
        [*tasks, *run, "--gen_kwargs", "temperature=3.0", "--model_args", "gen_length=16,block_length=16"]
    )
    assert code == 0 and sorted(calls) == [0.0, 3.0]
    model = CREATED[-1]
    ids = [model._encode(model.apply_chat_template([{"role": "user", "content": r["question"]}])) for r in rows]
    base = model.args.settings
    assert base.temperature == 0.0
    greedy = [g.text for g in original(model.lm, ids, base, seed=model.args.seed)]
    sampled = [g.text for g in original(model.lm, ids, base.replace(temperature=3.0), seed=model.args.seed)]
    assert [s["resps"][0][0] for s in samples(tmp_path / "out", "greedy")] == greedy and all(greedy)
    assert [s["resps"][0][0] for s in samples(tmp_path / "out", "sampled")] == sampled
    assert sampled != greedy  # the temperature changed the decode, not only the settings


@pytest.mark.parametrize(
    ("gen_kwargs", "explicit", "temperature"),
    [
        ({"until": ["\n"], "do_sample": False, "temperature": 0.0, "max_gen_toks": 20}, (), 0.0),  # a usual task
        ({"do_sample": False, "temperature": 0.7}, (), 0.0),  # do_sample=False: greedy
        ({"do_sample": "false"}, {"temperature"}, 0.0),  # as text; equal to the model argument: no conflict
        ({"temperature": 0.7}, (), 0.7),
        ({"do_sample": True, "temperature": 0.7}, (), 0.7),
        ({"do_sample": True}, {"temperature"}, 0.0),  # no temperature: the model argument's
        ({"until": []}, {"temperature"}, 0.0),
        ({"num_beams": 1, "top_p": 1.0, "max_new_tokens": 16}, (), 0.0),  # neutral values, an alias
    ],
)
def test_generation_kwargs_map_onto_the_temperature(gen_kwargs, explicit, temperature):
    from psd_jax import DecodeConfig
    from psd_jax.evaluate.gen_kwargs import parse_gen_kwargs, request_settings

    settings = DecodeConfig(gen_length=32, block_length=16, temperature=0.0)
    gen = parse_gen_kwargs(gen_kwargs)
    assert request_settings(settings, gen, explicit, "t").temperature == temperature
    assert gen.max_tokens == gen_kwargs.get("max_gen_toks", gen_kwargs.get("max_new_tokens"))
    if gen_kwargs.get("temperature") is None and gen_kwargs.get("do_sample") in (None, True):
        at_04 = DecodeConfig(gen_length=32, block_length=16, temperature=0.4)
        assert request_settings(at_04, gen, {"temperature"}, "t").temperature == 0.4  # the model argument's, kept


@pytest.mark.parametrize(
    ("gen_kwargs", "message"),
    [
        ({"min_p": 0.1, "num_beams": 5}, "generation kwarg(s) min_p=0.1, num_beams=5 cannot be honoured"),
        ({"top_p": 0}, "generation kwarg top_p must be in (0, 1] (1: no filter), got 0"),
        ({"top_k": -2}, "generation kwarg top_k must be an integer >= 0 (0: no filter), got -2"),
        ({"temperature": -1}, "generation kwarg temperature must be a finite number >= 0, got -1"),
        ({"do_sample": "maybe"}, "generation kwarg do_sample must be true or false, got 'maybe'"),
        ({"max_gen_toks": 0}, "generation kwarg max_gen_toks must be positive, got 0"),
        ({"until": 3}, "generation kwarg until must be a string or a list of strings, got 3"),
    ],
)
def test_generation_kwargs_that_cannot_be_honoured_are_refused(gen_kwargs, message):
    from psd_jax.evaluate.gen_kwargs import parse_gen_kwargs

    with pytest.raises(InputError) as raised:
        parse_gen_kwargs(gen_kwargs)
    assert str(raised.value).startswith(message)


def test_a_temperature_set_as_model_argument_is_not_overridden_silently():
    from psd_jax import DecodeConfig
    from psd_jax.evaluate.gen_kwargs import parse_gen_kwargs, request_settings

    settings = DecodeConfig(gen_length=32, block_length=16, temperature=0.5)
    greedy = parse_gen_kwargs({"do_sample": False})
    with pytest.raises(
        InputError,
        match=r"^task gsm8k's generation kwargs ask for temperature 0 \(do_sample=false\), but the model argument temperature=0.5 was set; ",
    ):
        request_settings(settings, greedy, {"temperature"}, "task gsm8k's generation kwargs")
    assert request_settings(settings, greedy, (), "t").temperature == 0.0  # a default, not the user's


@pytest.mark.parametrize(
    ("settings", "steps"),
    [
        (dict(gen_length=64, block_length=8, steps=32), 12),  # total steps scale with the blocks kept
        (dict(gen_length=64, block_length=8, policy="threshold_schedule", threshold=0.9, steps=4), 4),  # per block
    ],
)
def test_max_gen_toks_caps_gen_length_and_keeps_the_steps_per_block(settings, steps):
    from types import SimpleNamespace

    from psd_jax import DecodeConfig
    from psd_jax.evaluate.efficiency import EfficiencyLog
    from psd_jax.evaluate.harness import PsdJaxLM

    host = SimpleNamespace(
        args=SimpleNamespace(settings=DecodeConfig(**settings)), efficiency=EfficiencyLog(), _noted=set()
    )
    capped = PsdJaxLM._settings_for(host, 20, "task")
    assert (capped.gen_length, capped.steps) == (24, steps)
    assert capped.steps_per_block == DecodeConfig(**settings).steps_per_block


def test_settings_recommended_is_a_model_argument_over_the_decode_defaults(tuned_model_dir, tmp_path, capsys):
    from psd_jax.core.config import RECOMMENDED
    from psd_jax.recommended import read_recommended

    from conftest import TUNED, model_with_recommendation

    tuned = parse_eval_args({"pretrained": str(tuned_model_dir), "settings": "recommended"})
    assert tuned.settings == DecodeConfig(gen_length=48, **TUNED) and tuned.decode_fields == {}
    flagged = parse_eval_args({"pretrained": str(tuned_model_dir), "settings": "recommended", "block_length": 16})
    assert flagged.settings == DecodeConfig(gen_length=48, **{**TUNED, "block_length": 16})
    untuned = model_with_recommendation(tmp_path / "untuned", DEFAULT_MODEL_DIR)
    assert parse_eval_args({"pretrained": str(untuned), "settings": "recommended"}).settings == DecodeConfig(
        gen_length=48, block_length=16, **RECOMMENDED
    )
    shipped = read_recommended(DEFAULT_MODEL_DIR).settings  # the shipped model's tuned setting
    assert parse_eval_args({"settings": "recommended"}).settings == DecodeConfig(gen_length=48, **shipped)
    assert cli.protocol_cli.with_settings(["run", "--tasks", "x", "--settings", "recommended"]) == [
        "run",
        "--model_args",
        "settings=recommended",
        "--tasks",
        "x",
    ]
    bad = model_with_recommendation(tmp_path / "bad", DEFAULT_MODEL_DIR, '{"settings": {"depth": 2}}')
    with pytest.raises(EvalArgsError, match=f"{bad / 'recommended.json'}: depth=2 would be ignored"):
        parse_eval_args({"pretrained": str(bad), "settings": "recommended"})
