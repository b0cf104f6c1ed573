"""The text front ends on LLaDA2.0's block diffusion: the benchmark, the harness's ``generate_until``
and the OpenAI-style server give what ``generate`` gives, on llada2-tiny with a word-level tokenizer
and LLaDA2.0-mini's chat template (tests/helpers/llada2_text.py). The family's end of turn
``<|role_end|>`` ends an answer's text."""

from __future__ import annotations

import json

import pytest
from served import client, running

from psd_jax import load_model
from psd_jax.cli import bench
from psd_jax.model_dir import model_settings
from psd_jax.scoring import is_correct, load_jsonl
from psd_jax.serve import build_app

from llada2_text import with_tokenizer

LENGTHS = {"gen_length": 32, "block_length": 8}
SCHEDULE = {"policy": "threshold_schedule", "threshold": 0.7, "steps": 4, **LENGTHS}  # harness and server
BUCKET = 32  # the bench's default prompt bucket; every chat-templated test question pads to 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return with_tokenizer(tmp_path_factory.mktemp("llada2") / "llada2-text")


@pytest.fixture(scope="module")
def lm(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def questions(model_dir) -> list[str]:
    return [ex["question"] for ex in load_jsonl(model_dir / "test.jsonl")]


def test_tokenizer_gives_the_family_its_end_of_turn(lm, questions):
    """The chat template ends turns with ``<|role_end|>``: its id becomes a stop id beside EOS, and
    the answers (which the random model writes) hold text."""
    assert lm.config.stop_ids == (508, 510) and lm.config.mask_id == 511
    ids = lm.encode(questions[0], chat=True)
    assert lm.tokenizer.decode(ids).startswith("<role> SYSTEM </role> detailed thinking off <|role_end|>")
    results = lm.generate(questions, model_settings(lm.path, {"policy": "threshold_schedule", **LENGTHS}), chat=True)
    assert sum(r.tokens for r in results) > 4 * LENGTHS["gen_length"]
    for r in results:
        cut = r.output_ids[: r.tokens + 1]
        assert not set(r.output_ids[: r.tokens]) & {508, 510} and (r.tokens == 32 or cut[-1] in (508, 510))


def test_bench_counts_equal_generate(model_dir, lm, questions, tmp_path, monkeypatch):
    """``python -m psd_jax.bench --decoders schedule-0.95,psd-schedule-0.95-d3`` on the family:
    accuracy, NFE and tokens are those of ``generate`` on the same batches; PSD accepts drafts.
    (The command's load gives this module's model, whose compiled programs both then use.)"""
    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: lm)
    names = ["schedule-0.95", "psd-schedule-0.95-d3"]
    flags = ["--model", str(model_dir), "--batch", "3", "--gen-length", "32", "--block-length", "8"]
    assert bench.main([*flags, "--decoders", ",".join(names), "--out", str(tmp_path)]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    examples = load_jsonl(model_dir / "test.jsonl")
    matrix = bench.decoder_matrix(model_settings(model_dir, {"cache": "dual", **LENGTHS}), names)
    for name in names:
        results = [r for i in (0, 3) for r in lm.generate(questions[i : i + 3], matrix[f"{name}/dual"], chat=True)]
        row = rows[f"{name}/dual"]
        assert row["n"] == 6 and row["tokens"] == sum(r.tokens for r in results)
        assert row["nfe_per_prompt"] == sum(r.nfe for r in results) / 6
        assert row["correct_by_problem"] == "".join(str(int(is_correct(r.text, e))) for r, e in zip(results, examples))
    assert rows["psd-schedule-0.95-d3/dual"]["nfe_per_prompt"] < rows["schedule-0.95/dual"]["nfe_per_prompt"]
    assert sum(rows["psd-schedule-0.95-d3/dual"]["accepted_depth"][1:]) > 0


def test_harness_generate_until_equals_generate(model_dir, lm, questions):
    """lm-evaluation-harness requests through the psd_jax model: the chat template hook gives the
    library's prompt, a batch of three decodes as ``generate`` does, ``until`` cuts the text."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from psd_jax.evaluate.harness import PsdJaxLM

    fields = {**SCHEDULE, "cache": "prefix"}
    model = PsdJaxLM(pretrained=str(model_dir), batch_size=3, **fields)
    prompts = [model.apply_chat_template([{"role": "user", "content": q}]) for q in questions[:3]]
    assert [model._encode(p) for p in prompts] == [lm.encode(q, chat=True) for q in questions[:3]]
    want = [r.text for r in lm.generate(questions[:3], model_settings(model_dir, fields), chat=True)]
    assert all(want)
    requests = [Instance("generate_until", {}, (p, {"until": []}), 0, ("t", 0, 1)) for p in prompts]
    assert model.generate_until(requests) == want
    stop = want[1].split()[1]
    cut = model.generate_until([Instance("generate_until", {}, (prompts[1], {"until": [stop]}), 0, ("t", 0, 1))])
    assert cut == [want[1][: want[1].find(stop)]]


def test_server_answers_and_streams_one_chunk_per_block(lm, questions):
    """``/v1/completions`` and ``/v1/chat/completions`` on the family give ``generate``'s text and
    counts; a stream sends one chunk per decoded block and joins to the answer."""
    defaults = model_settings(lm.path, SCHEDULE)
    app = build_app(lm, defaults, name="llada2", batch_sizes=(1,), max_wait_ms=10, prompt_bucket=BUCKET)
    with running(app) as url:
        api = client(url)
        for question in questions[:3]:  # EOS in the first, none in the second, in the third piece
            (want,) = lm.generate([question], defaults, prompt_bucket=BUCKET)
            got = api.completions.create(model="llada2", prompt=question)
            assert got.choices[0].text == want.text and want.text
            assert got.choices[0].token_ids == want.output_ids[: want.tokens]
            assert got.usage.completion_tokens == want.tokens and got.usage.model_calls == want.nfe
            messages = [{"role": "user", "content": question}]
            assert (
                api.chat.completions.create(model="llada2", messages=messages).choices[0].message.content == want.text
            )
            chunks = [c.choices[0].text for c in api.completions.create(model="llada2", prompt=question, stream=True)]
            assert "".join(chunks) == want.text
            # one chunk per gen_length piece of block_length ids, up to the one holding the first EOS
            eos = want.output_ids.index(508) if 508 in want.output_ids else None
            assert len(chunks) == (4 if eos is None else eos // 8 + 1), (len(chunks), want.output_ids)
