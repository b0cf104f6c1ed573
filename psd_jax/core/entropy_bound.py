"""DiffusionGemma's sampler (transformers' ``DiffusionGemmaGenerationMixin.generate`` with its
``EntropyBoundSampler``), as one compiled loop: canvases in an outer ``lax.while_loop``, denoising
steps in an inner one, static shapes throughout, rows finishing apart.

Per canvas: encode what came before (the prompt, then each finished canvas, into a cache laid out
for every canvas the decode may run), draw a canvas of uniformly random ids, then for
``n = N .. 1``: denoise (self-conditioned on the previous step's processed logits), divide by the
temperature ``t_min + (t_max - t_min) * n / N``, sample every position, accept the lowest-entropy
positions whose entropies before them sum to at most ``entropy_bound``, re-noise the others; with
adaptive stopping a row stops once its argmax canvas equals that of its previous
``stability_threshold`` steps and its mean entropy is below ``confidence_threshold`` (a stopped row
keeps its argmax, canvas and logits). The canvas ends when every row has stopped or after N steps;
its output is the last argmax. A canvas holding an end-of-sequence id ends its row: the ids after
the first one become pad, and the row's later canvases are all pad (still computed in the batch,
as upstream does, but not counted in its ``decoder_passes``). The decode ends when every row has
ended or after ``ceil(gen_length / canvas_length)`` canvases.

Random draws come from ``Draws``: the engine's own (``Draws.from_seed``: a PRNG key per row) or an
upstream run's, recorded (``Draws.replay``: the ``randint`` of each canvas start, the
``multinomial`` and the re-noising ``randint`` of each step, in upstream's order), so that a run of
transformers' ``generate`` is reproduced bit for bit. Nothing is greedy: upstream has no greedy mode.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.diffusion_gemma import Cache, DiffusionGemma, write_rows

from ..parallel.multihost import to_host
from .config import DecodeConfig, DecodeConfigError
from .errors import InputError


@dataclasses.dataclass(frozen=True)
class EntropyBoundSettings:
    """Upstream ``generate``'s arguments of the same names; ``gen_length`` is ``max_new_tokens``
    (rounded up to whole canvases). ``stability_threshold`` or ``confidence_threshold`` None: no
    adaptive stopping (every canvas runs its N steps)."""

    gen_length: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int | None = 1
    confidence_threshold: float | None = 0.005

    def __post_init__(self) -> None:
        """Values upstream's ``generate`` could not run, refused by name (``DecodeConfigError``)."""
        for name in ("gen_length", "max_denoising_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DecodeConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("entropy_bound", "t_min", "t_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DecodeConfigError(f"{name} must be a finite number, got {value!r}")
        if self.entropy_bound < 0:
            raise DecodeConfigError(f"entropy_bound must be >= 0, got {self.entropy_bound}")
        if not 0 < self.t_min <= self.t_max:
            raise DecodeConfigError(
                f"the temperatures must satisfy 0 < t_min <= t_max, got t_min={self.t_min}, t_max={self.t_max}"
            )
        stability, confidence = self.stability_threshold, self.confidence_threshold
        if (stability is None) != (confidence is None):
            raise DecodeConfigError(
                "adaptive stopping needs both stability_threshold and confidence_threshold (or neither)"
            )
        if stability is not None and (isinstance(stability, bool) or not isinstance(stability, int) or stability < 0):
            raise DecodeConfigError(f"stability_threshold must be an integer >= 0, got {stability!r}")
        if confidence is not None and (
            isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not math.isfinite(confidence)
        ):
            raise DecodeConfigError(f"confidence_threshold must be a finite number, got {confidence!r}")

    @classmethod
    def of(cls, settings: DecodeConfig) -> EntropyBoundSettings:
        """The sampler's settings in a ``DecodeConfig`` (``config.ENTROPY_BOUND_FIELDS``; its
        ``confidence_threshold`` 0 is upstream's None: no adaptive stopping)."""
        stopping = settings.confidence_threshold > 0
        return cls(
            gen_length=settings.gen_length,
            max_denoising_steps=settings.max_denoising_steps,
            entropy_bound=float(settings.entropy_bound),
            t_min=float(settings.t_min),
            t_max=float(settings.t_max),
            stability_threshold=settings.stability_threshold if stopping else None,
            confidence_threshold=float(settings.confidence_threshold) if stopping else None,
        )

    def program(self) -> SamplerProgram:
        """What a compiled program of these settings fixes (its cache key): the values that set
        shapes or code, not the entropy bound, the temperatures or the stopping confidence."""
        return SamplerProgram(
            self.gen_length, self.max_denoising_steps, self.stability_threshold if self.adaptive else None
        )

    def replace_length(self, gen_length: int) -> EntropyBoundSettings:
        """These settings for ``gen_length`` new tokens (a batch's program: its longest row's)."""
        return dataclasses.replace(self, gen_length=gen_length)

    def canvases(self, canvas_length: int) -> int:
        return math.ceil(self.gen_length / canvas_length)

    @property
    def adaptive(self) -> bool:
        return self.stability_threshold is not None and self.confidence_threshold is not None

    def temperatures(self) -> np.ndarray:
        """T at each n = 0 .. N (index n), computed as upstream does in float32."""
        n = np.arange(self.max_denoising_steps + 1, dtype=np.float32)
        ratio = n / np.float32(self.max_denoising_steps)
        return np.float32(self.t_min) + np.float32(self.t_max - self.t_min) * ratio


@dataclasses.dataclass(frozen=True)
class SamplerProgram:
    """The static part of ``EntropyBoundSettings``: one compiled program each. ``stability_threshold``
    None: no adaptive stopping (its code left out)."""

    gen_length: int
    max_denoising_steps: int
    stability_threshold: int | None

    def canvases(self, canvas_length: int) -> int:
        return math.ceil(self.gen_length / canvas_length)

    @property
    def adaptive(self) -> bool:
        return self.stability_threshold is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerValues:
    """The runtime part of ``EntropyBoundSettings``, one row each, so that rows of different
    bounds, temperatures or stopping confidences share a program: ``entropy_bound`` [B], each
    step's temperature ``temperatures`` [B, N + 1] (computed on the host exactly as upstream does)
    and ``confidence`` [B] (0: the row never stops early)."""

    entropy_bound: jax.Array
    temperatures: jax.Array
    confidence: jax.Array

    @classmethod
    def of(cls, rows: Sequence[EntropyBoundSettings]) -> SamplerValues:
        return cls(
            entropy_bound=np.asarray([r.entropy_bound for r in rows], np.float32),
            temperatures=np.stack([r.temperatures() for r in rows]),
            confidence=np.asarray([r.confidence_threshold or 0.0 for r in rows], np.float32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draws:
    """Where the random ids come from. ``key`` [B, 2] (the engine's: one PRNG key per row, so a row
    draws the same whatever batch it is in) or the recorded ``init`` [K, B, C], ``sample`` and
    ``renoise`` [S, B, C] (S = every step the decode may run)."""

    key: jax.Array | None = None
    init: jax.Array | None = None
    sample: jax.Array | None = None
    renoise: jax.Array | None = None

    @classmethod
    def from_seed(cls, seeds: list[int]) -> Draws:
        return cls(key=jnp.stack([jax.random.key_data(jax.random.key(s)) for s in seeds]))

    @classmethod
    def replay(cls, init: np.ndarray, sample: np.ndarray, renoise: np.ndarray) -> Draws:
        return cls(init=jnp.asarray(init, jnp.int32), sample=jnp.asarray(sample, jnp.int32),
                   renoise=jnp.asarray(renoise, jnp.int32))  # fmt: skip

    def _keys(self, *path: jax.Array) -> jax.Array:
        """Each row's key folded with ``path`` (scalars, or [B]: each row's own canvas)."""

        def one(key, *parts):
            k = jax.random.wrap_key_data(key)
            for p in parts:
                k = jax.random.fold_in(k, p)
            return k

        rows = self.key.shape[0]
        return jax.vmap(one)(self.key, *(jnp.broadcast_to(p, (rows,)) for p in path))

    def initial(self, canvas: jax.Array, shape: tuple[int, int], vocab: int) -> jax.Array:
        if self.init is not None:
            return self.init[canvas]
        keys = self._keys(canvas, jnp.int32(-1))
        return jax.vmap(lambda k: jax.random.randint(k, shape[1:], 0, vocab, jnp.int32))(keys)

    def sampled(self, step: jax.Array, canvas: jax.Array, n: jax.Array, probs: jax.Array) -> jax.Array:
        """The sampled canvas of the batch's ``step``-th step (recorded), or of step ``n`` of
        canvas ``canvas`` (drawn from ``probs`` [B, C, V]: keyed by the row's place in its own
        decode, not the batch's; ``canvas`` a scalar or each row's own [B])."""
        if self.sample is not None:
            return self.sample[step]
        keys = self._keys(canvas, n, jnp.int32(0))
        return jax.vmap(lambda k, p: categorical(jax.random.uniform(k, p.shape[:-1]), p))(keys, probs)

    def renoised(
        self, step: jax.Array, canvas: jax.Array, n: jax.Array, shape: tuple[int, int], vocab: int
    ) -> jax.Array:
        if self.renoise is not None:
            return self.renoise[step]
        keys = self._keys(canvas, n, jnp.int32(1))
        return jax.vmap(lambda k: jax.random.randint(k, shape[1:], 0, vocab, jnp.int32))(keys)


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One decode: per row, the canvases' ids [B, K * C] (pad after the end), the denoiser calls
    while it decoded (``row_nfe``: the batch's calls until the row ended, upstream's ``nfe`` at
    batch 1) and those in which it was still denoising (``decoder_passes``: upstream's, per row),
    and the run's totals."""

    output_ids: np.ndarray
    decoder_passes: np.ndarray
    row_nfe: np.ndarray
    nfe: int  # denoiser calls of the batch
    canvases: int  # encoder calls after the prompt's, plus one: canvases run
    trace: dict[str, np.ndarray] | None = None


def probabilities_and_entropy(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """softmax(z) over the last axis and its entropy, in float32 (torch
    ``Categorical(logits=z).entropy()``); the probabilities are the ones the entropy sums."""
    # One exponential per entry (torch's softmax: exp(z - max) / sum), not one for the normaliser
    # and another for the probabilities.
    shifted = z - z.max(axis=-1, keepdims=True)
    e = jnp.exp(shifted)
    total = e.sum(axis=-1, keepdims=True)
    p = e / total
    logp = shifted - jnp.log(total)
    # A row-wise dot, not ``(p * logp).sum(-1)``: XLA's CPU backend ran that multiply-and-reduce
    # over [B, C, V] about 4x slower than the dot (docs/diffusion-gemma.md). HIGHEST: no bfloat16
    # passes on TPU, where the entropy decides acceptance.
    return p, -jnp.einsum("...v,...v->...", p, logp, precision=jax.lax.Precision.HIGHEST)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first maximum; the first NaN where there is one), int32, as
    a max and then a min over the indices that reach it: two plain reductions, which XLA's CPU
    backend vectorizes, where its (value, index) reduction over a [B, C, V] step took about 4x as
    long (docs/diffusion-gemma.md)."""
    top = x.max(axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1] - 1), axis=-1)


CDF_BLOCK = 128  # entries per block of ``categorical``'s two-level search


def categorical(u: jax.Array, probs: jax.Array) -> jax.Array:
    """One id per row of ``probs`` [..., V] (non-negative, not necessarily summing to 1), drawn by
    inverting the cumulative sum at ``u`` [...] (uniform in [0, 1)) times the row's total: id j
    with probability ``probs[j] / total``, never one of probability 0, int32.

    Why not ``jax.random.categorical``: its Gumbel noise is V random numbers and two logarithms per
    position, over a [B, C, V] step with V = 262,144 for DiffusionGemma, the most expensive part
    of a step's sampling on CPU; this takes one number per position and two short cumulative sums
    (over the row's blocks of ``CDF_BLOCK`` entries, then inside the chosen block)."""
    vocab = probs.shape[-1]
    padded = -(-vocab // CDF_BLOCK) * CDF_BLOCK
    if padded != vocab:
        probs = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, padded - vocab)])
    blocks = probs.reshape(*probs.shape[:-1], padded // CDF_BLOCK, CDF_BLOCK)
    block_mass = blocks.sum(-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cdf[..., -1]
    b = _first_above(block_cdf, target, block_mass)
    inside = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]
    before = jnp.take_along_axis(block_cdf - block_mass, b[..., None], axis=-1)[..., 0]
    j = _first_above(jnp.cumsum(inside, axis=-1), target - before, inside)
    return (b * CDF_BLOCK + j).astype(jnp.int32)


def _first_above(cumulative: jax.Array, target: jax.Array, mass: jax.Array) -> jax.Array:
    """The first index whose ``cumulative`` exceeds ``target`` among those of positive ``mass``;
    where rounding leaves none (a target at the very top), the last index of positive mass."""
    hit = (cumulative > target[..., None]) & (mass > 0)
    last = mass.shape[-1] - 1 - jnp.argmax(jnp.flip(mass > 0, axis=-1), axis=-1)
    return jnp.where(hit.any(-1), jnp.argmax(hit, axis=-1), last)


def accepted(h: jax.Array, bound) -> jax.Array:
    """Positions whose lower-entropy positions' entropies sum to at most ``bound`` (a number, or
    each row's [B]; the lowest is always accepted), per row of h [B, C]."""
    order = jnp.argsort(h, axis=-1, stable=True)
    sorted_h = jnp.take_along_axis(h, order, axis=-1)
    keep = jnp.cumsum(sorted_h, axis=-1) - sorted_h <= jnp.asarray(bound, jnp.float32).reshape(-1, 1)
    return jnp.zeros_like(keep).at[jnp.arange(h.shape[0])[:, None], order].set(keep)


def decode(
    model: DiffusionGemma,
    prompt_ids: jax.Array,
    prompt_valid: jax.Array,
    settings: EntropyBoundSettings,
    draws: Draws,
    *,
    trace: bool = False,
) -> Decoded:
    """Decode left-padded prompts [B, P] (``prompt_valid``: the real tokens) with ``settings``; one
    compiled program per shapes and ``settings.program()``."""
    graphdef, params = nnx.split(model)
    run = prepare(model.config, prompt_ids, prompt_valid, settings, draws)
    return run.finish(_decode(graphdef, params, *run.inputs, settings.program(), trace))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A decode's inputs, checked (``inputs``: prompt ids, mask, draws and the rows' sampler values,
    as ``_decode`` takes them), and what its results are checked against (``recorded``: the canvases
    and steps that replayed draws hold)."""

    inputs: tuple[jax.Array, jax.Array, Draws, SamplerValues]
    recorded: tuple[int, int] | None

    def finish(self, out: dict[str, Any]) -> Decoded:
        """The program's output as a ``Decoded``; a replay that ran past its recording is refused."""
        out = to_host(out)  # several processes: each gets the whole batch
        if self.recorded is not None and (
            int(out["canvases"]) > self.recorded[0] or int(out["nfe"]) > self.recorded[1]
        ):
            raise InputError(
                f"the decode ran {int(out['canvases'])} canvases and {int(out['nfe'])} steps; the recorded draws "
                f"hold {self.recorded[0]} and {self.recorded[1]}: it left the recorded run (other weights, prompt "
                "or settings)"
            )
        traced = {k[6:]: np.asarray(v) for k, v in out.items() if k.startswith("trace_")}
        return Decoded(
            output_ids=np.asarray(out["canvas_ids"]),
            decoder_passes=np.asarray(out["passes"]),
            row_nfe=np.asarray(out["row_nfe"]),
            nfe=int(out["nfe"]),
            canvases=int(out["canvases"]),
            trace=traced or None,
        )


def prepare(cfg, prompt_ids, prompt_valid, settings: EntropyBoundSettings, draws: Draws) -> Prepared:
    """Every check of a decode before any model work (prompts in the vocabulary and, with their
    canvases, in the context; recorded draws of the decode's shapes), and its inputs."""
    ids = np.asarray(prompt_ids)
    if ids.ndim != 2 or ids.shape[1] == 0 or np.asarray(prompt_valid).shape != ids.shape:
        raise InputError(f"prompt_ids must be [batch, length] with a prompt_valid mask of that shape, got {ids.shape}")
    if ((ids < 0) | (ids >= cfg.vocab_size)).any():
        raise InputError(f"prompt ids must be in [0, {cfg.vocab_size}) (the vocabulary)")
    end = ids.shape[1] + settings.canvases(cfg.canvas_length) * cfg.canvas_length
    if end > cfg.max_length:
        raise InputError(
            f"the prompt ({ids.shape[1]}) and its canvases ({end - ids.shape[1]}) exceed the model's context of {cfg.max_length}"
        )
    recorded = None
    if draws.key is None:
        for name, value in (("init_canvas", draws.init), ("sample", draws.sample), ("renoise", draws.renoise)):
            if value is not None and value.size and (int(value.min()) < 0 or int(value.max()) >= cfg.vocab_size):
                raise InputError(f"recorded draws '{name}' hold ids outside the vocabulary [0, {cfg.vocab_size})")
        draws, recorded = _padded_replay(
            draws, ids.shape[0], settings.canvases(cfg.canvas_length), settings.max_denoising_steps, cfg.canvas_length
        )
    values = jax.tree.map(jnp.asarray, SamplerValues.of([settings] * ids.shape[0]))
    return Prepared((jnp.asarray(ids, jnp.int32), jnp.asarray(prompt_valid, bool), draws, values), recorded)


def compile_decode(
    graphdef, params, run: Prepared, program: SamplerProgram, trace: bool = False, options: dict | None = None
):
    """The decode of ``run``'s shapes and ``program`` compiled ahead of time (``options``: the
    compiler's): call it with ``(params, *run.inputs)``, whatever the rows' sampler values.
    ``params`` and the inputs may be abstract (``jax.ShapeDtypeStruct``), for a memory analysis
    without weights."""
    return _decode.lower(graphdef, params, *run.inputs, program, trace).compile(compiler_options=options)


@jax.jit(static_argnames=("graphdef", "program", "trace"))
def _decode(
    graphdef,
    params,
    prompt_ids,
    prompt_valid,
    draws: Draws,
    values: SamplerValues,
    program: SamplerProgram,
    trace: bool,
) -> dict[str, Any]:
    model = nnx.merge(graphdef, params)
    cfg = model.config
    batch, prompt_length = prompt_ids.shape
    C, N = cfg.canvas_length, program.max_denoising_steps
    K = program.canvases(C)
    steps_max = K * N

    positions = jnp.broadcast_to(jnp.arange(prompt_length, dtype=jnp.int32), (batch, prompt_length))
    _, prompt_cache = model.encode(prompt_ids, positions, prompt_valid)
    cache = prompt_cache.for_decode(cfg, K * C)  # every canvas's slots, written as canvases finish

    def canvas_cond(c):
        return (c["k"] < K) & ~jnp.all(c["ended"])

    def canvas_body(c):
        k = c["k"]
        at = jnp.broadcast_to(prompt_length + k * C + jnp.arange(C, dtype=jnp.int32), (batch, C))
        counters = {name: c[name] for name in ("nfe", "passes", "row_nfe", "step")}
        a, counters, records = denoise_canvas(
            model, program, values, draws, c["cache"], at, k, c["ended"], jnp.zeros((batch,), bool), counters,
            c["records"], trace,
        )  # fmt: skip
        ids, ended, cache = finish_canvas(model, a, at, c["ended"], c["ids"], c["cache"], k * C, prompt_length + k * C)
        return dict(c, k=k + 1, ids=ids, ended=ended, cache=cache, records=records, **counters)

    records = {}
    if trace:
        records = {
            "canvas_in": jnp.zeros((steps_max, batch, C), jnp.int32),
            "argmax": jnp.zeros((steps_max, batch, C), jnp.int32),
            "accepted": jnp.zeros((steps_max, batch, C), bool),
            "entropy": jnp.zeros((steps_max, batch, C), jnp.float32),
            "finished": jnp.zeros((steps_max, batch), bool),
            "cur_step": jnp.zeros((steps_max,), jnp.int32),
            "canvas_index": jnp.zeros((steps_max,), jnp.int32),
            "temperature": jnp.zeros((steps_max,), jnp.float32),
        }
    carry = {
        "k": jnp.int32(0),
        "ids": jnp.full((batch, K * C), cfg.pad_id, jnp.int32),
        "ended": jnp.zeros((batch,), bool),
        "cache": cache,
        "nfe": jnp.int32(0),
        "passes": jnp.zeros((batch,), jnp.int32),
        "row_nfe": jnp.zeros((batch,), jnp.int32),
        "step": jnp.int32(0),
        "records": records,
    }
    carry = jax.lax.while_loop(canvas_cond, canvas_body, carry)
    out = {"canvas_ids": carry["ids"], "passes": carry["passes"], "row_nfe": carry["row_nfe"], "nfe": carry["nfe"],
           "canvases": carry["k"]}  # fmt: skip
    out.update({f"trace_{name}": v for name, v in carry["records"].items()})
    return out


def denoise_canvas(
    model: DiffusionGemma,
    program: SamplerProgram,
    values: SamplerValues,
    draws: Draws,
    cache: Cache,
    at: jax.Array,
    k: jax.Array,
    ended: jax.Array,
    stopped: jax.Array,
    counters: dict[str, jax.Array],
    records: dict[str, jax.Array],
    trace: bool,
):
    """One canvas's denoising loop over every row at positions ``at`` [B, C] (``k``: the canvas,
    a scalar or each row's [B]; ``ended`` rows are denoised but not counted; ``stopped`` rows start
    frozen): the argmax canvas [B, C], and the counters (``nfe``, ``passes``, ``row_nfe``, ``step``)
    and trace records after it."""
    cfg = model.config
    batch, C = at.shape
    N, V = program.max_denoising_steps, cfg.vocab_size
    history_len = max(program.stability_threshold or 0, 1)
    x0 = draws.initial(k, (batch, C), V)

    def cond(s):
        return (s["n"] > 0) & ~jnp.all(s["stopped"])

    def body(s):
        n = s["n"]
        passes_now = s["passes"] + (~(s["stopped"] | ended)).astype(jnp.int32)
        row_nfe = s["row_nfe"] + (~ended).astype(jnp.int32)
        on = jnp.broadcast_to(n < N, (batch,))  # no self-conditioning at a canvas's first step
        logits = model.denoise(s["x"], at, cache, s["sc"], sc_on=on)
        temperature = values.temperatures[:, n]  # [B]
        z = logits / temperature[:, None, None]
        p, h = probabilities_and_entropy(z)
        y = draws.sampled(s["step"], k, n, p)
        a = first_argmax(z)
        keep = accepted(h, values.entropy_bound)
        r = draws.renoised(s["step"], k, n, (batch, C), V)
        x_next = jnp.where(keep, y, r)
        stopped = s["stopped"]
        history = s["history"]
        if program.adaptive:
            frozen = stopped[:, None]
            a = jnp.where(frozen, s["a"], a)
            x_next = jnp.where(frozen, s["x"], x_next)
            p = jnp.where(frozen[..., None], s["sc"], p)
            if program.stability_threshold:
                stable = jnp.all(history == a[None], axis=(0, 2))
                history = jnp.concatenate([history[1:], a[None]], axis=0)
            else:
                stable = jnp.ones((batch,), bool)
            # A frozen row's entropy is not that of the logits it keeps, but it has stopped already.
            confident = h.mean(-1) < values.confidence
            stopped = stopped | (stable & confident)
        new = dict(s, n=n - 1, x=x_next, a=a, sc=p, stopped=stopped,
                   history=history, passes=passes_now, row_nfe=row_nfe, step=s["step"] + 1, nfe=s["nfe"] + 1)  # fmt: skip
        if trace:
            rec = new["records"]
            i = s["step"]
            new["records"] = {
                "canvas_in": rec["canvas_in"].at[i].set(s["x"]),
                "argmax": rec["argmax"].at[i].set(a),
                "accepted": rec["accepted"].at[i].set(keep),
                "entropy": rec["entropy"].at[i].set(h),
                "finished": rec["finished"].at[i].set(stopped),
                "cur_step": rec["cur_step"].at[i].set(n),
                "canvas_index": rec["canvas_index"].at[i].set(k),
                "temperature": rec["temperature"].at[i].set(temperature[0]),
            }
        return new

    state = {
        "n": jnp.int32(N),
        "x": x0,
        "a": x0,
        "sc": jnp.zeros((batch, C, V), jnp.float32),  # the last step's probabilities: self-conditioning
        "stopped": stopped,
        "history": jnp.full((history_len, batch, C), -1, jnp.int32),
        **counters,
        "records": records,
    }
    state = jax.lax.while_loop(cond, body, state)
    return state["a"], {name: state[name] for name in counters}, state["records"]


def finish_canvas(model: DiffusionGemma, a, at, ended, ids, cache: Cache, at_ids, at_cache):
    """A denoised canvas ``a`` [B, C] written out: pad after its first end-of-sequence id (and in
    rows already ended), into ``ids`` at ``at_ids``; the row ended once it holds one; the canvas
    (pads included, as upstream encodes it) encoded at positions ``at`` into ``cache``'s slots from
    ``at_cache``, the next canvas's context. Offsets are scalars, or each row's own [B]."""
    cfg = model.config
    batch, C = a.shape
    is_eos = jnp.isin(a, jnp.asarray(cfg.eos_ids, jnp.int32))
    seen = jnp.cumsum(is_eos, axis=-1)
    after_eos = (seen > 0) & ~((seen == 1) & is_eos)
    out = jnp.where(ended[:, None] | after_eos, cfg.pad_id, a)
    _, new = model.encode(out, at, jnp.ones((batch, C), bool), cache)
    return write_rows(ids, out, at_ids), ended | is_eos.any(-1), cache.with_canvas(cfg, new, at_cache)


def _padded_replay(draws: Draws, batch: int, canvases: int, steps: int, canvas: int) -> tuple[Draws, tuple[int, int]]:
    """Recorded draws checked against the decode's shapes and zero-filled to every canvas and step
    it may run (a recorded run holds only the steps it ran), with how many canvases and steps were
    recorded: ``decode`` refuses a run that went past them (it read draws nobody recorded)."""
    parts = {"init_canvas": draws.init, "sample": draws.sample, "renoise": draws.renoise}  # upstream's names
    for name, value in parts.items():
        if value is None or value.ndim != 3 or value.shape[1:] != (batch, canvas):
            shape = None if value is None else tuple(value.shape)
            raise InputError(f"recorded draws '{name}' must be [n, batch {batch}, canvas {canvas}], got {shape}")
    if draws.sample.shape[0] != draws.renoise.shape[0]:
        raise InputError(
            f"recorded draws hold {draws.sample.shape[0]} sampled and {draws.renoise.shape[0]} re-noised steps"
        )
    if draws.init.shape[0] > canvases or draws.sample.shape[0] > canvases * steps:
        raise InputError(f"recorded draws hold more canvases or steps than these settings run ({canvases} x {steps})")

    def fill(value: jax.Array, length: int) -> jax.Array:
        return jnp.concatenate([value, jnp.zeros((length - value.shape[0], batch, canvas), jnp.int32)])

    padded = Draws(init=fill(draws.init, canvases), sample=fill(draws.sample, canvases * steps),
                   renoise=fill(draws.renoise, canvases * steps))  # fmt: skip
    return padded, (draws.init.shape[0], draws.sample.shape[0])
