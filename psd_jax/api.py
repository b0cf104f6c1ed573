"""Public API: ``load_model(path)`` -> ``LoadedModel`` with ``logits`` and ``generate``.

``generate`` left-pads a batch of prompts to a bucketed length (so prompts of different lengths
reuse one compiled loop), compiles ahead of time once per (batch, padded length, settings) and
reports compilation separately from decoding time.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from convert.hf import load_hf_model
from convert.orbax_io import is_orbax_dir, load_checkpoint
from convert.safetensors_dir import INDEX_FILE, SINGLE_FILE, CheckpointError
from models import DiffusionLM, ModelConfig, load_config
from models.config import DTYPE_NAMES
from models.quantize import check_quantize
from models.transformer import default_unroll_layers

from .core import rules
from .core.block_decode import BlockDecode
from .core.calls import call_records
from .core.config import DecodeConfig, DecodeConfigError, check_for_model, merged_fields, settings_from
from .core.engine import decode
from .core.errors import InputError
from .core.layouts import layout_type
from .core.lengths import check_context
from .core.records import DecodeOutput, Generation, generations
from .core.runtime import Program, RowValues, row_keys
from .parallel.multihost import process_count, to_host
from .parallel.sharding import batch_sharding, make_mesh, param_shardings
from .recommended import named_settings
from .tokenizer import TokenizerError, encode_prompt, load_tokenizer, resolve_special_ids

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"
DTYPES = {name: getattr(jnp, name) for name in DTYPE_NAMES}


def default_model_path() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the shipped default model is missing ({DEFAULT_MODEL_DIR / 'config.json'}); "
            "pass --model PATH to a model directory"
        )
    return DEFAULT_MODEL_DIR


def model_directory(path: str | Path | None) -> Path:
    """The directory ``load_model`` reads (``None``: the shipped model), checked without reading any
    weights: it exists, has a ``config.json`` and has weights (safetensors or a converted
    checkpoint). Front ends call this first, so a wrong path fails before any other work."""
    path = Path(path) if path is not None else default_model_path()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: not a model directory (no config.json)")
    if not (is_orbax_dir(path) or (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()):
        raise CheckpointError(
            f"{path}: no weights: neither a Hugging Face safetensors directory ({SINGLE_FILE} or {INDEX_FILE}) "
            "nor a converted checkpoint"
        )
    return path


DECODE_DEFAULTS_FILE = "decode_defaults.json"
DECODE_DEFAULT_KEYS = ("gen_length", "block_length")


def decode_defaults(path: str | Path) -> dict[str, int]:
    """The generation/block length a model directory declares it was trained for (may be empty).

    A small model trained on fixed-length answers (the shipped one: 48 tokens in blocks of 16)
    decodes well only at that length, so its directory says so and the CLI and benchmark default
    to it.
    """
    file = Path(path) / DECODE_DEFAULTS_FILE
    if not file.is_file():
        return {}
    values = json.loads(file.read_text())
    unknown = sorted(set(values) - set(DECODE_DEFAULT_KEYS))
    if unknown:
        raise ValueError(f"{file}: unknown keys {unknown}; allowed: {', '.join(DECODE_DEFAULT_KEYS)}")
    return {key: int(value) for key, value in values.items()}


def model_settings(
    model_dir: str | Path | None, fields: dict[str, Any] | None = None, base: dict[str, Any] | None = None
) -> DecodeConfig:
    """The settings of a decode on ``model_dir``: ``fields`` (``DecodeConfig`` fields a user set)
    over ``base`` (a named setting: ``recommended.named_settings``) over the directory's
    ``decode_defaults.json`` over ``DecodeConfig``'s own defaults; so a block length in ``base``
    (the one a tuner chose) wins over the directory's but not over a user's. A block length not
    given falls back to min(32, gen_length). ``fields`` apply to ``base`` as
    ``config.settings_from`` does: ``decoder="rps"`` over a PSD base drops the base's depth.

    Every front end (CLI, benchmark, evaluation, server) builds its settings here."""
    fields = {k: v for k, v in (fields or {}).items() if v is not None}
    base = dict(base or {})
    defaults = decode_defaults(model_dir) if model_dir is not None and Path(model_dir).is_dir() else {}
    lengths = {
        **defaults,
        **{k: base.pop(k) for k in DECODE_DEFAULT_KEYS if k in base},
        **{k: fields.pop(k) for k in DECODE_DEFAULT_KEYS if k in fields},
    }
    if "block_length" not in lengths:
        gen_length = lengths.get("gen_length", DecodeConfig.gen_length)
        if isinstance(gen_length, int) and gen_length > 0:
            lengths["block_length"] = min(DecodeConfig.block_length, gen_length)
    try:
        return DecodeConfig(**merged_fields({**base, **lengths}, fields))
    except TypeError as exc:  # an unknown field name
        raise DecodeConfigError(f"unknown decoding setting: {exc}") from None


def checked_settings(
    model_dir: Path, fields: dict[str, Any] | None = None, name: str | None = None
) -> tuple[DecodeConfig, ModelConfig]:
    """A front end's start: its settings on ``model_dir`` (``model_settings``: ``fields`` over the
    named setting ``name``), checked against the model's config before the weights load (a bad
    length or option is one line, not minutes later); and that config."""
    settings = model_settings(model_dir, fields, named_settings(name, model_dir))
    mcfg = load_config(model_dir)
    check_for_model(settings, mcfg)
    return settings, mcfg


SEED_LIMIT = 2**32  # jax.random.key takes an unsigned 32-bit seed without 64-bit mode


def check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
        raise InputError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def check_prompt_bucket(bucket: int | None) -> None:
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise InputError(f"prompt_bucket must be a positive integer or None, got {bucket!r}")


def left_pad(
    ids: list[list[int]], cfg: ModelConfig, gen_length: int, bucket: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-padded with the pad id to a bucketed length, and their attention mask [B, P]."""
    length = check_context(max(len(p) for p in ids), bucket, gen_length, cfg.max_length)
    prompt_ids = np.full((len(ids), length), cfg.pad_id, np.int32)
    prompt_mask = np.zeros((len(ids), length), np.int32)
    for row, p in enumerate(ids):
        prompt_ids[row, length - len(p) :] = p
        prompt_mask[row, length - len(p) :] = 1
    return prompt_ids, prompt_mask


def token_ids(prompt: Any, what: str) -> list[int]:
    """A token-id prompt as a list of ints: integers only (``numpy`` integers too), never a float,
    string or bool silently turned into an id (``int(1.9)`` would be 1)."""
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence | np.ndarray):
        raise InputError(f"{what} must be text or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
    if bad:
        raise InputError(f"{what} has token ids that are not integers: {bad[:5]!r}")
    return [int(t) for t in prompt]


class PromptIO:
    """Text <-> ids for a model with ``config``, ``tokenizer`` and ``path`` (shared by both backends)."""

    config: ModelConfig
    tokenizer: Any
    path: Path

    def settings(self, settings: DecodeConfig | None = None, overrides: dict[str, Any] | None = None) -> DecodeConfig:
        """The settings ``generate`` decodes with: ``settings`` (default ``DecodeConfig()``) with
        keyword ``overrides`` applied, checked against the model (RPS reads the top ``k_max`` of the
        vocabulary); raises ``DecodeConfigError`` (front ends refuse bad requests before queueing)."""
        if settings is not None and not isinstance(settings, DecodeConfig):
            raise InputError(f"settings must be a DecodeConfig, got {type(settings).__name__}")
        dcfg = settings_from(settings or DecodeConfig(), overrides or {})
        check_for_model(dcfg, self.config)
        return dcfg

    def request(
        self, prompts, settings, overrides: dict[str, Any], seed: int, chat: bool | None, prompt_bucket: int | None
    ) -> tuple[DecodeConfig, list[list[int]]]:
        """Every check of a ``generate`` call before any model work: (settings, prompt ids)."""
        dcfg = self.settings(settings, overrides)
        check_seed(seed)
        check_prompt_bucket(prompt_bucket)
        return dcfg, self.prompt_ids(prompts, chat)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def uses_chat(self, prompt: str | Sequence[int], chat: bool | None) -> bool:
        """Whether ``prompt`` is wrapped in the chat template: ``chat=None`` (the default of every
        front end) means yes exactly when the prompt is text and the tokenizer has a template;
        token ids are never templated."""
        if not isinstance(prompt, str):
            return False
        return self.has_chat_template if chat is None else bool(chat)

    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path}: this checkpoint has no tokenizer; pass token ids instead of text")
        return encode_prompt(self.tokenizer, prompt, self.uses_chat(prompt, chat), str(self.path))

    def decode_text(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        stop = set(self.config.stop_ids)
        cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
        return self.tokenizer.decode(list(ids[:cut]), skip_special_tokens=False)

    def prompt_ids(self, prompts: Sequence[str | Sequence[int]], chat: bool | None = None) -> list[list[int]]:
        """The token ids ``generate`` decodes, checked (non-empty, in the vocabulary)."""
        if isinstance(prompts, (str, bytes)):
            raise InputError("prompts must be a list of prompts (text or token-id lists), not one string")
        out = []
        for i, prompt in enumerate(prompts):
            ids = self.encode(prompt, chat) if isinstance(prompt, str) else token_ids(prompt, f"prompt {i}")
            if not ids:
                raise InputError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InputError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
                )
            out.append(ids)
        if not out:
            raise InputError("no prompts given")
        return out


class LoadedModel(PromptIO):
    """A model, its config (special ids resolved) and tokenizer (``None`` if the checkpoint has none)."""

    def __init__(self, model: DiffusionLM, tokenizer, path: Path, mesh: Mesh | None = None):
        self.model = model
        self.mesh = mesh  # parameters are sharded over it (see psd_jax.parallel.sharding); None = one device
        self.tokenizer = tokenizer
        self.path = path
        self.config: ModelConfig = resolve_special_ids(model.config, tokenizer, str(path))
        self.graphdef, self.params = nnx.split(model)
        self._compiled: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self.max_programs: int | None = None  # compiled programs kept (least recently used out); None: all
        self._forward = jax.jit(lambda params, ids, mask: nnx.merge(self.graphdef, params)(ids, mask))

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
        ids, mask = self._on_devices(ids, mask)  # rows over the mesh as decoding splits them
        # Under the mesh, as decoding: the expert-parallel MoE path is chosen when tracing sees it.
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
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
        are the same, and ``compile_seconds`` is still the compile's."""
        dcfg, ids = self.request(prompts, settings, overrides, seed, chat, prompt_bucket)
        rows = range(len(ids))
        inputs = (*left_pad(ids, self.config, dcfg.gen_length, prompt_bucket), row_keys([seed] * len(ids), rows))
        args = (self.params, *self._on_devices(*inputs, RowValues.of([dcfg] * len(ids))))
        compiled, compile_seconds = self._compile_with(decode, ("decode", args[1]), args, Program.of(dcfg))
        for _ in range(2 if warm and compile_seconds else 1):
            start = time.perf_counter()
            out: DecodeOutput = jax.block_until_ready(compiled(*args))
            seconds = time.perf_counter() - start
        return self._results(out, args[1].shape[1], seconds, compile_seconds, Program.of(dcfg))

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
        checked = [self.settings(s) for s in settings]
        for seed in seeds:
            check_seed(seed)
        ids = self.prompt_ids(prompts)
        return self._start_rows(ids, checked, row_keys(seeds, [0] * len(ids)), batch_size, prompt_bucket, gen_length)

    def _start_rows(self, ids, settings, keys, batch_size, prompt_bucket, gen_length) -> BlockDecode:
        rows = batch_size or len(ids)
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < len(ids):
            raise InputError(f"batch_size must be an integer >= the {len(ids)} prompts, got {batch_size!r}")
        canvas = settings[0].gen_length if gen_length is None else gen_length
        try:
            programs = {Program.of(s, canvas) for s in settings}
        except ValueError as exc:
            raise InputError(f"gen_length {gen_length!r}: {exc}") from None
        if len(programs) > 1:
            raise InputError("the rows' settings differ in more than runtime values: they need separate batches")
        padding = rows - len(ids)
        prompt_ids, prompt_mask = left_pad(ids + [ids[0]] * padding, self.config, canvas, prompt_bucket)
        values = RowValues.of(list(settings) + [settings[0]] * padding)
        run = BlockDecode(self, programs.pop(), prompt_ids, prompt_mask, values)
        run.start(np.concatenate([keys, np.repeat(keys[:1], padding, axis=0)]), np.arange(rows) < len(ids))
        return run

    def _on_devices(self, *arrays: Any) -> tuple[Any, ...]:
        """Row-major arrays [B, ...] or pytrees of them (prompts, masks, keys, ``RowValues``;
        ``None`` passes through) as device arrays, rows split over the mesh as ``batch_sharding``
        says."""
        arrays = tuple(None if a is None else jax.tree.map(jnp.asarray, a) for a in arrays)
        if self.mesh is None:
            return arrays
        rows = batch_sharding(self.mesh, arrays[0].shape[0])
        return tuple(None if a is None else jax.tree.map(lambda x: jax.device_put(x, rows), a) for a in arrays)

    def _replicated(self, array: Any) -> jax.Array:
        """A small array every device holds whole (on a mesh: every process's devices)."""
        array = jnp.asarray(array)
        return array if self.mesh is None else jax.device_put(array, NamedSharding(self.mesh, PartitionSpec()))

    @property
    def compiled_programs(self) -> int:
        """How many decode programs this model holds compiled (one per name, input shapes and the
        settings that select a program: ``runtime.Program``); at most ``max_programs``."""
        return len(self._compiled)

    def clear_programs(self) -> None:
        """Drop every compiled program. Each XLA:CPU program holds a few hundred memory mappings of
        its code, freed once nothing holds the program; a process that compiles thousands (a test
        suite, a notebook sweeping shapes) runs into the kernel's limit on mappings per process
        (``vm.max_map_count``, often 65530) unless it drops them."""
        self._compiled.clear()

    def _compile_with(self, fn, shapes: tuple, args: tuple, program: Program):
        """``fn`` compiled ahead of time for ``args`` (cached by name, input shapes and settings;
        the least recently used program is dropped beyond ``max_programs``)."""
        cache_key = (shapes[0], *(a.shape for a in shapes[1:]), program, self.config)
        if cache_key in self._compiled:
            self._compiled.move_to_end(cache_key)
            return self._compiled[cache_key], 0.0
        began = time.perf_counter()
        # Under the mesh, the engine pins the KV cache's sharding (sharding.constrain_kv_cache).
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            compiled = fn.lower(self.graphdef, *args, mcfg=self.config, program=program).compile()
        self._compiled[cache_key] = compiled
        while self.max_programs is not None and len(self._compiled) > self.max_programs:
            self._compiled.popitem(last=False)
        return compiled, time.perf_counter() - began

    def _results(
        self,
        out: DecodeOutput,
        prompt_length: int,
        seconds: float,
        compile_seconds: float,
        program: Program | None = None,
    ):
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


def load_model(
    path: str | Path | None = None,
    dtype: str = "float32",
    mesh: Mesh | str | None = None,
    unroll_layers: bool | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Load a Hugging Face directory or a converted (Orbax) checkpoint; ``None`` = the shipped model.

    ``quantize="int8"`` or ``"int4"`` stores the layers' projection weights as integers with
    scales (``models.quantize``: weight-only, through qwix); activations stay in ``dtype``.

    With ``mesh`` (a ``jax.sharding.Mesh`` or a spec like ``"data=2,model=4"``) each parameter is
    placed straight into its shards as it is read, so no device ever holds the whole model.
    ``unroll_layers=True`` keeps each layer's weights in arrays of their own and unrolls the layer
    loop, ``False`` runs them with ``lax.scan`` over stacked weights; ``None`` picks the backend's
    layout (``models.transformer.default_unroll_layers``: unrolled on CPU only).
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    check_quantize(quantize, on_mesh=mesh is not None or process_count() > 1)
    path = model_directory(path)
    if isinstance(mesh, str) or (mesh is None and process_count() > 1):
        mesh = make_mesh(mesh)  # several processes: by default one mesh over all of their devices
    shardings = None
    if mesh is not None:
        shardings = param_shardings(load_config(path), mesh)
    if unroll_layers is None:
        unroll_layers = default_unroll_layers()
    if is_orbax_dir(path):
        model = load_checkpoint(path, DTYPES[dtype], shardings, unroll_layers, quantize)
    else:
        model = load_hf_model(path, DTYPES[dtype], shardings, unroll_layers, quantize)
    tokenizer = load_tokenizer(path, model.config.family)
    return LoadedModel(model, tokenizer, path, mesh)
