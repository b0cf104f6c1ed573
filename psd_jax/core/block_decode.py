"""One batch decoded block by block on a ``placed_model.PlacedModel``: the session a server drives.

Each of ``BlockDecode``'s calls is one compiled program of the engine's block streaming
(``engine.decode_start``, ``decode_blocks``, ``decode_join``, ``decode_regroup``, ``decode_stop``,
``streamed``): one host round trip per block, none per step. The rows (their prompts' mask, canvas,
runtime values, keys) live in the compiled state alone, which is the one owner of their order; the
host keeps only the batch's shape and its first rows' count. ``serve/session.py`` is the interface the server's
scheduler sees it through.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..parallel.multihost import to_host
from .config import DecodeConfig
from .engine import decode_blocks, decode_join, decode_regroup, decode_start, decode_stop, finish, streamed
from .errors import InputError
from .placed_model import PlacedModel
from .records import DecodeOutput, Generation
from .runtime import Program, RowValues, row_keys


@dataclasses.dataclass
class BlockProgress:
    """A batch after one ``BlockDecode.advance``: per row, the generated ids so far
    ([rows, canvas gen_length]; a row's own ids are the first ``gen_length[r]``; a block's ids are
    final once it is counted in ``final_blocks``), the number of final blocks, and whether the row
    is done (then ``final_blocks`` is the number of blocks it decoded: it stops at its last one or
    at one holding EOS)."""

    generated: np.ndarray
    final_blocks: np.ndarray
    done: np.ndarray
    nfe: np.ndarray  # model calls while each row was decoding, so far
    gen_length: np.ndarray  # each row's own generation length
    trace: Any = None  # with the ``trace`` setting: ``core.trace.Trace`` of the generated ids so far (numpy)


class BlockDecode:
    """One batch decoded block by block (the loaded model's ``start_blocks``): each ``advance`` is one
    compiled call and one host round trip, however many steps the block takes. ``join`` writes new
    prompts into rows that are done (continuous batching): each decodes from there exactly as a
    ``generate`` of its own (greedy), while the other rows go on.

    All rows share the compiled ``program`` (``runtime.Program``: the settings that set
    shapes); each has its own runtime values, PRNG key and generation length (up to the canvas's).
    ``placed``: the model it decodes on (its parameters, config, compile cache, devices and results)."""

    def __init__(self, placed: PlacedModel, program: Program, prompt_ids, prompt_mask, values: RowValues):
        self.placed, self.program = placed, program
        self._first = (np.asarray(prompt_ids, np.int32), np.asarray(prompt_mask, np.int32), values)  # ``start``'s
        self.size, self.prompt_length = self._first[0].shape
        self.rows = 0  # rows holding a prompt at the start (``results``)
        self.compile_seconds = 0.0
        self.compiles = 0  # programs its calls compiled (the rest were in the model's cache)
        self.seconds = 0.0  # decode wall time so far (compilation excluded)
        self.done = False
        self._state = None

    def _compiled(self, fn, name: str, args: tuple, shapes: tuple = ()):
        """``fn`` compiled for ``args`` (by the model's program cache), its time counted here."""
        rows = jax.ShapeDtypeStruct((self.size, self.prompt_length), jnp.int32)
        compiled, seconds = self.placed.compile_with(fn, (name, rows, *shapes), args, self.program)
        self.compile_seconds += seconds
        self.compiles += seconds > 0.0  # a cached program is returned with 0.0
        return compiled

    def start(self, keys: np.ndarray, live: np.ndarray) -> None:
        """The first state: the first forward of the ``live`` rows (the others start done)."""
        (ids, mask, values), self._first = self._first, None  # the state holds the rows from here on
        ids, mask, keys, values, live_rows = self.placed.on_devices(ids, mask, keys, values, live)
        args = (self.placed.params, ids, mask, keys, values, live_rows)
        start = self._compiled(decode_start, "start", args)
        began = time.perf_counter()
        self._state = start(*args)
        self.seconds += time.perf_counter() - began
        self.rows, self.done = int(live.sum()), not live.any()

    def join(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], settings: Sequence[DecodeConfig], seeds):
        """Start ``prompts`` (token ids, each at most ``prompt_length``) in ``rows``, which must be
        done, with their own ``settings`` (of this batch's program: ``runtime.Program``)
        and ``seeds``; they decode from the next ``advance`` on. No model call."""
        if not len(rows):
            return
        new_ids = np.full((self.size, self.prompt_length), self.placed.config.pad_id, np.int32)
        new_mask = np.zeros((self.size, self.prompt_length), np.int32)
        for row, ids, dcfg in zip(rows, prompts, settings):
            if Program.of(dcfg, self.program.gen_length) != self.program:
                raise InputError(f"settings {dcfg.changed()} do not run in this batch's program")
            left = self.prompt_length - len(ids)
            if left < 0:
                raise InputError(f"a prompt of {len(ids)} tokens does not fit this batch's {self.prompt_length}")
            new_ids[row, left:] = ids
            new_mask[row, left:] = 1
        picked = np.asarray(rows)
        # Values for every row; ``decode_join`` keeps the other rows' own.
        row_settings = [settings[0]] * self.size
        for row, dcfg in zip(rows, settings):
            row_settings[row] = dcfg
        values = RowValues.of(row_settings)
        keys = np.zeros((self.size, 2), np.uint32)
        keys[picked] = row_keys(seeds, [0] * len(rows))  # a joined row draws as generate's row 0
        join = np.zeros(self.size, bool)
        join[picked] = True
        ids, mask, keys, values, join = self.placed.on_devices(new_ids, new_mask, keys, values, join)
        args = (self.placed.params, ids, mask, self._state, join, keys, values)
        self._state = self._compiled(decode_join, "join", args)(*args)
        self.done = False

    def advance(self) -> BlockProgress:
        """Run the loop until every row that is decoding has left its block or finished."""
        began = time.perf_counter()
        if not self.done:
            blocks = self._compiled(decode_blocks, "blocks", (self.placed.params, self._state))
            self._state = blocks(self.placed.params, self._state)
        state = self._state
        canvas, final, trace = self._streamed(state)
        done, canvas, final, nfe, gen, trace = to_host(
            (state.done, canvas, final, state.row_nfe, state.values.gen_length, trace)
        )
        self.seconds += time.perf_counter() - began
        self.done = bool(done.all())
        p = self.prompt_length
        trace = None if trace is None else jax.tree.map(lambda a: np.asarray(a)[:, p:], trace)
        return BlockProgress(canvas[:, p:], final, done, nfe, gen, trace)

    def _streamed(self, state):
        """``engine.streamed`` of ``state``: the output canvas, final blocks and laid-out trace."""
        return streamed(
            state.canvas,
            state.block,
            state.done,
            state.prompt_mask,
            state.values.num_blocks,
            state.trace,
            mcfg=self.placed.config,
            program=self.program,
        )

    def regroup(self, index: Sequence[int]) -> None:
        """Move to a decode of ``len(index)`` rows: new row i is row ``index[i]`` as it is (-1: an
        empty row, done), so a running batch changes compiled size without touching its rows."""
        index_array = self.placed.replicated(np.asarray(index, np.int32))
        self._state = self.prepare_regroup(len(index))(self.placed.params, self._state, index_array)
        self.size = len(index)
        if all(i < 0 for i in index):
            self.done = True

    def prepare_regroup(self, size: int):
        """The compiled move of this decode's rows to ``size`` rows (``regroup``), compiled now if
        it is not yet (a server compiles them at start-up)."""
        # The index is replicated (``regroup`` places it on every device): compiled for that layout,
        # not one the partitioner picks.
        index = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.placed.whole())
        args = (self.placed.params, self._state, index)
        return self._compiled(decode_regroup, "regroup", args, (index,))

    def stop(self, rows: Sequence[int]) -> None:
        """Stop decoding ``rows`` (their output is no longer wanted): they are frozen like finished
        rows from the next ``advance`` on, and no longer hold the batch back."""
        if not len(rows):
            return
        stopped = np.zeros(self.size, bool)
        stopped[list(rows)] = True
        args = (self.placed.params, self._state, self.placed.on_devices(stopped)[0])
        self._state = self._compiled(decode_stop, "stop", args)(*args)

    def results(self) -> list[Generation]:
        """One ``Generation`` per prompt given to ``start_blocks``, as ``generate`` returns them
        (call once every row is done)."""
        state = self._state
        canvas, _, trace = self._streamed(state)
        out = to_host(finish(state, canvas, trace))
        n, end = self.rows, self.prompt_length + int(to_host(state.values.gen_length)[0])
        rows = DecodeOutput(out.canvas[:n, :end], out.row_nfe[:n], out.nfe, out.sequence_forwards, out.iterations, {})
        rows = rows._replace(stats={k: v[:n] for k, v in out.stats.items()}, calls=out.calls)
        if out.trace is not None:
            rows = rows._replace(trace=jax.tree.map(lambda a: np.asarray(a)[:n, :end], out.trace))
        return self.placed.results(rows, self.prompt_length, self.seconds, self.compile_seconds)
