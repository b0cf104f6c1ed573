"""Public API: ``load_model(path)`` -> ``LoadedModel`` with ``logits`` and ``generate``.

``generate`` left-pads a batch of prompts to a bucketed length (so prompts of different lengths
reuse one compiled loop), compiles ahead of time once per (batch, padded length, settings) and
reports compilation separately from decoding time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from convert.hf import load_hf_model
from convert.orbax_io import is_orbax_dir, load_checkpoint
from models import DiffusionLM, load_config
from models.config import DTYPE_NAMES
from models.quantize import check_quantize
from models.transformer import default_unroll_layers

from .core.block_decode import BlockDecode
from .core.config import ENTROPY_BOUND_FAMILY, DecodeConfig
from .core.engine import decode
from .core.errors import InputError
from .core.placed_model import PlacedModel, placed_attribute
from .core.records import DecodeOutput, Generation
from .core.runtime import Program, RowValues, row_keys
from .model_dir import model_directory
from .parallel.multihost import process_count
from .parallel.sharding import make_mesh, param_shardings
from .prompts import PromptIO, left_pad
from .tokenizer import load_tokenizer, resolve_special_ids

DTYPES = {name: getattr(jnp, name) for name in DTYPE_NAMES}


class LoadedModel(PromptIO):
    """A model, its config (special ids resolved) and tokenizer (``None`` if the checkpoint has none)."""

    def __init__(self, model: DiffusionLM, tokenizer, path: Path, mesh: Mesh | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        graphdef, params = nnx.split(model)
        config = resolve_special_ids(model.config, tokenizer, str(path))
        # Parameters on their devices (sharded over ``mesh``: psd_jax.parallel.sharding; None = one
        # device), the config and the compiled programs: what the compiled decode needs.
        self.placed = PlacedModel(graphdef, params, config, mesh, self.decode_text)
        self._forward = jax.jit(lambda params, ids, mask: nnx.merge(self.graphdef, params)(ids, mask))

    # The placed model's, read and set here as a loaded model's own.
    config = placed_attribute("config", "the model's config, special ids resolved (``ModelConfig``)")
    graphdef = placed_attribute("graphdef", "the model's graph (``nnx.split``)")
    params = placed_attribute("params", "the model's parameters (``nnx.split``), on their devices")
    mesh = placed_attribute("mesh", "the mesh the parameters are sharded over; ``None``: one device")
    max_programs = placed_attribute("max_programs", "compiled programs kept (least recently used out); ``None``: all")

    # ------------------------------------------------------------------------------ logits
    def logits(self, input_ids, attention_mask=None) -> jax.Array:
        """Raw (unshifted) model outputs [B, N, V] in float32 (on several processes an array over
        all of their devices: ``psd_jax.parallel.multihost.to_host`` brings it to each)."""
        ids = jnp.asarray(input_ids, jnp.int32)
        if ids.ndim != 2:
            raise InputError(f"input_ids must be [batch, length], got shape {ids.shape}")
        if ids.shape[1] > self.config.max_length:
            raise InputError(f"input length {ids.shape[1]} exceeds the model's context of {self.config.max_length}")
        if int(ids.max()) >= self.config.vocab_size or int(ids.min()) < 0:
            raise InputError(
                f"token ids must be in [0, {self.config.vocab_size}), got {int(ids.min())}..{int(ids.max())}"
            )
        mask = None if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
        ids, mask = self.placed.on_devices(ids, mask)  # rows over the mesh as decoding splits them
        # Under the mesh, as decoding: the expert-parallel MoE path is chosen when tracing sees it.
        with self.placed.under_mesh():
            return self._forward(self.params, ids, mask)

    # --------------------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        settings: DecodeConfig | None = None,
        *,
        seed: int = 0,
        chat: bool | None = None,
        prompt_bucket: int | None = 32,
        warm: bool = False,
        **overrides: Any,
    ) -> list[Generation]:
        """Decode a batch of prompts (text or token ids); one ``Generation`` per prompt.

        ``chat=None``: text prompts go through the tokenizer's chat template when it has one
        (``uses_chat``); ``overrides`` are ``DecodeConfig`` fields applied to ``settings``.
        ``warm=True`` times a warm executable: a decode that had to compile is run a second time and
        that run's ``seconds`` are reported (an executable's first run carries one-off costs, on
        XLA:CPU about 0.8 s for the shipped model, ten times a warm decode of 4 prompts); the tokens
        are the same, and ``compile_seconds`` is still the compile's. ``trace=True`` (a setting)
        records when and how each position was written (``Generation.trace``; ``core.trace``)."""
        dcfg, ids = self.request(prompts, settings, overrides, seed, chat, prompt_bucket)
        program = Program.of(dcfg)
        rows = range(len(ids))
        inputs = (*left_pad(ids, self.config, dcfg.gen_length, prompt_bucket), row_keys([seed] * len(ids), rows))
        args = (self.params, *self.placed.on_devices(*inputs, RowValues.of([dcfg] * len(ids))))
        compiled, compile_seconds = self.placed.compile_with(decode, ("decode", args[1]), args, program)
        for _ in range(2 if warm and compile_seconds else 1):
            start = time.perf_counter()
            out: DecodeOutput = jax.block_until_ready(compiled(*args))
            seconds = time.perf_counter() - start
        # The canvas holds whole blocks; a generation that ends inside its last (decoder "edit") is cut.
        out = out._replace(canvas=out.canvas[:, : args[1].shape[1] + dcfg.gen_length])
        return self.placed.results(out, args[1].shape[1], seconds, compile_seconds, program)

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
    ) -> BlockDecode:
        """Start decoding a batch block by block (streaming): ``BlockDecode.advance`` runs the loop to
        the next block boundary, so each finished block can be used while the next one decodes, and
        ``BlockDecode.join`` writes new prompts into finished rows (continuous batching).

        Same arguments and, greedy or with ``batch_size`` equal to the prompt count, the same tokens
        as ``generate``. ``batch_size`` pads the batch with rows that start done, so batches of any
        size up to it share one compiled loop (a server compiles a few sizes at start-up);
        ``gen_length`` is the canvas's generation length (default: the settings'), so that rows
        joining later may ask for up to that many positions."""
        dcfg, ids = self.request(prompts, settings, overrides, seed, chat, prompt_bucket)
        keys = row_keys([seed] * len(ids), range(len(ids)))
        return self._start_rows(ids, [dcfg] * len(ids), keys, batch_size, prompt_bucket, gen_length)

    def start_rows(
        self,
        prompts: Sequence[Sequence[int]],
        settings: Sequence[DecodeConfig],
        seeds: Sequence[int],
        *,
        batch_size: int | None = None,
        prompt_bucket: int | None = 32,
        gen_length: int | None = None,
    ) -> BlockDecode:
        """``start_blocks`` with each row's own settings (all of one compiled program:
        ``runtime.Program``) and seed: row r draws as ``generate([prompts[r]],
        settings[r], seed=seeds[r])``'s only row does (a server's requests)."""
        checked, ids, keys = self.row_requests(prompts, settings, seeds)
        return self._start_rows(ids, checked, keys, batch_size, prompt_bucket, gen_length)

    def _start_rows(self, ids, settings, keys, batch_size, prompt_bucket, gen_length) -> BlockDecode:
        rows = batch_size or len(ids)
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < len(ids):
            raise InputError(f"batch_size must be an integer >= the {len(ids)} prompts, got {batch_size!r}")
        # Whole blocks (a generation may end inside its last: decoder "edit").
        canvas = settings[0].num_blocks * settings[0].block_length if gen_length is None else gen_length
        try:
            programs = {Program.of(s, canvas) for s in settings}
        except ValueError as exc:
            raise InputError(f"gen_length {gen_length!r}: {exc}") from None
        if len(programs) > 1:
            raise InputError("the rows' settings differ in more than runtime values: they need separate batches")
        padding = rows - len(ids)
        prompt_ids, prompt_mask = left_pad(ids + [ids[0]] * padding, self.config, canvas, prompt_bucket)
        values = RowValues.of(list(settings) + [settings[0]] * padding)
        run = BlockDecode(self.placed, programs.pop(), prompt_ids, prompt_mask, values)
        run.start(np.concatenate([keys, np.repeat(keys[:1], padding, axis=0)]), np.arange(rows) < len(ids))
        return run

    @property
    def compiled_programs(self) -> int:
        """How many decode programs this model holds compiled (one per name, input shapes and the
        settings that select a program: ``runtime.Program``); at most ``max_programs``."""
        return len(self.placed.programs)

    def program_key(self, settings: DecodeConfig, gen_length: int) -> Program:
        """What rows sharing a batch share (``serve.session.BlockEngine``): ``runtime.Program``."""
        return Program.of(settings, gen_length)

    def clear_programs(self) -> None:
        """Drop every compiled program. Each XLA:CPU program holds a few hundred memory mappings of
        its code, freed once nothing holds the program; a process that compiles thousands (a test
        suite, a notebook sweeping shapes) runs into the kernel's limit on mappings per process
        (``vm.max_map_count``, often 65530) unless it drops them."""
        self.placed.clear_programs()


def _load_entropy_bound_model(path: Path, cfg, dtype: str, mesh, quantize: str | None):
    """DiffusionGemma (``diffusion_gemma_api``): weights in ``dtype`` (``quantize``: its
    projections and experts as qwix integers), on one device or a mesh (several processes: by
    default one mesh over all of their devices, as for the other families)."""
    from .diffusion_gemma_api import load_diffusion_gemma

    if isinstance(mesh, str) or (mesh is None and process_count() > 1):
        mesh = make_mesh(mesh)
    return load_diffusion_gemma(path, cfg, DTYPES[dtype], load_tokenizer, mesh, quantize)


def load_model(
    path: str | Path | None = None,
    dtype: str = "float32",
    mesh: Mesh | str | None = None,
    unroll_layers: bool | None = None,
    quantize: str | None = None,
) -> LoadedModel | Any:
    """Load a Hugging Face directory or a converted (Orbax) checkpoint; ``None`` = the shipped model.

    ``quantize="int8"`` or ``"int4"`` stores the layers' projection weights as integers with
    scales (``models.quantize``: weight-only, through qwix); activations stay in ``dtype``.

    With ``mesh`` (a ``jax.sharding.Mesh`` or a spec like ``"data=2,model=4"``) each parameter is
    placed straight into its shards as it is read, so no device ever holds the whole model.
    A DiffusionGemma directory gives a ``diffusion_gemma_api.LoadedDiffusionGemma`` (its
    entropy-bound sampler, one device, no quantization).
    ``unroll_layers=True`` keeps each layer's weights in arrays of their own and unrolls the layer
    loop, ``False`` runs them with ``lax.scan`` over stacked weights; ``None`` picks the backend's
    layout (``models.transformer.default_unroll_layers``: unrolled on CPU only).
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    check_quantize(quantize, on_mesh=mesh is not None or process_count() > 1)
    path = model_directory(path)
    mcfg = load_config(path)
    if mcfg.family == ENTROPY_BOUND_FAMILY:
        return _load_entropy_bound_model(path, mcfg, dtype, mesh, quantize)
    if isinstance(mesh, str) or (mesh is None and process_count() > 1):
        mesh = make_mesh(mesh)  # several processes: by default one mesh over all of their devices
    shardings = None
    if mesh is not None:
        shardings = param_shardings(mcfg, mesh)
    if unroll_layers is None:
        unroll_layers = default_unroll_layers()
    if is_orbax_dir(path):
        model = load_checkpoint(path, DTYPES[dtype], shardings, unroll_layers, quantize)
    else:
        model = load_hf_model(path, DTYPES[dtype], shardings, unroll_layers, quantize)
    tokenizer = load_tokenizer(path, model.config.family)
    return LoadedModel(model, tokenizer, path, mesh)
