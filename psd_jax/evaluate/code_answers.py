"""Code answers scored as the upstream evaluations score them: the whole answer kept, the code taken
out of it afterwards.

Fast-dLLM's ``postprocess_code.py`` (LLaDA and Dream, over the logged HumanEval samples) and Dream's
``humaneval_instruct`` filter (``build_predictions_instruct``) make the same program of an answer:
the text after the first ```` ```python\\n ```` fence (the whole answer when there is none) up to the
next ```` ``` ````, appended to the problem's prompt after a newline, then *sanitized*:

1. tabs become four spaces, line ends ``\\n``, the text is stripped and ends in one newline;
2. of its first 100 lines, the longest run of consecutive lines that parses as Python (most
   non-blank lines; the first such run on a tie) is kept;
3. of that, the imports and the top-level definitions are kept: classes, functions that contain a
   ``return``, and assignments to a name (a later definition of a name replaces an earlier one in
   its place); with an entry point, only the definitions it reaches, following the names and
   attribute names each definition mentions;
4. each kept statement is printed back with ``ast.unparse``, imports first, one per line.

The harness tasks in ``psd_jax/evaluate/tasks`` call these functions (``tasks/utils.py``); the
pass@1 metrics run the tests with Hugging Face ``evaluate``'s ``code_eval``, as upstream does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

FENCE = "```"
PYTHON_FENCE = "```python\n"
MAX_LINES = 100


def fenced_python(answer: str) -> str:
    """The code of an answer: after the first ```` ```python ```` fence (else from the start) up to
    the next fence (else to the end)."""
    return answer.split(PYTHON_FENCE, 1)[-1].split(FENCE)[0]


def humaneval_program(prompt: str, answer: str, entry_point: str) -> str:
    """The program a HumanEval answer is tested as (Fast-dLLM's post-processing, Dream's
    ``humaneval_instruct`` filter): the prompt, a newline, the answer's code, sanitized."""
    return sanitize(prompt + "\n" + fenced_python(answer), entry_point)


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, MemoryError, ValueError):  # ValueError: a null byte in the source
        return False
    return True


def longest_parsing_run(text: str) -> str:
    """The run of consecutive lines (of the first ``MAX_LINES``) that parses and has the most
    non-blank lines; the earliest such run on a tie, "" if none has any."""
    lines = text.splitlines()[:MAX_LINES]
    best, best_count = "", 0
    for start in range(len(lines)):
        for end in range(start, len(lines)):
            code = "\n".join(lines[start : end + 1])
            if not _parses(code):
                continue
            count = sum(1 for line in lines[start : end + 1] if line.strip())
            if count > best_count:
                best, best_count = code, count
    return best


def _name_of(node: ast.stmt) -> str | None:
    """The name a top-level statement defines, if it is a definition the sanitizer keeps."""
    if isinstance(node, ast.ClassDef):
        return node.name
    if isinstance(node, ast.FunctionDef):
        return node.name if any(isinstance(n, ast.Return) for n in ast.walk(node)) else None
    if isinstance(node, ast.Assign) and node.targets and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def mentioned_names(node: ast.AST) -> set[str]:
    """Names and attribute names under ``node``; an attribute's object is not looked into
    (``math.sqrt`` mentions ``sqrt``)."""
    found: set[str] = set()
    pending = [node]
    while pending:
        for child in ast.iter_child_nodes(pending.pop()):
            if isinstance(child, ast.Name):
                found.add(child.id)
            elif isinstance(child, ast.Attribute):
                found.add(child.attr)
            else:
                pending.append(child)
    return found


def reachable(entry_point: str, uses: dict[str, set[str]]) -> set[str]:
    """The names reachable from ``entry_point`` through ``uses`` (the entry point included)."""
    seen: set[str] = set()
    queue = [entry_point]
    while queue:
        name = queue.pop(0)
        if name not in seen:
            seen.add(name)
            queue.extend(uses.get(name, set()) - seen)
    return seen


def sanitize(text: str, entry_point: str | None = None) -> str:
    """The sanitized program of ``text`` (the module docstring's steps 1-4)."""
    text = text.replace("\t", "    ").replace("\r\n", "\n").replace("\r", "\n").strip() + "\n"
    tree = ast.parse(longest_parsing_run(text))
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    definitions: dict[str, ast.stmt] = {}
    for node in tree.body:
        name = _name_of(node)
        if name is not None:
            definitions[name] = node  # a redefinition keeps the first one's place, as a dict does
    if entry_point:
        wanted = reachable(entry_point, {name: mentioned_names(node) for name, node in definitions.items()})
        definitions = {name: node for name, node in definitions.items() if name in wanted}
    return "\n".join(ast.unparse(node) for node in [*imports, *definitions.values()])


# ------------------------------------------------------------------------------ harness side


def humaneval_programs(resps: Iterable[list[str]], docs: Iterable[dict]) -> list[list[str]]:
    """Harness filter: every answer of every HumanEval document as the program it is tested as."""
    return [
        [humaneval_program(doc["prompt"], r, doc["entry_point"]) for r in answers] for answers, doc in zip(resps, docs)
    ]


def fenced_programs(resps: Iterable[list[str]], docs: Iterable[dict]) -> list[list[str]]:
    """Harness filter: every answer's fenced code (MBPP under a chat template)."""
    return [[fenced_python(r) for r in answers] for answers in resps]


_CODE_EVAL = None


def _code_eval():
    """Hugging Face ``evaluate``'s ``code_eval`` (loaded at the first score: it runs generated code,
    which needs ``HF_ALLOW_CODE_EVAL=1`` and the harness's ``--confirm_run_unsafe_code``)."""
    global _CODE_EVAL
    if _CODE_EVAL is None:
        import evaluate

        _CODE_EVAL = evaluate.load("code_eval")
    return _CODE_EVAL


def pass_at_k(references: list[str], predictions: list[list[str]], k: list[int] | int | None = None) -> dict:
    """HumanEval's metric (the harness's ``pass_at_k``): {"pass@k": ...} of the programs against the tests."""
    ks = [k] if isinstance(k, int) else list(k or [1])
    return _code_eval().compute(references=references, predictions=predictions, k=ks)[0]


def pass_at_1(references: str | list[str], predictions: str | list[str] | list[list[str]]) -> float:
    """MBPP's metric (the harness's ``pass_at_1``): the share of programs that pass their tests."""
    references = [references] if isinstance(references, str) else list(references)
    if isinstance(predictions, str):
        predictions = [[predictions]]
    elif predictions and isinstance(predictions[0], str):
        predictions = [[p] for p in predictions]
    return _code_eval().compute(references=references, predictions=predictions, k=[1])[0]["pass@1"]
