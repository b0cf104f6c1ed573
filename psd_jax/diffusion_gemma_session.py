"""DiffusionGemma decoded one canvas per call (``LoadedDiffusionGemma.start_rows``): the
``serve.session.BlockSession`` a server's batcher drives, over ``core.entropy_bound_rows``. A
canvas is the family's block: each ``advance`` is one compiled call and one host round trip for a
whole canvas of every decoding row (its denoising steps inside), and between two calls rows join,
stop and the batch changes compiled size. On a mesh (``LoadedDiffusionGemma.mesh``, over one process
or several) the rows' arrays are global arrays, their rows split over ``data``
(``LoadedDiffusionGemma.placed``, ``entropy_bound_rows``' pinned states), and the small per-row
results come back to every process (``multihost.to_host``): every process makes the same calls."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .core.config import DecodeConfig
from .core.entropy_bound import EntropyBoundSettings, SamplerProgram, SamplerValues
from .core.entropy_bound_rows import (
    CanvasRows,
    advance_rows,
    empty_rows,
    join_rows,
    placed_empty_rows,
    regroup_rows,
    stop_rows,
)
from .core.errors import InputError
from .core.runtime import row_keys
from .parallel.multihost import to_host
from .prompts import left_pad


class CanvasProgress:
    """A batch after one ``advance`` (``serve.session.BlockProgress``): per row, its ids so far,
    its finished canvases (its final blocks), whether it is done, its denoiser calls and its own
    generation length."""

    def __init__(self, generated, final_blocks, done, nfe, gen_length):
        self.generated, self.final_blocks, self.done = generated, final_blocks, done
        self.nfe, self.gen_length = nfe, gen_length
        self.trace = None  # a served decode records none (``start_rows`` refuses the ``trace`` setting)


class CanvasSession:
    """Rows of one sampler program (``SamplerProgram``: the steps, stopping and the batch's longest
    generation), each with its own prompt, seed, generation length and sampler values (entropy
    bound, temperatures, stopping confidence); ``lm`` the ``LoadedDiffusionGemma`` whose program
    cache compiles its calls."""

    def __init__(self, lm: Any, program: SamplerProgram, size: int, prompt_length: int):
        self.lm, self.program = lm, program
        self.size, self.prompt_length = size, prompt_length
        self.canvases = program.canvases(lm.config.canvas_length)
        self.compiles = 0  # programs its calls compiled (the rest were in the model's cache)
        self.compile_seconds = 0.0
        self.seconds = 0.0
        self.done = True
        self._state: CanvasRows = self._empty()

    def _empty(self) -> CanvasRows:
        """``size`` empty rows: on one device made here; on a mesh by a program of their own (the
        model's cache keeps it), so every process holds its devices' shards of the global state."""
        shape = dict(cfg=self.lm.config, dtype=self.lm.model.dtype, batch=self.size, prompt_length=self.prompt_length)
        if self.lm.mesh is None:
            return empty_rows(**shape, program=self.program)
        return self._run("empty", placed_empty_rows, **shape, program=self.program)

    def _program(self, name: str, fn, args: tuple, static: dict, with_model: bool = False):
        """``fn`` compiled for ``args`` (by the model's program cache), its compilation counted here."""
        program, seconds = self.lm.program(name, fn, args, static, with_model)
        self.compiles += seconds > 0.0
        self.compile_seconds += seconds
        return program

    def _run(self, name: str, fn, *args, with_model: bool = False, **static):
        program = self._program(name, fn, args, static, with_model)
        began = time.perf_counter()
        out = program(*args)
        self.seconds += time.perf_counter() - began
        return out

    def join(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], settings: Sequence[DecodeConfig], seeds):
        """Start ``prompts`` in ``rows`` (done rows) with their own generation lengths (``settings``:
        of this session's sampler setting) and ``seeds``; they decode from the next ``advance``,
        each as ``generate([prompt], seed=seed)``'s only row."""
        if len(rows):
            self.join_keyed(rows, prompts, settings, row_keys(seeds, [0] * len(rows)))

    def join_keyed(self, rows: Sequence[int], prompts, settings: Sequence[DecodeConfig], keys: np.ndarray) -> None:
        """``join`` with the rows' PRNG keys given (``runtime.row_keys``)."""
        C, pad = self.lm.config.canvas_length, self.lm.config.pad_id
        ids = np.full((self.size, self.prompt_length), pad, np.int32)
        valid = np.zeros((self.size, self.prompt_length), bool)
        canvases = np.zeros(self.size, np.int32)
        samplers = [EntropyBoundSettings.of(dcfg) for dcfg in settings]
        row_samplers = [samplers[0]] * self.size  # values for every row; the joined rows' are kept
        for row, prompt, dcfg, sampler in zip(rows, prompts, settings, samplers):
            if sampler.replace_length(self.program.gen_length).program() != self.program:
                raise InputError(f"settings {dcfg.changed()} do not run in this batch's program")
            row_samplers[row] = sampler
            if sampler.canvases(C) > self.canvases:
                raise InputError(f"gen_length {dcfg.gen_length} is longer than this batch's {self.canvases * C}")
            if len(prompt) > self.prompt_length:
                raise InputError(f"a prompt of {len(prompt)} tokens does not fit this batch's {self.prompt_length}")
            ids[row, self.prompt_length - len(prompt) :] = prompt
            valid[row, self.prompt_length - len(prompt) :] = True
            canvases[row] = sampler.canvases(C)
        row_keys_ = np.zeros((self.size, 2), np.uint32)
        row_keys_[list(rows)] = keys
        joined = np.zeros(self.size, bool)
        joined[list(rows)] = True
        inputs = self.lm.placed(joined, ids, valid, row_keys_, canvases, SamplerValues.of(row_samplers))
        self._state = self._run("join", join_rows, self._state, *inputs, with_model=True)
        self.done = False

    def advance(self) -> CanvasProgress:
        """One canvas of every decoding row."""
        if not self.done:
            self._state = self._run("advance", advance_rows, self._state, with_model=True, program=self.program)
        s = self._state  # the rows' small arrays to the host, never the cache
        ids, canvas, ended, nfe, canvases = to_host((s.ids, s.canvas, s.ended, s.row_nfe, s.canvases))
        self.done = bool(ended.all())
        return CanvasProgress(ids, canvas, ended, nfe, canvases * self.lm.config.canvas_length)

    def regroup(self, index: Sequence[int]) -> None:
        """Move to ``len(index)`` rows: new row i is row ``index[i]`` (-1: an empty, done row)."""
        (index_array,) = self.lm.placed(np.asarray(index, np.int32), whole=True)
        self._state = self._run("regroup", regroup_rows, self._state, index_array)
        self.size = len(index)
        self.done = bool(to_host(self._state.ended).all())

    def prepare_regroup(self, size: int):
        """Compile the move to ``size`` rows now (a server's warm-up)."""
        (index,) = self.lm.placed(np.zeros(size, np.int32), whole=True)  # placed as ``regroup`` places it
        return self._program("regroup", regroup_rows, (self._state, index), {})

    def stop(self, rows: Sequence[int]) -> None:
        """Stop decoding ``rows`` from the next ``advance`` on."""
        if not len(rows):
            return
        stopped = np.zeros(self.size, bool)
        stopped[list(rows)] = True
        self._state = self._run("stop", stop_rows, self._state, *self.lm.placed(stopped))
        self.done = bool(to_host(self._state.ended).all())


def start_session(
    lm: Any,
    prompts: Sequence[Sequence[int]],
    settings: Sequence[DecodeConfig],
    keys: np.ndarray,
    batch_size: int | None,
    prompt_bucket: int | None,
    gen_length: int | None,
) -> CanvasSession:
    """A session of ``batch_size`` rows whose first rows decode ``prompts`` (``LoadedDiffusionGemma.start_rows``)."""
    rows = batch_size or len(prompts)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < len(prompts):
        raise InputError(f"batch_size must be an integer >= the {len(prompts)} prompts, got {batch_size!r}")
    C = lm.config.canvas_length
    longest = max(settings, key=lambda s: s.gen_length).gen_length
    length = -(-(gen_length or longest) // C) * C
    programs = {EntropyBoundSettings.of(s).replace_length(length).program() for s in settings}
    if len(programs) > 1:
        raise InputError("the rows' sampler settings differ in steps or stopping: they need separate batches")
    prompt_ids, _ = left_pad([list(p) for p in prompts], lm.config, length, prompt_bucket)
    run = CanvasSession(lm, programs.pop(), rows, prompt_ids.shape[1])
    run.join_keyed(list(range(len(prompts))), prompts, settings, keys)
    return run
