"""What a front end run as one process of two devices and as two processes of one device each
(``--mesh data=2``) writes, and how two such runs are compared: the files they write, less what
differs between two runs that decode alike (times, each run's own paths)."""

from __future__ import annotations

import json
from pathlib import Path

from processes import finish, start, stop

MESH = ["--mesh", "data=2"]
TIMEOUT_S = 600
# The benchmark's and the harness's timed fields.
TIMING = {
    "seconds",
    "tokens_per_second",
    "compile_seconds",
    "speedup_tokens_per_second",
    "speedup_tokens_per_second_interval",
    "batch_seconds",
}


def one_and_two(module: str, argv: list[str], out: Path, name: str, two_argv: list[str] | None = None):
    """The command as one process of two devices and as two processes of one device each, run
    at once and both finished: (the one process, the two)."""
    one = start(module, argv, out, f"{name}-one", devices=2)
    two = start(module, two_argv or argv, out, f"{name}-two", devices=1, processes=2)
    try:
        return finish(one, TIMEOUT_S)[0], finish(two, TIMEOUT_S)
    finally:
        stop(one + two)


UNTIMED_TUNE = {"seconds", "compile_seconds", "time", "date", "model", "log", "processes"}


def untimed_tune(tree):
    """``tree`` without what differs between two runs that decode alike: times, and the paths of
    each run's own model directory and output."""
    if isinstance(tree, dict):
        return {k: untimed_tune(v) for k, v in tree.items() if k not in UNTIMED_TUNE}
    if isinstance(tree, list):
        return [untimed_tune(v) for v in tree]
    return tree


def harness_files(root: Path) -> tuple[dict, dict]:
    (results,) = root.rglob("results_*.json")
    (efficiency,) = root.rglob("efficiency_*.json")
    return json.loads(results.read_text()), json.loads(efficiency.read_text())
