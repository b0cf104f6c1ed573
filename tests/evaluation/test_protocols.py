"""The papers' evaluation protocols by name (psd_jax.evaluate.protocols, protocol_cli): the table,
its documentation, the expansion into the harness's command line, and the prompt ids each
protocol feeds the model against what the upstream evaluation code feeds it.

The prompt checks run the harness itself (``lm_eval.simple_evaluate`` over local data) with the
harness model's own prompt handling (``PsdJaxLM.apply_chat_template`` and ``_encode``) and a
tokenizer per family: Dream's real one (../shared/hf-configs), and byte-level stand-ins for LLaDA
and LLaDA2.0 (their special tokens and real chat templates) whose post-processor adds BOS, so that
"does the tokenizer add special tokens" matters.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest
from paths import HF_CONFIGS

from conftest import llada2_mini_config

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval._cli import HarnessCLI  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from paths import ROOT, TEST_DATA

from models import load_config  # noqa: E402
from psd_jax import DecodeConfig  # noqa: E402
from psd_jax.core.config import check_for_model  # noqa: E402
from psd_jax.evaluate import cli  # noqa: E402
from psd_jax.evaluate.args import parse_eval_args  # noqa: E402
from psd_jax.evaluate.gen_kwargs import parse_gen_kwargs, request_settings  # noqa: E402
from psd_jax.evaluate.harness import PsdJaxLM  # noqa: E402
from psd_jax.evaluate.protocol_cli import listing, merged  # noqa: E402
from psd_jax.evaluate.protocols import PACKAGE_TASKS, PROTOCOLS, TASKS_DIR, published  # noqa: E402
from psd_jax.model_dir import DEFAULT_MODEL_DIR, canvas_fields  # noqa: E402
from scripts.figures.protocol_table import DOC, render, replaced  # noqa: E402

HELD_OUT = ROOT / "models" / "default" / "test.jsonl"
DREAM_DIR = HF_CONFIGS / "Dream-v0-Instruct-7B"
LLADA_DIR = HF_CONFIGS / "LLaDA-8B-Instruct"


# ---------------------------------------------------------------------------- the table


def test_docs_hold_exactly_the_generated_tables():
    text = DOC.read_text()
    assert render() in text and replaced(text, render()) == text


def test_every_row_names_its_source_and_psd_and_rps_run_on_top_of_every_generation_row():
    rows = published()
    assert len(rows) == 59 and all(p.source and p.model and p.task for p in rows)
    # DiffusionGemma's one sampler and token editing's own block end: none on top.
    generation = [
        p for p in rows if p.generates and p.family != "diffusion_gemma" and p.decode.get("decoder") != "edit"
    ]
    editing = [p for p in rows if p.decode.get("decoder") == "edit"]
    assert [p.name for p in editing] == [
        f"llada21-mini-{m}-{t}" for m in ("quality", "speed") for t in ("gsm8k", "humaneval")
    ]
    assert len(PROTOCOLS) == len(rows) + 2 * len(generation)
    for base in generation:
        psd, rps = PROTOCOLS[f"{base.name}-psd"], PROTOCOLS[f"{base.name}-rps"]
        assert psd.decode == {**base.decode, "decoder": "psd", "depth": 3} and rps.decode == {
            **base.decode,
            "decoder": "rps",
        }
        assert psd.task == rps.task == base.task and psd.sampling == base.sampling and psd.published == "–"
    names = {line.split()[0] for line in listing().splitlines()[1:]}
    assert names == set(PROTOCOLS)


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("fastdllm-llada-gsm8k-baseline", dict(policy="fixed", steps=256, cache="none")),
        ("fastdllm-llada-gsm8k-prefix", dict(policy="fixed", steps=256, cache="prefix")),  # README's "+Cache"
        ("fastdllm-llada-gsm8k-dual-parallel", dict(policy="threshold", threshold=0.9, cache="dual")),
        ("fastdllm-dream-gsm8k-baseline", dict(policy="dream", confidence="entropy", steps=256, block_length=256)),
    ],
)
def test_fast_dllm_rows_are_its_scripts_runs(name, settings):
    p = PROTOCOLS[name]
    assert {k: p.decode[k] for k in settings} == settings and p.decode["gen_length"] == 256
    assert p.shots == 5 and p.batch_size == 1 and p.decode["eos_early_stop"] is False
    assert p.chat == (p.family == "llada") and p.add_bos_token == (p.family == "dream")


def test_every_protocol_runs_on_its_models_real_config():
    """Each row's settings are a valid DecodeConfig that the real checkpoint's config accepts (context,
    vocabulary, family rules), with its generation kwargs mapped as the harness model maps them; the
    LLaDA and Dream rows' model arguments pass the pre-check against the real configuration directory."""
    configs = {"llada": load_config(LLADA_DIR), "dream": load_config(DREAM_DIR), "llada2_moe": llada2_mini_config()}
    configs["sdar"] = load_config(HF_CONFIGS / "SDAR-8B-Chat")
    configs["diffusion_gemma"] = load_config(HF_CONFIGS / "DiffusionGemma-26B-A4B")
    directories = {"llada": LLADA_DIR, "dream": DREAM_DIR}
    for p in PROTOCOLS.values():
        if p.family in directories:
            args = parse_eval_args({**p.model_args(), "pretrained": directories[p.family]})
            settings = args.settings
            assert args.add_special_tokens == p.add_special_tokens and args.add_bos_token == p.add_bos_token
        elif p.family == "diffusion_gemma":  # its block is its canvas (model_settings puts it there)
            settings = DecodeConfig(**canvas_fields(p.decode, configs[p.family].canvas_length))
        else:
            settings = DecodeConfig(**p.decode)
        if p.generates:
            settings = request_settings(settings, parse_gen_kwargs(p.gen_kwargs()), p.decode, p.name)
            assert (settings.temperature, settings.top_p) == (
                p.sampling.get("temperature", 0.0),
                p.sampling.get("top_p", 1.0),
            )
            assert {k: getattr(settings, k) for k in p.decode} == p.decode
        check_for_model(settings, configs[p.family])


def test_the_projects_tasks_load_in_the_harness():
    index = TaskManager(include_path=str(TASKS_DIR), include_defaults=False).all_tasks
    assert {"humaneval_fenced", "humaneval_instruct_dream", "mbpp_instruct_dream", "mbpp_fenced"} == PACKAGE_TASKS
    assert set(index) >= PACKAGE_TASKS


# ------------------------------------------------------------------------ the expansion


def parsed(argv: list[str]):
    return HarnessCLI()._parser.parse_args(["run", *argv])


def test_user_flags_override_the_protocols(caplog):
    p = PROTOCOLS["dream-instruct-humaneval"]
    user = ["--model_args", "pretrained=ckpt/dream,dtype=float32", "--batch_size", "8", "--limit", "5"]
    user += ["--gen_kwargs", "top_p=0.95", "--tasks", "humaneval_fenced"]
    with caplog.at_level("WARNING"):
        args = parsed(merged(p, user, HarnessCLI))
    assert not [r for r in caplog.records if "Overwriting" in r.getMessage()]  # no overlap reaches the harness
    assert args.model_args == {**p.model_args(), "pretrained": "ckpt/dream", "dtype": "float32"}
    assert args.gen_kwargs == {**p.gen_kwargs(), "top_p": 0.95}
    assert args.tasks == ["humaneval_fenced"] and args.batch_size == "8" and args.limit == 5
    assert args.include_path == str(TASKS_DIR) and args.apply_chat_template is True
    alone = parsed(merged(p, [], HarnessCLI))
    assert alone.tasks == ["humaneval_instruct_dream"] and alone.num_fewshot == 0 and alone.confirm_run_unsafe_code


def test_dry_run_prints_the_command_it_would_run(capsys):
    code = cli.main(["--protocol", "llada-base-mmlu", "--dry-run", "--model_args", "pretrained=ckpt/base"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(f"# protocol llada-base-mmlu: {PROTOCOLS['llada-base-mmlu'].source}\n")
    command = shlex.split(out.split("python -m psd_jax.evaluate ", 1)[1].replace("\\\n", " "))
    args = parsed(command)
    assert args.model == "psd_jax" and args.tasks == ["mmlu"] and args.num_fewshot == 5
    assert args.model_args["pretrained"] == "ckpt/base" and args.model_args["mc_num"] == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--protocol", "fastdllm-llada-gsm8k"], "unknown protocol 'fastdllm-llada-gsm8k'; python -m psd_jax.evaluate"),
        (["--protocol"], "--protocol needs a name"),
        (
            ["--protocol", "fastdllm-llada-gsm8k-baseline"],
            "protocol fastdllm-llada-gsm8k-baseline evaluates GSAI-ML/LLaDA-8B-Instruct: download it (hf download",
        ),
        (
            ["--protocol", "dream-instruct-mbpp", "--model_args", f"pretrained={DEFAULT_MODEL_DIR}"],
            "protocol dream-instruct-mbpp is for dream checkpoints (Dream-org/Dream-v0-Instruct-7B); pretrained=",
        ),
    ],
)
def test_protocol_requests_that_cannot_run_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda *a, **k: pytest.fail("tasks indexed"))
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {message}")


# ---------------------------------------------------------------------------- prompt ids


class Recorder(PsdJaxLM):
    """The harness model's prompt handling without a model: records each request's context and ids."""

    def __init__(self, tokenizer, protocol):
        LM.__init__(self)
        args = protocol.model_args()
        self.lm = SimpleNamespace(tokenizer=tokenizer, has_chat_template=bool(tokenizer.chat_template))
        self.args = SimpleNamespace(
            pretrained=Path(protocol.model),
            add_bos_token=args.get("add_bos_token", False),
            add_special_tokens=args["add_special_tokens"],
        )
        self.contexts: list[str] = []
        self.ids: list[list[int]] = []

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.contexts += [r.args[0] for r in requests]
        self.ids += [self._encode(r.args[0]) for r in requests]
        return ["" for _ in requests]

    def get_model_info(self) -> dict:
        return {}


def harness_prompts(tokenizer, protocol, task: dict, chat: bool) -> Recorder:
    """Run the harness over ``task`` as ``python -m psd_jax.evaluate --protocol`` would (the
    protocol's shots, chat template and few-shot turns; ``chat=False``: the plain rendering)."""
    recorder = Recorder(tokenizer, protocol)
    lm_eval.simple_evaluate(
        model=recorder,
        tasks=[task],
        task_manager=TaskManager(include_defaults=False),
        num_fewshot=protocol.shots,
        limit=2,
        apply_chat_template=chat,
        fewshot_as_multiturn=protocol.multiturn if chat else False,
        predict_only=True,
        confirm_run_unsafe_code=True,
    )
    return recorder


@pytest.fixture(scope="module")
def dream_tokenizer():
    from psd_jax.tokenizer import load_tokenizer

    return load_tokenizer(DREAM_DIR, "dream")


def stand_in(specials: list[str], added: list[str], template: str, bos: str, eos: str):
    """A byte-level tokenizer (one token per byte, so whitespace counts as in a real BPE) with a
    family's special tokens, its chat template and a post-processor that prepends its BOS (so
    tokenizer(text) and the rendered text's own ids differ)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE({char: i for i, char in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=False) for t in added])
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def llada_tokenizer():
    real = json.loads((LLADA_DIR / "tokenizer_config.json").read_text())
    specials = ["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return stand_in(specials, [], real["chat_template"], "<|startoftext|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def llada2_tokenizer():
    real = json.loads((HF_CONFIGS / "LLaDA2.0-mini" / "tokenizer_config.json").read_text())
    specials = ["<|startoftext|>", "<|endoftext|>", "<|role_end|>"]
    return stand_in(specials, ["<role>", "</role>"], real["chat_template"], "<|startoftext|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def gsm8k_like(tmp_path_factory) -> dict:
    """The held-out set in the harness gsm8k task's format (its doc_to_text, target, delimiters),
    few-shot examples from the same file (first_n)."""
    data = tmp_path_factory.mktemp("gsm8k") / "data.jsonl"
    data.write_text("".join(line + "\n" for line in HELD_OUT.read_text().splitlines()[:8]))
    return {
        "task": "gsm8k_like",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"train": str(data), "test": str(data)}},
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "fewshot_config": {"sampler": "first_n"},
        "generation_kwargs": {"until": ["Question:"], "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    }


def task_config(name: str) -> dict:
    """One of the project's task files as the harness reads it (``!function utils.X``: tasks/utils.py's X)."""
    import yaml

    from psd_jax.evaluate.tasks import utils

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor(
        "!function", lambda loader, node: getattr(utils, loader.construct_scalar(node).split(".")[-1])
    )
    return yaml.load((TASKS_DIR / f"{name}.yaml").read_text(), Loader=Loader)


HUMANEVAL_DOCS = [
    {
        "task_id": "HumanEval/0",
        "prompt": 'def add(a: int, b: int) -> int:\n    """ Sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
        "entry_point": "add",
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    },
    {
        "task_id": "HumanEval/1",
        "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """ Sum of xs. """\n',
        "entry_point": "total",
        "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n",
    },
]
# Dream's fork, eval_instruct/lm_eval/tasks/humaneval/humaneval_instruct.yaml (version 2.0)
DREAM_HUMANEVAL_TEXT = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```{{prompt}}"
)
DREAM_HUMANEVAL_PREFIX = "Here is the completed function:\n```python\n{{prompt}}\n"


def render_field(template: str, doc: dict) -> str:
    """A task field as Dream's fork renders it (lm_eval.utils.apply_template: trailing newline kept)."""
    return jinja2.Environment(keep_trailing_newline=True).from_string(template).render(**doc)


@pytest.fixture(scope="module")
def llada_base_run(llada_tokenizer, gsm8k_like) -> Recorder:
    """llada-base-gsm8k's harness run: the plain 5-shot prompt, tokenizer(text)."""
    p = PROTOCOLS["llada-base-gsm8k"]
    return harness_prompts(llada_tokenizer, p, gsm8k_like, chat=p.chat)


def test_llada_base_prompt_ids(llada_tokenizer, llada_base_run):
    """LLaDA's eval_llada.py on the base model: tokenizer(plain prompt)."""
    run = llada_base_run
    assert run.ids == [llada_tokenizer(c)["input_ids"] for c in run.contexts]
    assert run.ids[0][0] == llada_tokenizer.bos_token_id and run.contexts[0].count("Question:") == 6


def test_fast_dllm_llada_prompt_ids(llada_tokenizer, gsm8k_like, llada_base_run):
    """eval_llada.py (is_instruct): the plain 5-shot prompt (the base run's: the same rendering) as
    one user turn of the chat template, then tokenizer(text) (whose BOS this stand-in adds on top of
    the template's own)."""
    p = PROTOCOLS["fastdllm-llada-gsm8k-dual-parallel"]
    assert p.shots == PROTOCOLS["llada-base-gsm8k"].shots and not PROTOCOLS["llada-base-gsm8k"].chat
    chat = harness_prompts(llada_tokenizer, p, gsm8k_like, chat=p.chat)
    upstream = []
    for context in llada_base_run.contexts:
        text = llada_tokenizer.apply_chat_template(
            [{"role": "user", "content": context}], add_generation_prompt=True, tokenize=False
        )
        upstream.append(llada_tokenizer(text)["input_ids"])
    assert chat.ids == upstream and len(upstream) == 2
    bos = llada_tokenizer.bos_token_id
    assert upstream[0][:2] == [bos, bos]  # the stand-in's BOS, then the template's


def test_fast_dllm_dream_prompt_ids(dream_tokenizer, gsm8k_like):
    """Fast-dLLM's dream/eval.py with add_bos_token: tokenizer(bos_token + plain prompt)."""
    p = PROTOCOLS["fastdllm-dream-gsm8k-baseline"]
    run = harness_prompts(dream_tokenizer, p, gsm8k_like, chat=p.chat)
    assert run.ids == [dream_tokenizer(dream_tokenizer.bos_token + c)["input_ids"] for c in run.contexts]
    assert run.ids[0][0] == dream_tokenizer.convert_tokens_to_ids("<|beginoftext|>")


def test_dream_instruct_prompt_ids(dream_tokenizer, tmp_path):
    """Dream's diffllm.py with its fork's humaneval_instruct: the prompt as the user turn, the
    assistant turn opened with the prefix (continue_final_message), then tokenizer(text)."""
    p = PROTOCOLS["dream-instruct-humaneval"]
    data = tmp_path / "humaneval.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in HUMANEVAL_DOCS))
    task = {**task_config(p.task), "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}
    run = harness_prompts(dream_tokenizer, p, task, chat=p.chat)
    upstream = []
    for doc in HUMANEVAL_DOCS:
        turns = [
            {"role": "user", "content": render_field(DREAM_HUMANEVAL_TEXT, doc)},
            {"role": "assistant", "content": render_field(DREAM_HUMANEVAL_PREFIX, doc)},
        ]
        text = dream_tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        upstream.append(dream_tokenizer(text)["input_ids"])
    assert run.ids == upstream
    assert run.contexts[0].endswith("Here is the completed function:\n```python\n" + HUMANEVAL_DOCS[0]["prompt"] + "\n")


def test_llada2_prompt_ids(llada2_tokenizer, gsm8k_like):
    """LLaDA2.0's card: apply_chat_template(..., tokenize=True), which adds no special tokens."""
    p = PROTOCOLS["llada2-mini-gsm8k"]
    run = harness_prompts(llada2_tokenizer, p, gsm8k_like, chat=p.chat)
    plain = harness_prompts(llada2_tokenizer, p, gsm8k_like, chat=False)
    upstream = []
    for context in plain.contexts:
        ids = llada2_tokenizer.apply_chat_template(
            [{"role": "user", "content": context}], add_generation_prompt=True, tokenize=True
        )
        upstream.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert run.ids == upstream and upstream[0][0] != llada2_tokenizer.bos_token_id


# ----------------------------------------------------------------------------- end to end


@pytest.fixture
def harness_in_process(monkeypatch):
    """``psd_jax.evaluate.main`` here, with the harness's built-in task index off and offline datasets."""
    original = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda *a, **k: original(*a, **{**k, "include_defaults": False}))
    for key, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(key, value)
    return cli.main


def test_a_protocol_runs_end_to_end_on_the_shipped_model(tmp_path, harness_in_process):
    """Fast-dLLM's "+Parallel" GSM8K protocol on the shipped model and its held-out task: the
    harness model decodes with the protocol's settings (the shipped model's lengths and float32 on
    top: it was trained for 48 tokens), prompts as upstream encodes them (one chat turn,
    tokenizer(text)), and logs exactly what the library decodes from those ids in one batch."""
    from psd_jax.evaluate.harness import CREATED
    from psd_jax.scoring import extract_answer, load_jsonl

    overrides = f"pretrained={DEFAULT_MODEL_DIR},dtype=float32,gen_length=48,block_length=16"
    code = harness_in_process(
        [
            "--protocol",
            "fastdllm-llada-gsm8k-parallel",
            "--tasks",
            "heldout",
            "--include_path",
            str(TEST_DATA / "tasks"),
        ]
        + ["--num_fewshot", "0", "--limit", "8", "--batch_size", "8", "--log_samples", "--output_path", str(tmp_path)]
        + ["--model_args", overrides]
    )
    assert code == 0
    model = CREATED[-1]
    protocol = PROTOCOLS["fastdllm-llada-gsm8k-parallel"]
    assert model.args.settings == DecodeConfig(**{**protocol.decode, "gen_length": 48, "block_length": 16})
    assert model.args.add_special_tokens and model.args.batch_size == 8 and model.args.dtype == "float32"
    (path,) = tmp_path.rglob("samples_heldout_*.jsonl")
    logged = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    logged = [s for s in logged if s["filter"] == "psd-scoring"]
    contexts = [s["arguments"]["gen_args_0"]["arg_0"] for s in logged]
    examples = load_jsonl(HELD_OUT)[:8]
    tokenizer = model.lm.tokenizer
    turns = [[{"role": "user", "content": ex["question"]}] for ex in examples]
    assert contexts == [tokenizer.apply_chat_template(t, add_generation_prompt=True, tokenize=False) for t in turns]
    ids = [model._encode(c) for c in contexts]
    assert ids == [model.lm.tokenizer(c)["input_ids"] for c in contexts]  # as eval_llada.py encodes
    texts = [g.text for g in model.lm.generate(ids, model.args.settings, seed=model.args.seed)]
    assert [s["resps"][0][0] for s in logged] == texts
    right = [int(extract_answer(t) == extract_answer(ex["answer"])) for t, ex in zip(texts, examples)]
    assert [int(s["exact_match"]) for s in logged] == right and sum(right) >= 4
