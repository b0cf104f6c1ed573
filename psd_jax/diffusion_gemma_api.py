"""``load_model`` for DiffusionGemma: ``LoadedDiffusionGemma.generate`` runs the entropy-bound
sampler (``core.entropy_bound``) with the same arguments and ``Generation`` records as the
mask-token families' ``LoadedModel.generate``, and decodes with recorded draws instead of its own
PRNG when given them (``draws``; ``read_draws`` reads them from a safetensors file), so that a run
of transformers' ``generate`` is reproduced bit for bit.

Settings are ``DecodeConfig`` fields: the lengths and ``config.ENTROPY_BOUND_FIELDS``, over the
release's ``generation_config.json``; a generation length is rounded up to whole canvases, as
upstream's ``generate`` rounds ``max_new_tokens``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError
from safetensors.numpy import load_file

from convert.diffusion_gemma import read_params
from models.diffusion_gemma import DiffusionGemma
from models.diffusion_gemma_config import DiffusionGemmaConfig

from .core.config import DecodeConfig
from .core.entropy_bound import (
    Decoded,
    Draws,
    EntropyBoundSettings,
    Prepared,
    SamplerProgram,
    compile_decode,
    prepare,
)
from .core.errors import InputError
from .core.placed_model import PlacedModel, placed_attribute
from .core.records import Generation, row_trace, tokens_before_stop
from .core.runtime import row_keys
from .core.trace import SETTLED
from .diffusion_gemma_session import CanvasSession, start_session
from .model_dir import canvas_fields, model_settings
from .parallel.sharding import batch_sharding, param_shardings
from .prompts import PromptIO, left_pad

SERVED_TRACE = (
    "trace: DiffusionGemma's decode one canvas per call (serving) records no trace yet; generate records it "
    "(psd_jax.load_model(...).generate(..., trace=True), python -m psd_jax.generate --trace)"
)
DRAW_NAMES = ("init_canvas", "sample", "renoise")  # a recording's arrays, as the goldens lay them out


class LoadedDiffusionGemma(PromptIO):
    """A DiffusionGemma model, its config and tokenizer (``None`` if it has none), and the mesh its
    parameters are sharded over (``None``: one device)."""

    def __init__(self, model: DiffusionGemma, tokenizer, path: Path, mesh: Mesh | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.defaults = model_settings(path)  # the release's generation settings
        # Graph, parameters, config, mesh and the compiled programs (least recently used out), held
        # as the other families' are; ``placed`` (below) is this family's placement of host arrays.
        self.placement = PlacedModel(*nnx.split(model), model.config, mesh, self.decode_text)

    config = placed_attribute("config", "the model's config (``DiffusionGemmaConfig``)", "placement")
    graphdef = placed_attribute("graphdef", "the model's graph (``nnx.split``)", "placement")
    params = placed_attribute("params", "the model's parameters (``nnx.split``), on their devices", "placement")
    mesh = placed_attribute("mesh", "the mesh the parameters are sharded over; ``None``: one device", "placement")
    max_programs = placed_attribute("max_programs", "compiled programs kept; ``None``: all", "placement")

    def default_settings(self) -> DecodeConfig:
        """The release's settings (``generation_config.json``)."""
        return self.defaults

    def fitted(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """A generation length given is rounded up to whole canvases, as upstream rounds it."""
        return canvas_fields(overrides, self.config.canvas_length) if "gen_length" in overrides else overrides

    @property
    def compiled_programs(self) -> int:
        return len(self.placement.programs)

    def clear_programs(self) -> None:
        self.placement.clear_programs()

    def program_key(self, settings: DecodeConfig, gen_length: int) -> SamplerProgram:
        """What rows sharing a batch share (``serve.session.BlockEngine``): the sampler's program
        (steps and stopping; bounds, temperatures and confidences are each row's own)."""
        return EntropyBoundSettings.of(settings).replace_length(gen_length).program()

    def program(self, name: str, fn, args: tuple, static: dict, with_model: bool = False) -> tuple[Any, float]:
        """A ``core.entropy_bound_rows`` function compiled for ``args``' shapes and ``static``,
        called with ``args``; ``with_model``: ``fn`` takes the model (its graph and parameters) first."""
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args))
        key = (name, shapes, tuple(sorted(static.items())))

        def compile_program():
            if with_model:
                compiled = fn.lower(self.graphdef, self.params, *args, **static).compile()
                return lambda *a: compiled(self.params, *a)
            return fn.lower(*args, **static).compile()

        return self.placement.kept(key, compile_program)

    def start_rows(
        self,
        prompts: Sequence[Sequence[int]],
        settings: Sequence[DecodeConfig],
        seeds: Sequence[int],
        *,
        batch_size: int | None = None,
        prompt_bucket: int | None = 32,
        gen_length: int | None = None,
    ) -> CanvasSession:
        """A session decoding one canvas per ``advance`` (a server's continuous batching), row r as
        ``generate([prompts[r]], settings[r], seed=seeds[r])``'s only row; ``batch_size`` rows in
        all (the rest start done), ``gen_length`` the longest a row may ask for later. A session
        records no trace (``generate`` does)."""
        checked, ids, keys = self.row_requests(prompts, settings, seeds)
        if any(s.trace for s in checked):
            raise InputError(SERVED_TRACE)
        return start_session(self, ids, checked, keys, batch_size, prompt_bucket, gen_length)

    def start_blocks(
        self,
        prompts: Sequence[str | Sequence[int]],
        settings: DecodeConfig | None = None,
        *,
        seed: int = 0,
        chat: bool | None = None,
        prompt_bucket: int | None = 32,
        batch_size: int | None = None,
        gen_length: int | None = None,
        **overrides: Any,
    ) -> CanvasSession:
        """``start_rows`` with one setting, row r drawing as ``generate``'s row r."""
        dcfg, ids = self.request(prompts, settings, overrides, seed, chat, prompt_bucket)
        keys = row_keys([seed] * len(ids), range(len(ids)))
        return start_session(self, ids, [dcfg] * len(ids), keys, batch_size, prompt_bucket, gen_length)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        settings: DecodeConfig | None = None,
        *,
        seed: int = 0,
        chat: bool | None = None,
        prompt_bucket: int | None = 32,
        warm: bool = False,
        draws: Draws | None = None,
        **overrides: Any,
    ) -> list[Generation]:
        """Decode a batch of prompts; one ``Generation`` per prompt, its ``output_ids`` the
        ``gen_length`` ids of its canvases (pad after its end), ``nfe`` the denoiser calls while it
        decoded and ``stats["decoder_passes"]`` those in which it was still denoising (upstream's).

        ``draws``: recorded draws (``read_draws``) instead of the engine's own, keyed by ``seed``
        and each row's place (a row draws the same whatever shares its batch). A recording holds
        the prompts as upstream padded them: use ``prompt_bucket=None`` (padding to the longest
        prompt, as upstream's tokenizer does). ``warm``: as ``LoadedModel.generate``. The ``trace``
        setting gives each row's ``Generation.trace`` from the sampler's per-step records
        (``settled_trace``)."""
        dcfg, ids = self.request(prompts, settings, overrides, seed, chat, prompt_bucket)
        prompt_ids, prompt_mask = left_pad(ids, self.config, dcfg.gen_length, prompt_bucket)
        if draws is None:
            draws = Draws(key=jnp.asarray(row_keys([seed] * len(ids), range(len(ids)))))
        sampler = EntropyBoundSettings.of(dcfg)
        run = self._on_devices(prepare(self.config, prompt_ids, prompt_mask.astype(bool), sampler, draws))
        program = sampler.program()
        key = ("decode", prompt_ids.shape, program, draws.key is None, dcfg.trace)
        compiled, compile_seconds = self.placement.kept(
            key, lambda: compile_decode(self.graphdef, self.params, run, program, dcfg.trace)
        )
        for _ in range(2 if warm and compile_seconds else 1):
            start = time.perf_counter()
            out = jax.block_until_ready(compiled(self.params, *run.inputs))
            seconds = time.perf_counter() - start
        return self._generations(run.finish(out), seconds, compile_seconds)

    def _on_devices(self, run: Prepared) -> Prepared:
        """``run``'s inputs with their rows split over the mesh (``sharding.batch_sharding``): the
        prompts and mask [B, P], the draws' keys [B, 2] or recorded ids [n, B, C]."""
        if self.mesh is None:
            return run
        ids, valid, draws, values = run.inputs
        by_step = NamedSharding(self.mesh, PartitionSpec(None, *batch_sharding(self.mesh, ids.shape[0]).spec))
        draws = Draws(
            key=self.placed(draws.key)[0],
            **{
                name: None if getattr(draws, name) is None else jax.device_put(getattr(draws, name), by_step)
                for name in ("init", "sample", "renoise")
            },
        )
        return dataclasses.replace(run, inputs=(*self.placed(ids, valid), draws, *self.placed(values)))

    def placed(self, *trees: Any, whole: bool = False) -> tuple[Any, ...]:
        """A session's host arrays (row-major [B, ...], or pytrees of them) as its programs take
        them: as they are on one device; on the mesh, global arrays with their rows split as
        ``sharding.batch_sharding`` says (``whole``: every device holds them whole), each process
        placing its own devices' shards (every process passes the same values)."""
        if self.mesh is None:
            return trees
        whole_sharding = NamedSharding(self.mesh, PartitionSpec())

        def put(x):
            return jax.device_put(x, whole_sharding if whole else batch_sharding(self.mesh, x.shape[0]))

        return tuple(jax.tree.map(put, tree) for tree in trees)

    def _generations(self, decoded: Decoded, seconds: float, compile_seconds: float) -> list[Generation]:
        ids = decoded.output_ids
        tokens = tokens_before_stop(ids, self.config.stop_ids)
        return [
            Generation(
                output_ids=ids[row].tolist(),
                text=self.decode_text(ids[row].tolist()),
                nfe=int(decoded.row_nfe[row]),
                sequence_forwards=decoded.nfe * ids.shape[0],
                tokens=int(tokens[row]),
                tpf=float(tokens[row]) / max(int(decoded.row_nfe[row]), 1),
                seconds=seconds,
                compile_seconds=compile_seconds,
                stats={
                    "decoder_passes": int(decoded.decoder_passes[row]),
                    "generated_ids": int((ids[row] != self.config.pad_id).sum()),
                    "canvases": decoded.canvases,
                    # upstream's: ids other than pad (an end-of-sequence id included) per pass
                    "tokens_per_forward": float((ids[row] != self.config.pad_id).sum())
                    / max(int(decoded.decoder_passes[row]), 1),
                },
                iterations=decoded.nfe,
                trace=None if decoded.trace is None else settled_trace(decoded, row, self.config.eos_ids),
            )
            for row in range(ids.shape[0])
        ]


def settled_trace(decoded: Decoded, row: int, eos_ids: Sequence[int]) -> dict[str, Any]:
    """One row's trace (``core.records.row_trace``'s fields) from the sampler's per-step records:
    DiffusionGemma re-decides every position of its canvas at every step, so a position's ``step``
    is the row's step from which its argmax stayed the token it ends with (``kind`` "settled"),
    counted over the row's steps across canvases (1 .. its ``nfe``); 0 for the padding after its
    first end-of-sequence id (``eos_ids``). Nothing is rewritten afterwards: ``first`` is the output, ``rewritten`` 0."""
    out = decoded.output_ids[row]
    canvas = decoded.trace["canvas_index"]  # [steps] the canvas each step of the batch denoised
    argmax = decoded.trace["argmax"][:, row]  # [steps, C]
    steps = int(decoded.row_nfe[row])
    width = argmax.shape[1]
    settled = np.zeros(out.shape, np.int64)
    for k in range(len(out) // width):
        at = np.flatnonzero(canvas[:steps] == k)  # the row's steps of canvas k
        if not at.size:
            continue
        same = argmax[at] == argmax[at[-1]]  # [n, C]: each step's argmax already the final token
        trailing = np.flip(np.cumprod(np.flip(same, 0), 0), 0).sum(0)  # steps it has stayed, to the end
        settled[k * width : (k + 1) * width] = at[len(at) - trailing] + 1
    is_end = np.isin(out, np.asarray(eos_ids))
    ended = np.arange(len(out)) > (np.argmax(is_end) if is_end.any() else len(out))
    return row_trace(np.where(ended, 0, settled), np.where(ended, 0, SETTLED), out, np.zeros_like(out))


def read_draws(spec: str) -> Draws:
    """Recorded draws from ``FILE:PREFIX``: the safetensors file's ``PREFIX.init_canvas``
    [canvases, batch, canvas], ``PREFIX.sample`` and ``PREFIX.renoise`` [steps, batch, canvas]
    (upstream's ``randint`` at each canvas start, and its ``multinomial`` and re-noising
    ``randint`` at each step, in order: the layout of the goldens). Errors name the file and key."""
    file, sep, prefix = spec.rpartition(":")
    if not sep or not file or not prefix:
        raise InputError(f"replay draws must be given as FILE:PREFIX, got {spec!r}")
    if not Path(file).is_file():
        raise InputError(f"replay draws: {file} is not a file")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"replay draws: {file} is not a safetensors file ({exc})") from None
    missing = [f"{prefix}.{name}" for name in DRAW_NAMES if f"{prefix}.{name}" not in tensors]
    if missing:
        raise InputError(f"replay draws: {file} has no {', '.join(missing)}")
    arrays = []
    for name in DRAW_NAMES:
        value = tensors[f"{prefix}.{name}"]
        if value.dtype.kind not in "iu":
            raise InputError(f"replay draws: {prefix}.{name} holds {value.dtype}, not token ids")
        arrays.append(value)
    return Draws.replay(*arrays)


def load_diffusion_gemma(
    path: Path,
    cfg: DiffusionGemmaConfig,
    dtype,
    tokenizer_loader,
    mesh: Mesh | None = None,
    quantize: str | None = None,
) -> LoadedDiffusionGemma:
    """The checkpoint at ``path`` (Hugging Face safetensors) in ``dtype``, with its tokenizer; with
    ``mesh``, each parameter placed into its shards as it is read (``sharding.param_shardings``:
    heads, MLP units and the vocabulary over ``model``, experts over ``expert``); ``quantize``:
    the projections and experts as qwix integers and scales (``DiffusionGemma.from_params``)."""
    shardings = None if mesh is None else param_shardings(cfg, mesh)
    model = DiffusionGemma.from_params(cfg, read_params(path, cfg), dtype=dtype, shardings=shardings, quantize=quantize)
    return LoadedDiffusionGemma(model, tokenizer_loader(path, cfg.family), path, mesh)
