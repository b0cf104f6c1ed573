"""``factor`` (Fast-dLLM ``get_transfer_index_dynamic``): the leading ranks k whose confidence
c_(k) is at least 1 - f/(k+2), f the row's ``factor``.

Upstream quirk kept: when the first failing rank is the last one, everything is committed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Array, ProgramFields, arange_like, leading_true, per_row, rank_keys


def factor_count(xp, conf: Array, valid: Array, remaining: Array, factor) -> Array:
    """How many leading ranks pass [B]."""
    n = conf.shape[-1]
    sorted_conf = -xp.sort(rank_keys(xp, conf, valid), axis=-1)  # descending, invalid last
    k = arange_like(xp, n, conf)
    passes = (sorted_conf >= 1.0 - factor / (k + 2.0)) | (k == 0)
    leading = leading_true(xp, passes & (k < remaining[:, None]))
    return xp.where(leading >= remaining - 1, remaining, leading)


@dataclass(frozen=True)
class Factor:
    name: str = "factor"
    per_block_steps: ClassVar[bool] = False

    def counts(self, program: ProgramFields) -> None:
        return None

    def commit(self, xp, conf: Array, valid: Array, rank: Array, step: Array, counts: None, values) -> Array:
        remaining = xp.sum(valid, axis=-1)
        return rank < factor_count(xp, conf, valid, remaining, per_row(values.factor))[:, None]
