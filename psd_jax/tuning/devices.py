"""The device a search optimises for: this one (its measured seconds) or a modeled target.

``--device this`` ranks candidates by the seconds their decodes took here (warm, compilation
apart). ``--device CHIP[:MODEL_DIR][@BATCH]`` prices the same decodes for another machine without
decoding again: each batch's model calls by shape (``calls.py``, in the log) are charged the
roofline cost of that shape for the model of ``MODEL_DIR`` (a directory with a ``config.json``;
default the tuned model itself) on ``CHIP`` at ``BATCH`` rows (default ``--batch``), and each
problem its share (``costs.roofline_call_cost``; docs/cost-model.md). At one row per call a
problem is charged its own calls instead: its NFE, in the shapes of its batch's calls (a batch
makes as many calls as its slowest row needs; a row alone makes its own).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from ..core.calls import CallShape, record_shape
from ..core.errors import InputError
from ..costs import CHIPS, roofline_call_cost
from .search import CALLS, Objective, Outcome

THIS = "this"
OBJECTIVES = ("seconds", "calls")
KINDS = {"h200": "gpu", "tpu-v5e": "tpu"}  # a modeled chip's device kind (recommended.json)


@dataclasses.dataclass(frozen=True)
class Target:
    """A modeled machine: a chip, the model priced on it and the rows of its batches."""

    chip: str  # a key of costs.CHIPS
    model_dir: Path
    batch: int

    @property
    def name(self) -> str:
        return f"{self.chip}:{self.model_dir.name}@{self.batch}"

    @property
    def kind(self) -> str:
        return KINDS[self.chip]


def parse_device(text: str, model_dir: Path, batch: int) -> Target | None:
    """``this`` -> None; ``CHIP[:MODEL_DIR][@BATCH]`` -> a ``Target`` (checked: a known chip, a
    directory with config.json, a positive batch)."""
    if text == THIS:
        return None
    spec, at, rows = text.partition("@")
    chip, colon, directory = spec.partition(":")
    if chip not in CHIPS:
        raise InputError(f"unknown --device {text!r}: give this, or one of {', '.join(CHIPS)} [:MODEL_DIR][@BATCH]")
    path = Path(directory) if colon else model_dir
    if not (path / "config.json").is_file():
        raise InputError(f"--device {text!r}: {path} has no config.json")
    if at:
        if not rows.isdigit() or int(rows) < 1:
            raise InputError(f"--device {text!r}: the batch after @ must be a positive integer")
        batch = int(rows)
    return Target(chip, path, batch)


def objective_for(name: str, target: Target | None, block_length: int) -> Objective:
    """The search's objective: model calls, or seconds here (``target`` None) or on ``target``."""
    if name not in OBJECTIVES:
        raise InputError(f"unknown --objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    if name == "calls":
        return dataclasses.replace(CALLS, device=THIS if target is None else target.name)
    if target is None:
        return Objective("seconds", THIS)
    from models import load_config

    mcfg = load_config(target.model_dir)
    chip = CHIPS[target.chip]

    @functools.cache
    def cost(shape: CallShape, logits: int | None) -> float:
        return roofline_call_cost(mcfg, chip, shape, target.batch, block_length, logits)

    def price(outcome: Outcome) -> float:
        if not outcome.calls:
            raise InputError(
                "the log holds decodes without their calls by shape (an older log): decode again to price them "
                f"for {target.name}"
            )
        batch = sum(c["count"] * cost(record_shape(c), c.get("logits")) for c in outcome.calls)
        if target.batch == 1:  # alone, a problem makes its own calls (its NFE), shaped as its batch's were
            return batch * outcome.nfe / sum(c["count"] for c in outcome.calls)
        return batch / target.batch

    return Objective("seconds", target.name, price)
