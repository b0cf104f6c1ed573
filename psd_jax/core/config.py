"""Decoding settings: one frozen, hashable dataclass (a static argument of the jitted loop).

``DecodeConfig`` is the one source of truth for decoding settings: the CLI's flags, the benchmark,
evaluation and serving are derived from its fields (``FIELD_HELP`` documents each one). Every
field is checked when the config is made, so bad input fails early with one message that names
the problem instead of deep inside XLA (or as a hang: an infinite temperature never commits a
token). A setting that the chosen policy or decoder would ignore is an error too, not a silent
no-op: ``depth=5`` with ``decoder="plain"`` is refused (``USED_ONLY_WITH``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .families import sampler_for
from .policies import POLICIES as _POLICY_OBJECTS

if TYPE_CHECKING:
    from models import ModelConfig

# The policies' names, from their registry (``policies.POLICIES``: one module each).
POLICIES = tuple(_POLICY_OBJECTS)
# Policies that take ``steps`` per block, as their upstream decoders (LLaDA2.0's and SDAR's) do.
PER_BLOCK_STEPS = tuple(name for name, policy in _POLICY_OBJECTS.items() if policy.per_block_steps)
CONFIDENCES = ("prob", "margin", "entropy", "random")
# The decoders' names: ``decoders.DECODERS`` registers each one's object under its name and checks that
# it lists these (the decoders load JAX; this module must not).
DECODERS = ("plain", "psd", "rps", "edit")
ACCEPTANCES = ("tokens", "strict")
CACHES = ("none", "prefix", "dual")

CHOICES: dict[str, tuple[str, ...]] = {
    "policy": POLICIES,
    "confidence": CONFIDENCES,
    "decoder": DECODERS,
    "acceptance": ACCEPTANCES,
    "cache": CACHES,
}

# Upstream names of the confidence kinds, accepted as aliases.
CONFIDENCE_ALIASES = {
    "low_confidence": "prob",
    "maskgit_plus": "prob",
    "topk_margin": "margin",
    "neg_entropy": "entropy",
}


class DecodeConfigError(ValueError):
    """Decoding settings that cannot run, with the reason."""


# Canvases per row in one model call (PSD: depth + 1, RPS: k_max + 1), a stated cap: the batched
# call's activations grow linearly with it, and the deepest setting of the benchmark's matrix
# uses 8 (PSD depth 7), RPS's default 11.
MAX_BRANCHES = 64


class BlockCounts:
    """Block and step counts from the fields both ``DecodeConfig`` and the compiled
    ``runtime.Program`` hold (``gen_length``, ``block_length``, ``steps``, ``policy``)."""

    gen_length: int
    block_length: int
    steps: int | None
    policy: str
    decoder: str
    minimal_topk: int

    @property
    def total_steps(self) -> int:
        """Steps over all blocks (``steps``, default ``gen_length``: one token per step)."""
        if self.policy in PER_BLOCK_STEPS:
            return self.steps_per_block * self.num_blocks
        return self.gen_length if self.steps is None else self.steps

    @property
    def num_blocks(self) -> int:
        """Blocks of the generation (a last, partial one counts: only ``decoder="edit"`` allows a
        gen_length that the block length does not divide, as LLaDA2.1's pipeline)."""
        return -(-self.gen_length // self.block_length)

    @property
    def steps_per_block(self) -> int:
        """Schedule steps per block. ``threshold_schedule`` and ``sequential`` take ``steps`` per
        block, as LLaDA2.0's and SDAR's decoders (default block_length: one token per step); the
        others split the total."""
        if self.policy in PER_BLOCK_STEPS:
            steps = self.block_length if self.steps is None else self.steps
            if self.decoder == "edit":  # LLaDA2.1's pipeline: min(num_inference_steps, gen_length // minimal_topk)
                steps = min(steps, self.gen_length // self.minimal_topk)
            return steps
        return self.total_steps // self.num_blocks


@dataclasses.dataclass(frozen=True)
class DecodeConfig(BlockCounts):
    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None  # total steps over all blocks (PER_BLOCK_STEPS: per block); None: one token per step
    policy: Literal[POLICIES] = "fixed"  # one of the registered policies' names (``policies.POLICIES``)
    confidence: Literal["prob", "margin", "entropy", "random"] = "prob"
    threshold: float = 0.9
    factor: float = 1.0
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus filter before sampling (1: off); psd_jax.core.sampling
    top_k: int = 0  # top-k filter before sampling (0: off); psd_jax.core.sampling
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    # LLaDA's generate.py rule for [MASK] (and jax-ml/bonsai's port of it): the argmax may be the mask
    # id, a position written with it stays masked, and a block ends after its steps. Off, [MASK]'s
    # logit is -inf: a committed [MASK] is no text (docs/peers.md).
    predict_mask: bool = False
    eos_early_stop: bool = True
    dream_eps: float = 1e-3
    decoder: Literal[DECODERS] = "plain"
    # PSD
    depth: int = 3
    acceptance: Literal["tokens", "strict"] = "tokens"
    accept_confidence: float = 0.0  # tokens acceptance: drafts also need this verifier confidence
    draft_rate: int | None = None
    draft_next_block: bool = False  # drafts continue into the next block (docs/algorithms.md "PSD")
    # RPS
    k_max: int = 10
    ratio: float = 0.1
    pivot_tau: float = 0.9
    lam: float = 0.3
    cache: Literal["none", "prefix", "dual"] = "none"  # block KV cache (Fast-dLLM)
    refresh_every: int = 0  # cache: a full forward after this many window calls (0: block starts only)
    vicinity: int = 0  # dual cache: the window also recomputes this many positions after the block
    # LLaDA2.1's token editing (decoder "edit"; diffusers' LLaDA2Pipeline arguments of the same names)
    editing_threshold: float = 0.0  # 0 or negative: off
    max_post_steps: int = 16
    minimal_topk: int = 1
    # DiffusionGemma's entropy-bound sampler (upstream generate's arguments; defaults: the released
    # generation_config.json). Mask families refuse them, DiffusionGemma refuses the fields above.
    entropy_bound: float = 0.1
    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    # What the decode records besides its tokens (every family): when and how each position was
    # written (``core.trace``; docs/trace.md). The same tokens and calls; a program of its own.
    trace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.confidence, str):
            object.__setattr__(self, "confidence", CONFIDENCE_ALIASES.get(self.confidence, self.confidence))
        _check_types(self)
        _check_values(self)
        _check_used(self)

    def replace(self, **changes: Any) -> DecodeConfig:
        unknown = sorted(set(changes) - set(FIELD_HELP))
        if unknown:
            raise DecodeConfigError(f"unknown decoding setting(s) {unknown}; known: {', '.join(FIELD_HELP)}")
        return dataclasses.replace(self, **changes)

    # What a row's runtime values make the compiled program do (``runtime.Program`` holds them as
    # its flags): the code differs, the values are each row's own.
    @property
    def samples(self) -> bool:
        """Tokens are drawn (temperature > 0), not the argmax."""
        return self.temperature > 0

    @property
    def filters(self) -> bool:
        """A top-p or top-k filter is on."""
        return self.top_p < 1.0 or self.top_k > 0

    @property
    def guided(self) -> bool:
        """Classifier-free guidance: an unconditional forward beside each row's."""
        return self.cfg_scale > 0

    @property
    def gated(self) -> bool:
        """PSD's drafts also need the verifier's confidence (``accept_confidence``)."""
        return self.accept_confidence > 0

    @property
    def cache_name(self) -> str:
        """The cache with its refinements, as setting names write it after a slash: ``none``,
        ``dual``, ``dual+v4`` (vicinity 4), ``prefix+r2`` (refresh_every 2); ``cache_fields``
        reads it back."""
        return (
            self.cache
            + (f"+v{self.vicinity}" if self.vicinity else "")
            + (f"+r{self.refresh_every}" if self.refresh_every else "")
        )

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a user set)."""
        return {name: getattr(self, name) for name, default in _defaults().items() if getattr(self, name) != default}


# One line per field: the CLI's --help text, and the reference table of the documentation.
FIELD_HELP: dict[str, str] = {
    "gen_length": "generated positions (the canvas after the prompt)",
    "block_length": "semi-autoregressive block size; must divide gen_length",
    "steps": "threshold_schedule, sequential: steps PER BLOCK, as LLaDA2.0's and SDAR's decoders (unset: block_length); "
    "fixed/dream: total steps over all blocks (unset: gen_length, one token per step)",
    "policy": "which masked positions of the block to commit each step (sequential: the schedule's count, "
    "leftmost first, as SDAR's generate.py)",
    "confidence": "the score a policy ranks positions by (upstream aliases low_confidence, maskgit_plus, topk_margin, neg_entropy)",
    "threshold": "threshold policy: commit every position with confidence >= this (and the most confident one); "
    "threshold_schedule: those with confidence > this if at least the schedule's count, else the top count",
    "factor": "factor policy: Fast-dLLM's dynamic rule, commit the leading k with confidence >= 1 - factor / (k + 2) "
    "(0 to 100)",
    "temperature": "0: greedy; > 0: Gumbel-max sampling at this temperature (1e-4 to 100)",
    "top_p": "keep the most probable tokens whose probabilities add up to top_p before the token is drawn, "
    "as Dream's top_p_logits (1: off; the family's sampler decides where it applies: docs/algorithms.md)",
    "top_k": "keep the top_k most probable tokens before the token is drawn, as Dream's top_k_logits (0: off)",
    "cfg_scale": "classifier-free guidance scale, 0 to 100 (0: off; not with a KV cache)",
    "logits_eos_inf": "never predict EOS (LLaDA's generate.py option)",
    "confidence_eos_eot_inf": "remove EOT before the confidence softmax (LLaDA's generate.py option)",
    "predict_mask": "let [MASK] be predicted, as LLaDA's generate.py and bonsai's JAX port do (to reproduce them token "
    "for token): a position written with [MASK] stays masked and may be chosen again, and each block ends after its "
    "steps (policy fixed, decoder plain, cache none; off: [MASK]'s logit is -inf, so every commit writes a token)",
    "eos_early_stop": "stop a row once a finished block holds EOS/EOT",
    "dream_eps": "dream policy: the final timestep of Dream's schedule",
    "decoder": "plain (the policy alone), psd (parallel speculative decoding), rps (ripple-pivot search) or "
    "edit (LLaDA2.1's token editing, as diffusers' LLaDA2Pipeline, with policy threshold_schedule)",
    "depth": "PSD: draft levels verified per call (D)",
    "acceptance": "PSD: tokens (a level is accepted if its tokens are the verifier's argmax) or strict (lossless)",
    "accept_confidence": "PSD, tokens acceptance: a drafted token is accepted only where the verifier's "
    "confidence in it is >= this (0: off)",
    "draft_rate": "PSD: positions per draft level (default: the policy's own commit count)",
    "draft_next_block": "PSD: once the block's masked positions are drafted, draft on into the next block "
    "(tokens acceptance, no cache, policy fixed/threshold/factor)",
    "k_max": "RPS: candidate values of the pivot (branches per call)",
    "ratio": "RPS: keep a pivot value only if its probability >= ratio * the top one's",
    "pivot_tau": "RPS: a pivot needs top-k_max probability mass >= this",
    "lam": "RPS: weight of the pivot value's log-probability in a branch's score (0 to 100)",
    "cache": "block KV cache (Fast-dLLM): none, prefix or dual",
    "refresh_every": "block KV cache: also refresh a row's cache (a full forward) after this many window calls "
    "since its last one (0: at block starts only, Fast-dLLM)",
    "vicinity": "dual cache: the window also recomputes this many positions after the block "
    "(0: the block alone, Fast-dLLM)",
    "editing_threshold": "edit: also rewrite a written (non-prompt) position of the current block whenever the "
    "model now prefers another token with probability > this (0 or negative: editing off, the fill rule alone)",
    "max_post_steps": "edit: after a block's last mask is filled, re-run it while the previous call edited, at most "
    "this many + 1 calls",
    "minimal_topk": "edit: steps per block are at most gen_length // this (the pipeline's minimal_topk)",
    "entropy_bound": "DiffusionGemma: each step keeps the lowest-entropy positions whose entropies before them "
    "add up to at most this (the lowest is always kept); the others are re-noised",
    "max_denoising_steps": "DiffusionGemma: denoising steps per canvas (N)",
    "t_min": "DiffusionGemma: the temperature at a canvas's last step (it falls linearly from t_max)",
    "t_max": "DiffusionGemma: the temperature at a canvas's first step",
    "stability_threshold": "DiffusionGemma, adaptive stopping: a row stops once its argmax canvas has not changed "
    "for this many steps (and its mean entropy is below confidence_threshold)",
    "confidence_threshold": "DiffusionGemma, adaptive stopping: a stable row stops once its mean entropy is below "
    "this (0: no adaptive stopping, every canvas runs max_denoising_steps)",
    "trace": "record when and how each generated position was written (the model call and the rule: the policy, a "
    "PSD draft's depth, an RPS pivot, an edit; DiffusionGemma: the step it settled): the same tokens and calls",
}

# The entropy-bound sampler's fields (DiffusionGemma): the only ones, with the lengths, that family reads.
ENTROPY_BOUND_FIELDS = (
    "entropy_bound",
    "max_denoising_steps",
    "t_min",
    "t_max",
    "stability_threshold",
    "confidence_threshold",
)
# A stated cap on the denoising steps of a canvas (upstream's default is 48): the loop's bound, and
# what recorded draws and traces are laid out for.
MAX_DENOISING_STEPS = 4096

INT_FIELDS = (
    "gen_length",
    "block_length",
    "steps",
    "top_k",
    "depth",
    "draft_rate",
    "k_max",
    "refresh_every",
    "vicinity",
    "max_post_steps",
    "minimal_topk",
    "max_denoising_steps",
    "stability_threshold",
)
FLOAT_FIELDS = (
    "threshold",
    "factor",
    "accept_confidence",
    "temperature",
    "top_p",
    "cfg_scale",
    "dream_eps",
    "ratio",
    "pivot_tau",
    "lam",
    "editing_threshold",
    "entropy_bound",
    "t_min",
    "t_max",
    "confidence_threshold",
)
BOOL_FIELDS = (
    "logits_eos_inf",
    "confidence_eos_eot_inf",
    "predict_mask",
    "eos_early_stop",
    "draft_next_block",
    "trace",
)
_OPTIONAL = ("steps", "draft_rate")


def _fail(message: str) -> None:
    raise DecodeConfigError(message)


def _check_types(c: DecodeConfig) -> None:
    for name in INT_FIELDS:
        value = getattr(c, name)
        if value is None and name in _OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(f"{name} must be an integer, got {value!r}")
    for name in FLOAT_FIELDS:
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            _fail(f"{name} must be finite, got {value!r}")
    for name in BOOL_FIELDS:
        if not isinstance(getattr(c, name), bool):
            _fail(f"{name} must be true or false, got {getattr(c, name)!r}")
    for name, allowed in CHOICES.items():
        value = getattr(c, name)
        if value not in allowed:
            _fail(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")


# The runtime values' ranges (``runtime.RUNTIME_FIELDS``): each is a float32 input of the compiled
# loop, so a value must stay meaningful once cast (1e308 is inf there, and 1e-50 is 0), and its
# arithmetic finite: logits / temperature, the guidance scale's (s + 1) * (cond - uncond), RPS's
# lam * log p. Upstream's values are a few units; the bounds leave two orders of magnitude above them.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0
TEMPERATURE_RANGE = f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
MAX_SCALE = 100.0  # cfg_scale, factor, lam
# entropy_bound and confidence_threshold are sums or means of entropies, in nats; a canvas's entropy
# is at most its length times log(vocabulary), far below this.
MAX_ENTROPY_BOUND = 1e6

# (test, message) per field: the value ranges a decode can run with (checked on the value and, for
# a float, on its float32 cast: ``_as_float32``).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "gen_length": (lambda v: v > 0, "must be positive"),
    "block_length": (lambda v: v > 0, "must be positive"),
    "steps": (lambda v: v is None or v > 0, "must be positive"),
    "threshold": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    "factor": (lambda v: 0 < v <= MAX_SCALE, f"must be in (0, {MAX_SCALE:g}]"),
    "temperature": (lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE, TEMPERATURE_RANGE),
    "top_p": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1] (1: off)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0: off)"),
    "cfg_scale": (lambda v: 0 <= v <= MAX_SCALE, f"must be in [0, {MAX_SCALE:g}] (0: off)"),
    "dream_eps": (lambda v: 0.0 < v < 1.0, "must be in (0, 1)"),
    "depth": (lambda v: v >= 0, "(PSD) must be >= 0"),
    "draft_rate": (lambda v: v is None or v >= 1, "(PSD) must be >= 1"),
    "accept_confidence": (lambda v: 0.0 <= v <= 1.0, "(PSD) must be in [0, 1] (0: off)"),
    "k_max": (lambda v: v >= 1, "(RPS) must be >= 1"),
    "ratio": (lambda v: 0.0 <= v <= 1.0, "(RPS) must be in [0, 1]"),
    "pivot_tau": (lambda v: 0.0 <= v <= 1.0, "(RPS) must be in [0, 1]"),
    "lam": (lambda v: 0 <= v <= MAX_SCALE, f"(RPS) must be in [0, {MAX_SCALE:g}]"),
    "refresh_every": (lambda v: v >= 0, "(block KV cache) must be >= 0 (0: at block starts only)"),
    "vicinity": (lambda v: v >= 0, "(dual cache) must be >= 0 (0: the block alone)"),
    "editing_threshold": (lambda v: v <= 1.0, "(edit) must be at most 1 (0 or negative: editing off)"),
    "max_post_steps": (lambda v: v >= 0, "(edit) must be >= 0"),
    "minimal_topk": (lambda v: v >= 1, "(edit) must be >= 1"),
    "entropy_bound": (lambda v: 0 <= v <= MAX_ENTROPY_BOUND, f"must be in [0, {MAX_ENTROPY_BOUND:g}]"),
    "max_denoising_steps": (lambda v: 1 <= v <= MAX_DENOISING_STEPS, f"must be in [1, {MAX_DENOISING_STEPS}]"),
    "t_min": (
        lambda v: MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
        f"must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
    ),
    "t_max": (
        lambda v: MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
        f"must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
    ),
    "stability_threshold": (lambda v: v >= 0, "must be >= 0"),
    "confidence_threshold": (lambda v: 0 <= v <= MAX_ENTROPY_BOUND, f"must be in [0, {MAX_ENTROPY_BOUND:g}] (0: off)"),
}


def _as_float32(value: Any) -> Any:
    """A float as the compiled loop holds it (``runtime.RowValues``: float32); anything else as it is."""
    return float(np.float32(value)) if isinstance(value, float) else value


def _check_values(c: DecodeConfig) -> None:
    for name, (ok, message) in _RANGES.items():
        value = getattr(c, name)
        if not ok(value):
            _fail(f"{name} {message}, got {value!r}")
        with np.errstate(over="ignore"):
            cast = _as_float32(value)
        if not ok(cast):
            _fail(f"{name} {message}, got {value!r} ({cast!r} as float32, the decode's precision)")
    if c.gen_length % c.block_length and c.decoder != "edit":
        _fail(
            f"block_length {c.block_length} does not divide gen_length {c.gen_length} "
            "(only decoder 'edit' decodes a last, partial block)"
        )
    if c.decoder == "edit" and c.minimal_topk > c.gen_length:
        _fail(f"minimal_topk {c.minimal_topk} (edit) exceeds gen_length {c.gen_length}: no step would be left")
    if c.policy not in PER_BLOCK_STEPS and c.total_steps % c.num_blocks:
        _fail(
            f"steps {c.total_steps} is not divisible by the number of blocks {c.num_blocks} (gen_length / block_length)"
        )
    _check_work(c)
    if c.t_min > c.t_max:
        _fail(f"t_min {c.t_min} exceeds t_max {c.t_max}: the temperature falls from t_max to t_min")
    if c.stability_threshold > c.max_denoising_steps:
        _fail(
            f"stability_threshold {c.stability_threshold} exceeds max_denoising_steps {c.max_denoising_steps}: "
            "no canvas runs enough steps to be that stable"
        )
    if c.cache != "none" and c.cfg_scale > 0:
        _fail(f"cache {c.cache!r} does not support classifier-free guidance (cfg_scale > 0); use cache='none'")
    if c.vicinity > c.gen_length - c.block_length:
        _fail(
            f"vicinity {c.vicinity} (dual cache) exceeds gen_length - block_length = {c.gen_length - c.block_length}: "
            "the positions after a block"
        )


def _check_work(c: DecodeConfig) -> None:
    """Bounds between fields: no setting may ask for model calls or branches that no decode can use."""
    if c.policy in PER_BLOCK_STEPS:
        if c.steps_per_block > c.block_length:
            _fail(
                f"steps {c.steps_per_block} (per block, {c.policy}) exceeds block_length {c.block_length}: "
                "every step commits at least one position"
            )
    elif c.total_steps > c.gen_length:
        _fail(f"steps {c.total_steps} exceeds gen_length {c.gen_length}: at most one step per generated position")
    if c.decoder == "psd":
        # The policy commits at least one position and every draft level adds at least one more.
        # Drafts past the block may also fill all but one of the next block's positions.
        if c.draft_next_block and c.depth > 2 * c.block_length - 2:
            _fail(
                f"depth {c.depth} (PSD) exceeds 2 * block_length - 2 = {2 * c.block_length - 2}: with "
                "draft_next_block the block and the next have room for at most that many draft levels"
            )
        if not c.draft_next_block and c.depth > c.block_length - 1:
            _fail(
                f"depth {c.depth} (PSD) exceeds block_length - 1 = {c.block_length - 1}: a block has room for at "
                "most that many draft levels after the policy's commit"
            )
        if c.depth + 1 > MAX_BRANCHES:
            _fail(f"depth {c.depth} (PSD) exceeds {MAX_BRANCHES - 1}: at most {MAX_BRANCHES} canvases per row per call")
        if c.draft_rate is not None and c.draft_rate > c.block_length:
            _fail(f"draft_rate {c.draft_rate} (PSD) exceeds block_length {c.block_length}")
        if c.draft_next_block:
            _check_next_block_drafts(c)
    if c.predict_mask and (c.policy, c.decoder, c.cache) != ("fixed", "plain", "none"):
        _fail(
            "predict_mask (LLaDA generate.py's [MASK] rule) runs with policy 'fixed', decoder 'plain' and cache 'none' "
            f"only (here policy={c.policy!r}, decoder={c.decoder!r}, cache={c.cache!r}): a position written with [MASK] "
            "stays masked, so only a fixed number of steps per block ends every block, as in generate.py"
        )
    if c.decoder == "edit" and c.policy != "threshold_schedule":
        _fail(f"decoder 'edit' fills masks with policy 'threshold_schedule' (LLaDA2.1's pipeline), not {c.policy!r}")
    if c.decoder == "rps" and c.k_max + 1 > MAX_BRANCHES:
        _fail(f"k_max {c.k_max} (RPS) exceeds {MAX_BRANCHES - 1}: at most {MAX_BRANCHES} canvases per row per call")


def _check_next_block_drafts(c: DecodeConfig) -> None:
    """What drafts past the block need: acceptance by tokens (strict compares a level with the policy's
    next step in the same block), a call whose queries reach the next block (uncached, the prefix
    cache's window, or a dual window with a vicinity of a block) and a policy whose step is a count
    of the schedule or unused."""
    if c.acceptance != "tokens":
        _fail(
            "draft_next_block (PSD) needs acceptance 'tokens': strict checks a level against the policy's next step in its own block"
        )
    if c.cache == "dual" and c.vicinity < min(c.block_length, c.gen_length - c.block_length):
        _fail(
            f"draft_next_block (PSD) with the dual cache needs vicinity >= block_length {c.block_length} "
            f"(got {c.vicinity}): the window must recompute the next block it drafts into"
        )
    if c.policy not in ("fixed", "threshold", "factor"):
        _fail(f"draft_next_block (PSD) works with policy 'fixed', 'threshold' or 'factor', not {c.policy!r}")


def check_for_model(c: DecodeConfig, mcfg: ModelConfig) -> None:
    """Bounds of ``c`` that depend on the model (``mcfg``: a ``models`` config): the context,
    the vocabulary RPS ranks, what the family supports. Every front end calls this before any
    model work (the benchmark and evaluation before loading weights)."""
    check_fields_for_model(c.changed(), mcfg)
    # DiffusionGemma's block is its canvas (``model_dir.canvas_fields`` rounds a length up to whole
    # canvases, as upstream's ``generate`` does).
    if mcfg.family == ENTROPY_BOUND_FAMILY and c.block_length != mcfg.canvas_length:
        _fail(f"block_length {c.block_length}: DiffusionGemma decodes in canvases of {mcfg.canvas_length} (its config)")
    if c.gen_length >= mcfg.max_length:
        _fail(
            f"gen_length {c.gen_length} leaves no room for a prompt in the model's context of {mcfg.max_length} tokens"
        )
    if mcfg.family == ENTROPY_BOUND_FAMILY:
        return  # the checks below are the mask-token decoders'
    if c.decoder == "edit" and not mcfg.block_causal and c.gen_length % c.block_length:
        _fail(
            f"block_length {c.block_length} does not divide gen_length {c.gen_length}: decoder 'edit' decodes a last, "
            f"partial block on block-causal models only, not the bidirectional {mcfg.family}"
        )
    if c.decoder == "rps" and c.k_max > mcfg.vocab_size:
        _fail(f"k_max {c.k_max} exceeds the vocabulary of {mcfg.vocab_size}")
    if mcfg.block_causal and c.cfg_scale > 0:
        _fail(f"classifier-free guidance (cfg_scale > 0) is not supported for the block-causal {mcfg.family}")
    if mcfg.block_causal and (c.refresh_every or c.vicinity):
        _fail(
            f"refresh_every and vicinity are not used for the block-causal {mcfg.family}: its block KV cache "
            "is exact (a block sees only finished blocks)"
        )
    if mcfg.block_causal and c.predict_mask:
        _fail(
            f"predict_mask (LLaDA generate.py's [MASK] rule) is not supported for the block-causal {mcfg.family}: "
            "it is the flat models' loop (LLaDA, Dream, LLaDA-MoE)"
        )
    if mcfg.block_causal and c.draft_next_block:
        _fail(f"draft_next_block (PSD) is not supported for the block-causal {mcfg.family}: a block sees no later one")
    if c.top_k > mcfg.vocab_size:
        _fail(f"top_k {c.top_k} exceeds the vocabulary of {mcfg.vocab_size}")
    ignored = sampler_for(mcfg.family).ignored(c)
    if ignored:
        _fail(ignored)


ENTROPY_BOUND_FAMILY = "diffusion_gemma"  # the family decoded by the entropy-bound sampler


def check_fields_for_model(fields: dict[str, Any], mcfg: ModelConfig) -> None:
    """``fields`` against the model's family: DiffusionGemma reads the lengths and
    ``ENTROPY_BOUND_FIELDS`` only, the mask-token families none of those. ``check_for_model`` passes
    the settings' changed fields; a front end also passes the fields a user gave, whatever their
    values (a field given at its default, ``threshold=0.9`` to DiffusionGemma, looks unset in the
    settings and would be silently ignored)."""
    if mcfg.family == ENTROPY_BOUND_FAMILY:
        ignored = [
            name for name in fields if name not in ("gen_length", "block_length", "trace", *ENTROPY_BOUND_FIELDS)
        ]
        if ignored:
            _fail(
                f"{', '.join(f'{n}={fields[n]!r}' for n in ignored)}: not used by DiffusionGemma's entropy-bound "
                f"sampler (its settings: gen_length, {', '.join(ENTROPY_BOUND_FIELDS)})"
            )
    else:
        foreign = [name for name in fields if name in ENTROPY_BOUND_FIELDS]
        if foreign:
            _fail(
                f"{', '.join(f'{n}={fields[n]!r}' for n in foreign)}: used only by DiffusionGemma's entropy-bound "
                f"sampler, not by {mcfg.family} (a mask-token family)"
            )


# Settings read only under some policy or decoder: (condition, what it needs). Setting one of them
# to anything but its default elsewhere would be silently ignored, so it is refused.
USED_ONLY_WITH: dict[str, tuple[Callable[[DecodeConfig], bool], str]] = {
    "steps": (
        lambda c: c.policy in ("fixed", "dream", *PER_BLOCK_STEPS),
        "policy 'fixed' or 'dream' (total steps), or 'threshold_schedule' or 'sequential' (steps per block)",
    ),
    "threshold": (
        lambda c: c.policy in ("threshold", "threshold_schedule"),
        "policy 'threshold' or 'threshold_schedule'",
    ),
    "factor": (lambda c: c.policy == "factor", "policy 'factor'"),
    "dream_eps": (lambda c: c.policy == "dream", "policy 'dream'"),
    "depth": (lambda c: c.decoder == "psd", "decoder 'psd'"),
    "acceptance": (lambda c: c.decoder == "psd", "decoder 'psd'"),
    "accept_confidence": (
        lambda c: c.decoder == "psd" and c.acceptance == "tokens",
        "decoder 'psd' with acceptance 'tokens' (strict accepts only the policy's own choice)",
    ),
    "draft_rate": (
        lambda c: c.decoder == "psd" and c.policy != "fixed",
        "decoder 'psd' with a policy other than 'fixed' (fixed drafts the schedule's own counts)",
    ),
    "draft_next_block": (lambda c: c.decoder == "psd", "decoder 'psd'"),
    "k_max": (lambda c: c.decoder == "rps", "decoder 'rps'"),
    "ratio": (lambda c: c.decoder == "rps", "decoder 'rps'"),
    "pivot_tau": (lambda c: c.decoder == "rps", "decoder 'rps'"),
    "lam": (lambda c: c.decoder == "rps", "decoder 'rps'"),
    "refresh_every": (lambda c: c.cache != "none", "a block KV cache (cache 'prefix' or 'dual')"),
    "vicinity": (lambda c: c.cache == "dual", "cache 'dual' (the prefix cache's window already reaches the end)"),
    "editing_threshold": (lambda c: c.decoder == "edit", "decoder 'edit'"),
    "max_post_steps": (lambda c: c.decoder == "edit", "decoder 'edit'"),
    "minimal_topk": (lambda c: c.decoder == "edit", "decoder 'edit'"),
}


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(DecodeConfig)}


def _check_used(c: DecodeConfig) -> None:
    defaults = _defaults()
    for name, (used, needs) in USED_ONLY_WITH.items():
        value = getattr(c, name)
        if value != defaults[name] and not used(c):
            _fail(
                f"{name}={value!r} would be ignored: it is used only with {needs} "
                f"(here policy={c.policy!r}, decoder={c.decoder!r}, cache={c.cache!r})"
            )


# The library's recommended decoder, shown next to one token per step by the first run: PSD's
# temporal drafts over Fast-dLLM's threshold policy, with the dual block cache (docs/benchmark.md).
RECOMMENDED: dict[str, Any] = {"policy": "threshold", "threshold": 0.9, "decoder": "psd", "depth": 3, "cache": "dual"}


CACHE_NAME_HELP = "none, prefix or dual, then +vN (dual: vicinity N) and +rN (refresh_every N): dual+v4"


def cache_fields(name: str) -> dict[str, Any]:
    """``DecodeConfig.cache_name`` read back, every field it names (``"dual+v4"`` ->
    ``{"cache": "dual", "vicinity": 4, "refresh_every": 0}``)."""
    cache, *parts = name.split("+")
    if cache not in CACHES:
        _fail(f"unknown cache {name!r}: {CACHE_NAME_HELP}")
    fields: dict[str, Any] = {"cache": cache}
    for part in parts:
        field = {"v": "vicinity", "r": "refresh_every"}.get(part[:1])
        if field is None or not part[1:].isdigit() or field in fields:
            _fail(f"unknown cache {name!r}: {CACHE_NAME_HELP}")
        fields[field] = int(part[1:])
    return {"vicinity": 0, "refresh_every": 0, **fields}


def settings_from(base: DecodeConfig, overrides: dict[str, Any]) -> DecodeConfig:
    """``base`` with ``overrides`` applied, where an override of a policy or decoder first resets
    the settings that only the old one used (``replace(decoder="plain")`` on a PSD config is a plain
    config, not an error about its depth)."""
    if not overrides:
        return base
    try:
        return DecodeConfig(**merged_fields(base.changed(), overrides))
    except TypeError as exc:
        raise DecodeConfigError(f"unknown decoding setting: {exc}") from None


def merged_fields(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` fields with ``overrides`` applied, dropping the base's settings that the resulting
    policy and decoder do not use (``settings_from``'s rule, on plain field dicts)."""
    values = {**base, **overrides}
    probe = dataclasses.replace(DecodeConfig(), **{k: values[k] for k in ("policy", "decoder", "cache") if k in values})
    for name, (used, _) in USED_ONLY_WITH.items():
        if name not in overrides and not used(probe):
            values.pop(name, None)
    return values
