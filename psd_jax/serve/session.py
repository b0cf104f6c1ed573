"""What the batcher needs of a model: the small interface it drives, apart from the engine behind it.

The scheduler (``batcher.Batcher``) starts a batch of rows, advances it one block at a time, writes
new requests into finished rows, stops rows nobody waits for and moves the batch to another compiled
size. Three implementations answer these calls: the model itself (``api.LoadedModel`` with its
``block_decode.BlockDecode``), the same decode made in lockstep by every serving process
(``lockstep.LockstepModel``), and the tests' model-free engine (tests/serving/test_scheduler.py), which
checks the scheduler's rules without compiling anything. The batcher names only these protocols.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np

from ..core.config import DecodeConfig


class BlockProgress(Protocol):
    """A batch after one ``BlockSession.advance`` (``block_decode.BlockProgress``): per row, its generated
    ids so far [rows, canvas gen_length], its final blocks, whether it is done, its model calls so
    far and its own generation length."""

    generated: np.ndarray
    final_blocks: np.ndarray
    done: np.ndarray
    nfe: np.ndarray
    gen_length: np.ndarray
    trace: Any  # ``core.trace.Trace`` of ``generated`` (numpy), with the ``trace`` setting; else None


class BlockSession(Protocol):
    """One batch decoded block by block (``block_decode.BlockDecode``)."""

    size: int  # rows, the compiled batch size
    done: bool  # every row is done
    compiles: int  # programs its calls compiled so far (any call may: a server counts them all)

    def advance(self) -> BlockProgress:
        """Decode until every row that is decoding has left its block or finished."""

    def join(
        self, rows: Sequence[int], prompts: Sequence[Sequence[int]], settings: Sequence[DecodeConfig], seeds
    ) -> None:
        """Start ``prompts`` in ``rows``, which are done."""

    def regroup(self, index: Sequence[int]) -> None:
        """Move to ``len(index)`` rows: new row i is row ``index[i]`` (-1: an empty, done row)."""

    def prepare_regroup(self, size: int) -> object:
        """Compile the move to ``size`` rows now (a server's warm-up)."""

    def stop(self, rows: Sequence[int]) -> None:
        """Stop decoding ``rows`` from the next ``advance`` on."""


class ModelConfigLike(Protocol):
    max_length: int
    pad_id: int


class BlockEngine(Protocol):
    """A model that starts ``BlockSession``s (``api.LoadedModel``)."""

    config: ModelConfigLike

    @property
    def compiled_programs(self) -> int:
        """Programs compiled so far."""

    def program_key(self, settings: DecodeConfig, gen_length: int) -> Hashable:
        """What requests sharing a batch share: the settings that select its compiled program, at
        the batch's generation length."""

    def start_rows(
        self,
        prompts: Sequence[Sequence[int]],
        settings: Sequence[DecodeConfig],
        seeds: Sequence[int],
        *,
        batch_size: int | None = None,
        prompt_bucket: int | None = 32,
        gen_length: int | None = None,
    ) -> BlockSession:
        """A session of ``prompts``, each with its own settings and seed, padded to ``batch_size`` rows."""

    def start_blocks(
        self,
        prompts: Sequence[Sequence[int]],
        settings: DecodeConfig | None = None,
        *,
        prompt_bucket: int | None = 32,
        batch_size: int | None = None,
        gen_length: int | None = None,
    ) -> BlockSession:
        """A session of ``prompts`` with one setting (the warm-up's)."""


class SessionRows:
    """A running ``BlockSession`` and what each of its rows holds for the scheduler (a request, or
    ``None``: a free row) with the final blocks already sent to it: the one owner of row order.
    ``regroup`` moves the session's rows and their holders by one index, so the scheduler never
    reorders a list of its own beside the session's."""

    def __init__(self, session: BlockSession, holders: Sequence[Any]):
        self.session = session
        self.holders: list[Any] = [*holders, *[None] * (session.size - len(holders))]
        self.sent: list[int] = [0] * session.size

    @property
    def size(self) -> int:
        return self.session.size

    @property
    def done(self) -> bool:
        return self.session.done

    @property
    def compiles(self) -> int:
        return self.session.compiles

    def held(self) -> list[int]:
        """The rows holding something, in row order."""
        return [row for row, holder in enumerate(self.holders) if holder is not None]

    def advance(self) -> BlockProgress:
        return self.session.advance()

    def join(self, holders: Sequence[Any], prompts, settings, seeds) -> None:
        """``prompts`` into the first free rows, each held by its ``holders`` entry."""
        free = [row for row, holder in enumerate(self.holders) if holder is None][: len(holders)]
        if len(free) < len(holders):
            raise ValueError(f"{len(holders)} rows to join, {len(free)} free")
        self.session.join(free, prompts, settings, seeds)
        for row, holder in zip(free, holders):
            self.holders[row], self.sent[row] = holder, 0

    def regroup(self, size: int) -> None:
        """Move the held rows, first rows first, to a session of ``size`` rows."""
        rows = self.held()
        self.session.regroup(rows + [-1] * (size - len(rows)))
        self.holders = [self.holders[r] for r in rows] + [None] * (size - len(rows))
        self.sent = [self.sent[r] for r in rows] + [0] * (size - len(rows))

    def stop(self, rows: Sequence[int]) -> None:
        """Stop ``rows`` and free them."""
        for row in rows:
            self.holders[row] = None
        self.session.stop(rows)

    def free(self, row: int) -> None:
        """A row whose decode ended: nothing holds it any more."""
        self.holders[row] = None
