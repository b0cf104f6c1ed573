"""Answer scoring (``psd_jax.scoring``) and the default model's own tools (``scripts.default_model``):
its problem generator, training recipe, and the shipped tokenizer and held-out set."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from paths import HELPERS, ROOT

from psd_jax import InputError
from psd_jax.scoring import extract_answer, gold_answer, is_correct, load_jsonl, normalize_number
from psd_jax.tokenizer import encode_prompt
from scripts.default_model import train as train_default
from scripts.default_model.tasks import MAX_VALUE, TEMPLATES, generate_problem, make_dataset, parse_steps

DEFAULT = ROOT / "models" / "default"

GSM8K_LINE = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


# ----------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        (GSM8K_LINE["answer"], "72"),
        ("She pays 1,000+234 = <<1000+234=1234>>1,234 dollars.\n#### 1,234", "1234"),
        ("#### 1,234.", "1234"),
        ("#### 72.", "72"),
        ("####72", "72"),
        ("#### $18", "18"),
        ("#### -5", "-5"),
        ("#### 2.50", "2.5"),
        ("#### 3\n#### 4", "4"),  # the last ####
        ("6 * 12 = 72\n72 - 9 = 63\n63 / 7 = 9\n#### 9", "9"),
        ("12 + 7 = 19\n19 * 3 = 57\n#### 57<|endoftext|>", "57"),
        ("so the answer is 42.", "42"),  # fallback: last number
        ("3 + 4 = 7 and then 7 * 2 = 14", "14"),
        ("it costs 1,200 dollars", "1200"),
        ("no numbers here", None),
        ("", None),
        ("12 + 7 = 19\n####", None),  # #### but no number after it
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_normalize_number():
    assert normalize_number(" 1,234 ") == "1234"
    assert normalize_number("72.0") == "72"
    assert normalize_number("$5.") == "5"
    assert normalize_number("abc") is None


def test_gold_and_is_correct():
    assert gold_answer(GSM8K_LINE) == "72"
    assert is_correct("... #### 72", GSM8K_LINE)
    assert is_correct("the answer is 72.0", GSM8K_LINE)
    assert not is_correct("#### 73", GSM8K_LINE)
    assert not is_correct("nothing", GSM8K_LINE)


def test_load_jsonl_gsm8k_format(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps(GSM8K_LINE) + "\n\n" + json.dumps({"question": "q", "answer": "#### 1,500"}) + "\n")
    examples = load_jsonl(path)
    assert [gold_answer(ex) for ex in examples] == ["72", "1500"]
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(InputError, match=r"gsm8k.jsonl:1: expected 'question' and 'answer' fields"):
        load_jsonl(path)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question": "q", "answer": "none"}', r":3: no number in the answer 'none' to score against"),
        ('{"question": "q", "answer": 5', r":3: not a JSON object \(Expecting ',' delimiter\)"),
        ('["q", "1"]', r":3: expected 'question' and 'answer' fields"),
        ('{"question": 7, "answer": "#### 1"}', r":3: 'question' must be non-empty text"),
    ],
)
def test_load_jsonl_checks_every_line_and_names_it(tmp_path, bad_line, message):
    """A bad line is refused when the file is read, naming file and line, not when a run reaches it."""
    path = tmp_path / "data.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path.write_text(f"{good}\n{good}\n{bad_line}\n{good}\n")
    with pytest.raises(InputError, match="data.jsonl" + message):
        load_jsonl(path)


# ----------------------------------------------------------------- generator


def test_make_dataset_deterministic():
    a, b = make_dataset(300, seed=7), make_dataset(300, seed=7)
    assert a == b
    assert a != make_dataset(300, seed=8)
    assert generate_problem(random.Random(3)) == generate_problem(random.Random(3))


def test_make_dataset_exclude_and_unique():
    base = make_dataset(200, seed=1)
    held_out = {ex["question"] for ex in base[:100]}
    train = make_dataset(200, seed=1, exclude=held_out)
    assert len(train) == 200 and not held_out & {ex["question"] for ex in train}
    unique = make_dataset(300, seed=2, unique=True)
    assert len({ex["question"] for ex in unique}) == 300


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def test_generated_arithmetic_is_correct():
    examples = make_dataset(2000, seed=0)
    n_steps = set()
    for ex in examples:
        lines = ex["answer"].splitlines()
        steps = parse_steps(ex["answer"])
        assert len(steps) == len(lines) - 1 and lines[-1].startswith("#### ")
        n_steps.add(len(steps))
        results = []
        for i, (a, op, b, c) in enumerate(steps):
            assert _OPS[op](a, b) == c, ex
            assert 1 <= c <= 999, ex
            if i:  # every step after the first uses an earlier result
                assert a in results or b in results, ex
            results.append(c)
        assert gold_answer(ex) == str(results[-1])
        assert len(ex["question"].split()) <= 50, ex["question"]
        assert all(1 <= c <= MAX_VALUE for c in results), ex
        assert all(int(n) <= MAX_VALUE for n in re.findall(r"\d+", ex["question"])), ex
    assert n_steps == {2, 3, 4}


def test_training_drills_work_out_the_expressions_they_list(tok):
    """The calculator drills mixed into the default model's training: the question lists the
    answer's expressions in order, and every line is right and within the task's range; the
    labelled form adds each line's label word, the unlisted form drops the question's list."""
    drills = train_default.make_drills(300, seed=3)
    assert drills == train_default.make_drills(300, seed=3)
    ops = set()
    for drill in drills:
        lines = drill["answer"].splitlines()
        steps = parse_steps(drill["answer"])
        assert len(steps) == len(lines) == 4
        assert all(_OPS[op](a, b) == c and 1 <= c <= MAX_VALUE for a, op, b, c in steps), drill
        expressions = [line.split(" = ")[0] for line in lines]
        assert drill["question"] == f"Work out {', '.join(expressions[:3])} and {expressions[3]}."
        ops |= {op for _, op, _, _ in steps}
    assert ops == set("+-*/")
    labelled = train_default.make_drills(300, seed=3, labelled=True)
    for drill, plain in zip(labelled, drills):  # same lines, each with its problem's label word
        assert drill["question"] == plain["question"]
        pairs = list(zip(drill["answer"].splitlines(), plain["answer"].splitlines()))
        assert all(line.split(" ", 1)[1] == bare and line.split(" ", 1)[0].isalpha() for line, bare in pairs), drill
    fits = [
        d
        for d in labelled
        if len(tok(d["answer"], add_special_tokens=False)["input_ids"]) < train_default.LABELLED_DRILL_GEN_LENGTH
    ]
    assert len(fits) == len(labelled)
    unlisted = train_default.make_drills(300, seed=3, listed=False)  # same lines, a question without them
    assert [d["answer"] for d in unlisted] == [d["answer"] for d in drills]
    assert {d["question"] for d in unlisted} == {"Work out 4 calculator lines."}


def test_chain_drills_work_out_a_chain_the_question_does_not_spell_out(tok):
    """Chained drills: the question gives the start value and each line's operation and second
    operand; each line's first operand is the previous line's result (never in the question's
    list), every line is right and within the task's range, and the answer fits its rows."""
    drills = train_default.make_chain_drills(300, seed=5)
    assert drills == train_default.make_chain_drills(300, seed=5)
    ops = set()
    for drill in drills:
        steps = parse_steps(drill["answer"])
        assert len(steps) == len(drill["answer"].splitlines()) == 4
        assert all(_OPS[op](a, b) == c and 1 <= c <= MAX_VALUE for a, op, b, c in steps), drill
        assert all(steps[k + 1][0] == steps[k][3] for k in range(3)), drill
        listed = ", ".join(f"{op} {b}" for _, op, b, _ in steps[:3]) + f" and {steps[3][1]} {steps[3][2]}"
        assert drill["question"] == f"Start with {steps[0][0]}, then {listed}."
        ops |= {op for _, op, _, _ in steps}
        assert len(tok(drill["answer"], add_special_tokens=False)["input_ids"]) < train_default.CHAIN_DRILL_GEN_LENGTH
    assert ops == set("+-*/")


def test_every_line_names_a_word_of_its_question():
    """Each calculator line starts with a word of the question (what the model matches on to find
    the line's number), and no word labels two lines of one answer."""
    for ex in make_dataset(2000, seed=1):
        labels = [line.split()[0] for line in ex["answer"].splitlines()[:-1]]
        words = set(re.findall(r"[a-z]+", ex["question"].lower()))
        assert all(label.isalpha() and label in words for label in labels), ex
        assert len(set(labels)) == len(labels), ex


def test_parse_steps_reads_labelled_and_bare_lines():
    assert parse_steps("hens 4 * 6 = 24\n24 - 3 = 21\n#### 21") == [(4, "*", 6, 24), (24, "-", 3, 21)]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_template_and_step_count(name):
    assert len(TEMPLATES) >= 12
    rng = random.Random(name)
    for k in (2, 3, 4):
        for _ in range(20):
            ex = generate_problem(rng, template=name, steps=k)
            steps = parse_steps(ex["answer"])
            assert len(steps) == k
            assert all(_OPS[op](a, b) == c for a, op, b, c in steps)
            assert gold_answer(ex) == str(steps[-1][3])
        easy = generate_problem(rng, template=name, steps=k, max_value=100)
        assert max(c for *_, c in parse_steps(easy["answer"])) <= 100


# ----------------------------------------------------------------- shipped files


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT))


def test_tokenizer_round_trip(tok):
    for ex in make_dataset(200, seed=99):
        for text in (ex["question"], ex["answer"], ex["question"] + "\n\n" + ex["answer"]):
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_special_tokens(tok):
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id is not None
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id == tok.eos_token_id
    assert tok.bos_token == "<|startoftext|>"
    for t in ["<|mask|>", "<|endoftext|>", "<|startoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]:
        assert tok.convert_tokens_to_ids(t) is not None
        assert tok.encode(t, add_special_tokens=False) == [tok.convert_tokens_to_ids(t)]
    assert len(tok) % 64 == 0 and len(tok) <= 1024


def test_tokenizer_digits_are_single_tokens(tok):
    for d in "0123456789":
        assert len(tok.encode(d, add_special_tokens=False)) == 1
    ids = tok.encode("1234 + 56 = 1290", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if p.isdigit()] == list("1234561290")
    for token in tok.get_vocab():
        assert sum(ch.isdigit() for ch in token) <= 1 or token.startswith("<|"), token


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_shipped_test_set():
    examples = load_jsonl(DEFAULT / "test.jsonl")
    assert len(examples) == 500
    assert len({ex["question"] for ex in examples}) == 500
    for ex in examples:
        assert gold_answer(ex) == str(parse_steps(ex["answer"])[-1][3])


def test_training_rows_end_with_the_answer_padded_to_the_response_length(tok):
    """``encode_batch`` (default model training): the last ``gen_length`` tokens of every row are
    the answer and EOS padding, left of them the chat-templated prompt; a drill batch uses the
    shorter drill response length, which fits all but rare drills (skipped, not truncated)."""
    drills = train_default.make_drills(200, seed=5)
    gen = train_default.DRILL_GEN_LENGTH
    ids, attn = train_default.encode_batch(tok, drills, tok.eos_token_id, tok.pad_token_id, gen)
    fits = [d for d in drills if len(tok(d["answer"], add_special_tokens=False)["input_ids"]) < gen]
    assert len(fits) >= 198 and ids.shape[0] == len(fits) and ids.shape[1] % 16 == 0
    for row, drill in zip(ids, fits):
        answer = tok(drill["answer"], add_special_tokens=False)["input_ids"]
        assert list(row[-gen:]) == answer + [tok.eos_token_id] * (gen - len(answer))
        assert tok.decode(row[:-gen]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert list(attn.sum(1)) == [len(encode_prompt(tok, d["question"], chat=True, source="test")) + gen for d in fits]


def test_block_masking_matches_the_decoding_order():
    """``mask_probabilities`` (default model training): in block form a row's earlier blocks are
    clean, its own block masked at ratio t, later blocks fully masked, as the block decoder sees
    the canvas; the iid form masks every response token at ratio t (LLaDA's SFT)."""
    import jax.numpy as jnp

    t = jnp.array([[0.25], [0.5], [0.75]])
    block = jnp.array([[0], [1], [2]])
    p = train_default.mask_probabilities(t, 12, 4, block)
    assert p.tolist() == [
        [0.25] * 4 + [1.0] * 8,
        [0.0] * 4 + [0.5] * 4 + [1.0] * 4,
        [0.0] * 8 + [0.75] * 4,
    ]
    assert train_default.mask_probabilities(t, 12, None, block).tolist() == [[0.25] * 12, [0.5] * 12, [0.75] * 12]
    with pytest.raises(ValueError, match="block_length 5 does not divide gen_length 12"):
        train_default.make_train_step(None, None, mask_id=0, gen_length=12, block_length=5)


def test_training_loss_weights_masked_tokens_by_inverse_t_or_averages_each_row():
    """``masked_loss``: LLaDA's SFT loss weights every masked token by 1/t and divides by the
    scored positions and rows; ``row_mean`` averages each row's masked tokens instead (a row with
    none masked counts 0). Hand-computed on two rows of four positions."""
    import jax.numpy as jnp

    ce = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    masked = jnp.array([[True, False, True, False], [False, False, False, True]])
    t = jnp.array([[0.5], [0.25]])
    inverse_t = train_default.masked_loss(ce, masked, t, 4, row_mean=False)
    assert float(inverse_t) == pytest.approx(((1 + 3) / 0.5 + 8 / 0.25) / (2 * 4))
    row_mean = train_default.masked_loss(ce, masked, t, 4, row_mean=True)
    assert float(row_mean) == pytest.approx(((1 + 3) / 2 + 8 / 1) / 2)
    none_masked = masked.at[1].set(False)
    assert float(train_default.masked_loss(ce, none_masked, t, 4, row_mean=True)) == pytest.approx((1 + 3) / 2 / 2)


def test_data_parallel_training_step_matches_one_device():
    """``scripts.default_model.train --data-parallel`` (batch rows split over 4 simulated CPU devices) takes
    the same optimiser steps as one device: equal losses and parameters after three AdamW steps to
    float32 reduction-order tolerance (1e-5); a batch one row short of dividing by the devices
    (a skipped drill) is trimmed, not an error."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )  # scripts.*
    script = HELPERS / "data_parallel_train.py"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    assert out["batch_sharding"] == {"spec": ["data"], "devices": 4, "rows": 8, "uneven_rows": 4}
    np.testing.assert_allclose(out["sharded"], out["single"], rtol=1e-5)
    assert out["max_param_diff"] < 1e-5
