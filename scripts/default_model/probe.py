"""Where a trained default model fails: arithmetic, copying, or decoding.

Two probes on the first N held-out problems of a model directory:

* teacher-forced: the gold answer is on the canvas, masked from each position on (left to right)
  or in all its digits at once; the model's argmax is scored by token kind (each line's result,
  first operand, second operand, any digit, everything). A high ``result`` score with a low
  ``operand2`` score means the model can calculate but cannot find the question's numbers.
  (Masking only one kind leaks: every line's three numbers determine each other and each result
  reappears in the next line.)
* generation at one token per step: exact answers, well-formed calculator lines, lines whose
  operands equal the gold line's, lines that are arithmetically right.

    python -m scripts.default_model.probe [--model models/default] [--n 100]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from psd_jax import DecodeConfig, load_model
from psd_jax.model_dir import model_settings
from psd_jax.scoring import is_correct, load_jsonl
from psd_jax.tokenizer import encode_prompt
from scripts.default_model.tasks import STEP_LINE as LINE
from scripts.default_model.tasks import calculate

GROUPS = {"operand1": 1, "operand2": 3, "result": 4}  # LINE's group of each probed number
KINDS = ("operand1", "operand2", "result", "all_digits", "all")


def masked_positions(answer: str, offsets: list[tuple[int, int]], kind: str) -> np.ndarray:
    """Which answer tokens the probe ``kind`` masks (by character spans of the answer text)."""
    spans, pos = [], 0
    for line in answer.splitlines(keepends=True):
        m = LINE.match(line.rstrip("\n"))
        if m and kind in GROUPS:
            spans.append((pos + m.start(GROUPS[kind]), pos + m.end(GROUPS[kind])))
        pos += len(line)
    if kind == "all":
        return np.ones(len(offsets), bool)
    if kind == "all_digits":
        return np.array([answer[s:e].isdigit() for s, e in offsets])
    return np.array([any(s >= a and e <= b for a, b in spans) for s, e in offsets])


def _canvas(lm, examples: list[dict], gen_length: int):
    """Left-padded prompt + gold answer ids, attention mask, gold answer ids and offsets."""
    tok, cfg = lm.tokenizer, lm.config
    prompts = [encode_prompt(tok, ex["question"], chat=True, source="probe") for ex in examples]
    answers = [tok(ex["answer"], add_special_tokens=False, return_offsets_mapping=True) for ex in examples]
    width = max(map(len, prompts)) + gen_length
    ids = np.full((len(examples), width), cfg.pad_id, np.int32)
    attn = np.zeros_like(ids)
    gold = np.full((len(examples), gen_length), cfg.eos_id, np.int32)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        gold[row, : len(answer["input_ids"])] = answer["input_ids"]
        ids[row, width - gen_length - len(prompt) :] = prompt + gold[row].tolist()
        attn[row, width - gen_length - len(prompt) :] = 1
    return ids, attn, gold, answers


def _kinds(examples, answers, gen_length: int) -> dict[str, np.ndarray]:
    """[B, gen_length] masks of each probed token kind."""
    out = {}
    for kind in KINDS:
        mask = np.zeros((len(examples), gen_length), bool)
        for row, (ex, answer) in enumerate(zip(examples, answers)):
            n = len(answer["input_ids"])
            mask[row, :n] = masked_positions(ex["answer"], answer["offset_mapping"], kind)
            mask[row, n:] = kind == "all"
        out[kind] = mask
    return out


def teacher_forced(lm, examples: list[dict], gen_length: int) -> dict[str, dict[str, float]]:
    """Token accuracy by kind under two canvases:

    * ``left_to_right``: every answer token from the probed position on is masked (what an
      autoregressive order would see; no leak from later lines, which repeat each result);
    * ``numbers_masked``: the answer's skeleton is given and every digit is masked at once.
    """
    cfg = lm.config
    ids, attn, gold, answers = _canvas(lm, examples, gen_length)
    kinds = _kinds(examples, answers, gen_length)
    logits = lambda canvas: np.asarray(lm.model(jnp.asarray(canvas), jnp.asarray(attn)))[:, -gen_length:]
    left_to_right = np.zeros_like(gold, bool)
    for j in range(gen_length):
        noisy = ids.copy()
        noisy[:, ids.shape[1] - gen_length + j :] = cfg.mask_id
        left_to_right[:, j] = logits(noisy)[:, j].argmax(-1) == gold[:, j]
    noisy = ids.copy()
    noisy[:, -gen_length:][kinds["all_digits"]] = cfg.mask_id
    numbers_masked = logits(noisy).argmax(-1) == gold
    return {
        "left_to_right": {k: float(left_to_right[m].mean()) for k, m in kinds.items()},
        "numbers_masked": {k: float(numbers_masked[m].mean()) for k, m in kinds.items() if k != "all"},
    }


def generation(lm, examples: list[dict], gen_length: int, block_length: int) -> dict[str, int]:
    """Free generation at one token per step: exact answers, well-formed lines, lines with the gold
    operands, arithmetically right lines (also by operator, ``lines+``/``right+``, ...); and the gold
    lines reached with every earlier line right, split by number size (``reached_small`` /
    ``right_small``: every number of the line below 10; ``reached_large`` / ``right_large``: some
    number of two digits)."""
    settings = DecodeConfig(gen_length=gen_length, block_length=block_length, steps=gen_length)
    out = lm.generate([ex["question"] for ex in examples], settings, chat=True, prompt_bucket=32)
    counts = dict.fromkeys(
        [
            "problems",
            "correct",
            "gold_operands",
            "reached_small",
            "right_small",
            "reached_large",
            "right_large",
            *(f"{kind}{op}" for kind in ("lines", "right") for op in "+-*/"),
        ],
        0,
    )
    counts["problems"] = len(examples)
    for ex, row in zip(examples, out):
        counts["correct"] += is_correct(row.text, ex)
        gold = [LINE.match(line) for line in ex["answer"].splitlines()[:-1]]
        lines = [LINE.match(line.strip()) for line in row.text.splitlines()]
        for i, m in enumerate(lines):
            if not m:
                continue
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            counts[f"lines{op}"] += 1
            counts[f"right{op}"] += calculate(a, op, b) == c
            counts["gold_operands"] += i < len(gold) and (gold[i][1], gold[i][2], gold[i][3]) == (m[1], m[2], m[3])
        for i, g in enumerate(gold):
            size = "large" if max(int(g[1]), int(g[3]), int(g[4])) >= 10 else "small"
            right = i < len(lines) and lines[i] is not None and lines[i].groups()[1:] == g.groups()[1:]
            counts[f"reached_{size}"] += 1
            counts[f"right_{size}"] += right
            if not right:
                break
    counts["lines"] = sum(counts[f"lines{op}"] for op in "+-*/")
    counts["arithmetic_right"] = sum(counts[f"right{op}"] for op in "+-*/")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/default")
    parser.add_argument("--n", type=int, default=100)
    args = parser.parse_args()
    lm = load_model(args.model)
    examples = load_jsonl(Path(args.model) / "test.jsonl")[: args.n]
    lengths = model_settings(args.model)  # the directory's decode_defaults.json
    gen_length, block_length = lengths.gen_length, lengths.block_length
    for probe, scores in teacher_forced(lm, examples, gen_length).items():
        print(f"teacher-forced, {probe}: " + ", ".join(f"{k} {v:.1%}" for k, v in scores.items()))
    g = generation(lm, examples, gen_length, block_length)
    print(
        f"one token per step: {g['correct']}/{g['problems']} correct; {g['lines']} calculator lines, "
        f"{g['gold_operands']} with the gold operands, {g['arithmetic_right']} arithmetically right; "
        f"gold lines reached with every earlier line right: {g['right_small']}/{g['reached_small']} right with "
        f"one-digit numbers only, {g['right_large']}/{g['reached_large']} with a two-digit number; arithmetically "
        "right by operator: " + ", ".join(f"{op} {g['right' + op]}/{g['lines' + op]}" for op in "+-*/")
    )


if __name__ == "__main__":
    main()
