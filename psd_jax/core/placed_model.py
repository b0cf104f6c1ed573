"""A model's parameters on their devices and the decode programs compiled for them.

``PlacedModel`` is what the compiled decode needs of a loaded model: its graph and parameters (on
one device, or sharded over ``mesh``), its config, the compiled programs (cached by name, input
shapes and ``runtime.Program``, least recently used out beyond ``max_programs``), the placement of
a call's arrays (``on_devices``: rows split over the mesh; ``replicated``: whole on every device)
and the ``Generation`` records of a decode's output (``results``). The library's loaded model holds
one and ``block_decode.BlockDecode`` runs on one; the tokenizer stays above, given here as ``decode_text``.
DiffusionGemma's loaded model keeps its sampler's programs here too (``kept``).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import AnyConfig

from ..parallel.multihost import to_host
from ..parallel.sharding import batch_sharding
from . import rules
from .calls import call_records
from .layouts import layout_type
from .records import DecodeOutput, Generation, generations
from .runtime import Program


def placed_attribute(name: str, doc: str, holder: str = "placed") -> property:
    """A loaded model's attribute ``name``, read and set on the ``PlacedModel`` it holds as
    ``holder``: one copy of the graph, parameters, config, mesh and ``max_programs``."""
    return property(
        lambda lm: getattr(getattr(lm, holder), name),
        lambda lm, value: setattr(getattr(lm, holder), name, value),
        doc=doc,
    )


class PlacedModel:
    """The graph and parameters of a model (``nnx.split``), its ``config`` (special ids resolved),
    the ``mesh`` its parameters are sharded over (``None``: one device), ``decode_text`` (generated
    ids -> text, or ``None`` without a tokenizer) and the programs compiled for it."""

    def __init__(
        self,
        graphdef: Any,
        params: Any,
        config: AnyConfig,
        mesh: Mesh | None,
        decode_text: Callable[[Sequence[int]], str | None],
    ):
        self.graphdef, self.params, self.config, self.mesh = graphdef, params, config, mesh
        self.decode_text = decode_text
        self.programs: collections.OrderedDict[tuple, Any] = collections.OrderedDict()  # least recently used first
        self.max_programs: int | None = None  # compiled programs kept (least recently used out); None: all

    def under_mesh(self) -> contextlib.AbstractContextManager:
        """The mesh as the one tracing sees (``jax.set_mesh``), or nothing on one device."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------- programs
    def kept(self, key: tuple, compile_program: Callable[[], Any]) -> tuple[Any, float]:
        """The program cached under ``key``, compiled under the mesh by ``compile_program()`` when it
        is not, and the seconds that took (0.0 when cached); the least recently used program is
        dropped beyond ``max_programs``."""
        if key in self.programs:
            self.programs.move_to_end(key)
            return self.programs[key], 0.0
        began = time.perf_counter()
        with self.under_mesh():
            compiled = compile_program()
        self.programs[key] = compiled
        while self.max_programs is not None and len(self.programs) > self.max_programs:
            self.programs.popitem(last=False)
        return compiled, time.perf_counter() - began

    def compile_with(self, fn, shapes: tuple, args: tuple, program: Program) -> tuple[Any, float]:
        """``fn`` compiled ahead of time for ``args`` (``kept`` by name ``shapes[0]``, the input
        shapes ``shapes[1:]`` and settings), and the seconds its compilation took."""
        cache_key = (shapes[0], *(a.shape for a in shapes[1:]), program, self.config)
        # Under the mesh, the engine pins the KV cache's sharding (sharding.constrain_kv_cache).
        return self.kept(cache_key, lambda: fn.lower(self.graphdef, *args, mcfg=self.config, program=program).compile())

    def clear_programs(self) -> None:
        """Drop every compiled program (the loaded model's ``clear_programs``)."""
        self.programs.clear()

    # ------------------------------------------------------------------------------ placement
    def on_devices(self, *arrays: Any) -> tuple[Any, ...]:
        """Row-major arrays [B, ...] or pytrees of them (prompts, masks, keys, ``RowValues``;
        ``None`` passes through) as device arrays, rows split over the mesh as ``batch_sharding``
        says."""
        arrays = tuple(None if a is None else jax.tree.map(jnp.asarray, a) for a in arrays)
        if self.mesh is None:
            return arrays
        rows = batch_sharding(self.mesh, arrays[0].shape[0])
        return tuple(None if a is None else jax.tree.map(lambda x: jax.device_put(x, rows), a) for a in arrays)

    def whole(self) -> NamedSharding | None:
        """The sharding of an array every device holds whole (``None`` on one device)."""
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def replicated(self, array: Any) -> jax.Array:
        """A small array every device holds whole (on a mesh: every process's devices)."""
        array = jnp.asarray(array)
        return array if self.mesh is None else jax.device_put(array, self.whole())

    # -------------------------------------------------------------------------------- results
    def results(
        self,
        out: DecodeOutput,
        prompt_length: int,
        seconds: float,
        compile_seconds: float,
        program: Program | None = None,
    ) -> list[Generation]:
        """``generations`` of ``out``, with the batch's calls by shape when ``program`` (the compiled
        settings) is given: a decode of one batch size throughout (``generate``; a block-by-block
        decode may change size between calls)."""
        out = to_host(out)  # rows split over several processes' devices come back whole on every process
        calls = None
        if program is not None:
            layout = layout_type(self.config)
            shapes = layout.call_shapes(program, layout.canvas_length(prompt_length, program))
            logits = rules.logit_count(program, layout.region_length(program))
            calls = call_records(shapes, out.calls, len(out.row_nfe), logits)
        return generations(
            out, prompt_length, self.config.stop_ids, self.decode_text, seconds, compile_seconds, calls=calls
        )
