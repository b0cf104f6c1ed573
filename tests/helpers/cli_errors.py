"""What a front end's refusal must look like on stderr: one line, ``error: ...``, no traceback."""

from __future__ import annotations


def one_line_error(capsys) -> str:
    """The single ``error:`` line the command printed (captured by pytest's ``capsys``)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ") and "Traceback" not in captured.err
    return lines[0]
