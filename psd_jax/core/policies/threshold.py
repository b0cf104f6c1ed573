"""``threshold`` (Fast-dLLM ``get_transfer_index``): the most confident position plus every
position whose confidence is at least the row's ``threshold``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Array, ProgramFields, per_row


@dataclass(frozen=True)
class Threshold:
    name: str = "threshold"
    per_block_steps: ClassVar[bool] = False

    def counts(self, program: ProgramFields) -> None:
        return None

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: None, values) -> Array:
        return (rank == 0) | (conf >= per_row(values.threshold))
