"""Code answers as upstream scores them (psd_jax.evaluate.code_answers): the fenced code of a whole
answer, appended to the prompt and sanitized, on answers shaped as chat and base models write them."""

from __future__ import annotations

import textwrap

import pytest

from psd_jax.evaluate.code_answers import (
    fenced_programs,
    fenced_python,
    humaneval_program,
    humaneval_programs,
    sanitize,
)

PROMPT = textwrap.dedent('''\
    from typing import List


    def below_zero(operations: List[int]) -> bool:
        """ Return True if the balance ever falls below zero.
        >>> below_zero([1, 2, -4, 5])
        True
        """
    ''')


def chat_answer(code: str) -> str:
    return f"Here is the solution:\n\n```python\n{code}\n```\n\nThe loop keeps a running balance.<|eot_id|>"


def test_a_fenced_chat_answer_replaces_the_prompts_stub():
    """LLaDA-Instruct's answer: prose, the whole function in a fence, more prose. The prompt's stub
    (no return) is dropped, the fenced function kept, the prose and the end-of-turn text gone."""
    code = "from typing import List\n\ndef below_zero(operations: List[int]) -> bool:\n" + textwrap.indent(
        "balance = 0\nfor op in operations:\n    balance += op\n    if balance < 0:\n        return True\nreturn False",
        "    ",
    )
    program = humaneval_program(PROMPT, chat_answer(code), "below_zero")
    assert program == (
        "from typing import List\nfrom typing import List\n"
        "def below_zero(operations: List[int]) -> bool:\n    balance = 0\n    for op in operations:\n"
        "        balance += op\n        if balance < 0:\n            return True\n    return False"
    )
    namespace: dict = {}
    exec(program, namespace)
    assert namespace["below_zero"]([1, 2, -4, 5]) is True and namespace["below_zero"]([1, 2]) is False


def test_a_base_models_continuation_keeps_the_prompt_and_drops_what_follows():
    """Dream-Base with escape_until: the body continues the prompt, then the model writes a test call
    and a new function nobody calls. The body joins the prompt's function; the rest is dropped."""
    body = (
        "    balance = 0\n    for op in operations:\n        balance += op\n        if balance < 0:\n"
        "            return True\n    return False\n\n\nprint(below_zero([1, -2]))\n\ndef unused():\n    return 1\n"
    )
    program = humaneval_program(PROMPT, body, "below_zero")
    assert program == (
        "from typing import List\ndef below_zero(operations: List[int]) -> bool:\n"
        '    """ Return True if the balance ever falls below zero.\n    >>> below_zero([1, 2, -4, 5])\n    True\n    """\n'
        "    balance = 0\n    for op in operations:\n        balance += op\n        if balance < 0:\n"
        "            return True\n    return False"
    )
    assert "print" not in program and "unused" not in program


def test_helpers_the_entry_point_reaches_are_kept_and_the_rest_dropped():
    code = (
        "import math\n\ndef helper(x):\n    return math.sqrt(x)\n\ndef other():\n    return 2\n\n"
        "LIMIT = 3\n\ndef below_zero(operations):\n    return helper(sum(operations)) < LIMIT\n"
    )
    program = humaneval_program(PROMPT, chat_answer(code), "below_zero")
    assert program == (
        "from typing import List\nimport math\ndef helper(x):\n    return math.sqrt(x)\nLIMIT = 3\n"
        "def below_zero(operations):\n    return helper(sum(operations)) < LIMIT"
    )


def test_text_that_does_not_parse_is_cut_to_the_longest_parsing_run():
    """Unclosed prose after the code: the longest run of lines that parses is kept."""
    code = "def below_zero(operations):\n    return min(operations) < 0\n"
    answer = "```python\n" + code + "This works because ( the minimum"  # no closing fence
    assert fenced_python(answer) == code + "This works because ( the minimum"
    assert humaneval_program("", answer, "below_zero") == "def below_zero(operations):\n    return min(operations) < 0"


def test_an_unlabelled_fence_gives_the_text_before_it():
    """Upstream looks for ```python only: a bare ``` fence yields the text before it (here none), so
    the program is the prompt's stub alone, which has no return and is dropped."""
    answer = "```\ndef below_zero(operations):\n    return False\n```"
    assert fenced_python(answer) == ""
    assert humaneval_program(PROMPT, answer, "below_zero") == "from typing import List"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x = 1\r\ny = x\t+ 1\r\n", "x = 1\ny = x + 1"),  # line ends and tabs normalised
        (
            "def f():\n    return 1\ndef f():\n    return 2\ng = f\n",
            "def f():\n    return 2\ng = f",
        ),  # redefined in place
        ("class A:\n    pass\nfor i in range(3):\n    print(i)\n", "class A:\n    pass"),  # statements dropped
    ],
)
def test_sanitize_without_an_entry_point_keeps_every_definition(text, expected):
    assert sanitize(text) == expected


def test_the_filters_map_every_answer_of_every_document():
    docs = [{"prompt": PROMPT, "entry_point": "below_zero"}, {"prompt": "", "entry_point": "f"}]
    answers = [[chat_answer("def below_zero(o):\n    return False")], ["def f():\n    return 3", "nothing"]]
    programs = humaneval_programs(answers, docs)
    assert programs == [
        ["from typing import List\ndef below_zero(o):\n    return False"],
        ["def f():\n    return 3", ""],
    ]
    assert fenced_programs([["a\n```python\nx = 1\n```\nb"]], [{}]) == [["x = 1\n"]]
