"""Answer extraction and scoring for GSM8K-style problems.

A reference answer ends with a final line ``#### <number>`` (GSM8K's convention, which the
default model's synthetic task follows too); a model's output is scored by the number after its
last ``####`` (or, without one, its last number), compared numerically with the reference's.
``psd_jax.cli.bench`` scores its decoders with these functions; ``load_jsonl`` reads the held-out set
(``models/default/test.jsonl``) or GSM8K's own files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .core.errors import InputError

__all__ = ["extract_answer", "gold_answer", "is_correct", "load_jsonl", "normalize_number"]

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")


def normalize_number(text: str) -> str | None:
    """Canonical string for a number: strip ``$``, commas, spaces and a trailing
    period; ``"1,234"`` -> ``"1234"``, ``"72.0"`` -> ``"72"``, ``"3.50"`` -> ``"3.5"``.
    Returns None if ``text`` is not a number."""
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None
    if value == int(value):
        return str(int(value))
    return repr(value).rstrip("0").rstrip(".")


def extract_answer(text: str) -> str | None:
    """GSM8K-style answer: the number right after the last ``####``.

    Without ``####`` it falls back to the last number in ``text``. Returns the
    normalized number, or None when there is none (including a ``####`` with no
    number after it)."""
    if "####" in text:
        match = _NUMBER.search(text.rsplit("####", 1)[1])
        return normalize_number(match.group()) if match else None
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def gold_answer(example: dict) -> str:
    """The reference answer of a ``{"question", "answer"}`` example."""
    answer = extract_answer(str(example["answer"]))
    if answer is None:
        raise ValueError(f"no number in answer field: {example['answer']!r}")
    return answer


def is_correct(prediction_text: str, example: dict) -> bool:
    """True if the answer extracted from ``prediction_text`` equals the gold answer."""
    predicted = extract_answer(prediction_text)
    return predicted is not None and float(predicted) == float(gold_answer(example))


def load_jsonl(path: str | Path) -> list[dict]:
    """Read a jsonl file of objects with ``question`` and ``answer`` fields
    (our format or GSM8K's own ``train.jsonl``/``test.jsonl``).

    Every line is checked here, before any decoding: JSON, a text question, and an answer with a
    number to score against; ``InputError`` names the file and line of the first bad one (a run
    must not fail on line 400 after an hour of decoding)."""
    examples = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
        if not isinstance(obj, dict) or "question" not in obj or "answer" not in obj:
            raise InputError(f"{path}:{lineno}: expected 'question' and 'answer' fields")
        if not isinstance(obj["question"], str) or not obj["question"].strip():
            raise InputError(f"{path}:{lineno}: 'question' must be non-empty text")
        if extract_answer(str(obj["answer"])) is None:
            raise InputError(f"{path}:{lineno}: no number in the answer {obj['answer']!r} to score against")
        examples.append(obj)
    return examples
