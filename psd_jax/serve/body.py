"""A request body as JSON, read and parsed within bounds a hostile client cannot push past.

Python's ``json`` module trusts its input: an array nested 50,000 deep overflows its recursive
parser (``RecursionError``), an integer of 5,000 digits trips the interpreter's conversion limit
(``ValueError``), and a ``\\ud800`` escape becomes a string no encoder can write. Each of those is
the client's mistake, so each is a 400 naming the limit, decided here before anything else reads
the body: the nesting with a linear scan of the raw text (the parser never sees a deep body), the
integers as they are parsed, the strings once parsed (an OpenAI body nests about 5 levels, holds
no integer past 2**64 and is UTF-8 text).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, Callable, Iterator
from typing import Any, Protocol

import numpy as np

from .errors import RequestError, printable
from .limits import LIMIT_CODE

MAX_DEPTH = 64  # arrays and objects inside one another
MAX_INT_DIGITS = 20  # 2**64 has 20 digits
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class Body(Protocol):
    """What ``read_json`` reads: Starlette's ``Request``."""

    headers: Any

    def stream(self) -> AsyncIterable[bytes]: ...


async def read_json(request: Body, limit: int) -> Any:
    """The request body as JSON, refused (413) past ``limit`` bytes: at once from its Content-Length,
    and while reading, so a chunked body without one stops being read at the limit. A client that
    leaves mid-body raises Starlette's ``ClientDisconnect``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def too_large(limit: int) -> RequestError:
    return RequestError(
        f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
        code=LIMIT_CODE,
        status=413,
    )


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON (any encoding ``json.loads`` detects), within the depth, integer and Unicode
    bounds; every problem is a ``RequestError``."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads(bytes) does
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    depth = nesting_depth(text.encode("utf-8", "surrogatepass"))
    if depth > MAX_DEPTH:
        raise RequestError(
            f"the request body nests arrays and objects {depth} levels deep; this server reads at most {MAX_DEPTH}",
            code=LIMIT_CODE,
        )
    refused: list[_Refused] = []
    try:
        body = json.loads(text, parse_int=_integer_in(refused), parse_constant=_constant_in(refused))
    except json.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if refused:
        check_numbers(body)
    if _may_hold_surrogates(text):
        check_unicode(body)
    return body


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text ``data`` (UTF-8), brackets inside
    strings not counted; linear in its length. On a prefix that is valid JSON it agrees with the
    parser, so a body the parser would recurse deeply into is always caught."""
    b = np.frombuffer(data, np.uint8)
    if not b.size:
        return 0
    # A quote ends or starts a string unless an odd run of backslashes precedes it.
    index = np.arange(b.size, dtype=np.int32)
    last_other = np.maximum.accumulate(np.where(b != _BACKSLASH, index, -1))  # last non-backslash at or before i
    run = np.empty(b.size, np.int32)
    run[0], run[1:] = 0, index[:-1] - last_other[:-1]  # backslashes just before i
    quotes = (b == _QUOTE) & (run % 2 == 0)
    outside = np.cumsum(quotes) % 2 == 0  # a bracket outside strings: an even count of quotes up to it
    step = (np.isin(b, _OPEN).astype(np.int32) - np.isin(b, _CLOSE)) * outside
    return int(max(np.cumsum(step, dtype=np.int32).max(), 0))


class _Refused:
    """A number the parser met and this server refuses, left in the parsed body so that the error
    can name where it stands (the parser's hooks see the number, not its field)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        self.message, self.code = message, code


def _integer_in(refused: list[_Refused]) -> Callable[[str], Any]:
    def integer(text: str) -> Any:
        digits = len(text.lstrip("-"))
        if digits <= MAX_INT_DIGITS:
            return int(text)
        refused.append(
            _Refused(
                f"holds an integer of {digits} digits; this server reads integers of at most {MAX_INT_DIGITS} digits",
                LIMIT_CODE,
            )
        )
        return refused[-1]

    return integer


def _constant_in(refused: list[_Refused]) -> Callable[[str], Any]:
    def constant(name: str) -> Any:
        refused.append(_Refused(f"holds {name}, which is not a JSON number"))
        return refused[-1]

    return constant


def check_numbers(body: Any) -> None:
    """A refused number is a 400 whose ``param`` names its field, as ``max_tokens`` or
    ``prompt[0]``; one a later duplicate key replaced is not in the body, and not refused."""
    for where, value, _ in _leaves(body, ""):
        if isinstance(value, _Refused):
            field = printable(where) if where else "the request body"
            raise RequestError(f"{field} {value.message}", param=printable(where) or None, code=value.code)


def _may_hold_surrogates(text: str) -> bool:
    """Whether a parsed string may hold a lone surrogate: the text has one raw (bytes that decode
    to it) or an escape of one; nearly every body has neither, and is not walked."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return _SURROGATE_ESCAPE.search(text) is not None


def check_unicode(body: Any) -> None:
    """Every string of ``body``, keys and values, must be Unicode text (no lone surrogate): else a
    400 whose ``param`` names the field, as ``messages[0].content`` or ``stop[1]``."""
    for where, text, is_key in _leaves(body, ""):
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            what = f"the field name '{printable(text)}'" if is_key else printable(where)
            raise RequestError(
                f"{what} is not valid Unicode: it holds a lone surrogate ({printable(exc.object[exc.start])})",
                param=printable(where),
            ) from None


def _leaves(value: Any, where: str) -> Iterator[tuple[str, Any, bool]]:
    """(path, value, whether it is a key) for every key and every value that is not an array or
    an object in ``value``."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else key
            yield path, key, True
            yield from _leaves(item, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{where}[{i}]")
    else:
        yield where, value, False
