"""Log-likelihoods of continuations: LLaDA's Monte Carlo estimate of the masked-diffusion bound.

A masked diffusion LM has no left-to-right factorisation, so a continuation's log-likelihood is
estimated from the bound it was trained on. One *sample* masks ``m`` of the ``T`` continuation
tokens (never a prompt token) and scores the masked ones: ``(T / m) · Σ_masked CE``, the
cross-entropy divided by the mask ratio. A *draw* is ``mc_batch`` samples whose counts are
stratified as in LLaDA's ``eval_llada.py``: one ``k`` uniform in ``1..T``, row ``i`` masks
``((round(k + i·T/mc_batch) − 1) mod T) + 1`` positions (a uniform subset of that size). The
estimate is ``−`` the mean of ``mc_num`` samples. With ``cfg > 0`` each forward also runs the
unconditional copy (prompt replaced by the mask id) and uses ``u + (cfg + 1)(c − u)``, as LLaDA.

Everything per sample runs in one jitted call over ``[draws · mc_batch, N]`` rows, right-padded
to a bucketed length with masked pad keys (so positions, absolute or from the mask, are those of
the unpadded sequence). Each draw's randomness is keyed by the seed, a hash of the request's
tokens and the draw's index, and requests are grouped by padded length: a request's estimate
does not depend on the other requests of the call. For a short continuation the exact
expectation of the estimator is computable by enumerating the mask subsets (``exact_nll``); the
tests check the Monte Carlo mean against it. docs/evaluation.md "Loglikelihood".
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import zlib
from collections import defaultdict
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..api import LoadedModel
from ..core.config import DecodeConfig
from ..core.errors import InputError
from ..core.lengths import padded_length
from ..parallel.multihost import to_host

MAX_EXACT_TOKENS = 10  # exact_nll forwards 2**T - 1 subsets


@dataclasses.dataclass(frozen=True)
class Estimator:
    """The estimator's settings (the harness model's ``mc_num``, ``mc_batch``, ``cfg``, ``seed``)."""

    mc_num: int = 128
    mc_batch: int = 32
    cfg: float = 0.0
    seed: int = 0
    draws_per_call: int = 1  # draws (of mc_batch rows each) per model call
    bucket: int = 32  # padded lengths are multiples of this


@dataclasses.dataclass
class Prepared:
    """One request's tokens and the static shape it is scored at."""

    ids: list[int]  # context + continuation
    prompt_len: int
    target_len: int
    padded: int  # padded sequence length
    logits_from: int  # first position whose logits are computed


def stratified_counts(k, target_len, group: int, xp=jnp):
    """Mask counts of one draw's rows: round(k + i·T/group) wrapped into 1..T, rounding half to even
    as torch.round does, computed in integers (``xp`` is jnp in the jitted call, np in exact_nll)."""
    i = xp.arange(group)
    q, r = (i * target_len) // group, (i * target_len) % group
    up = (2 * r > group) | ((2 * r == group) & ((k + q) % 2 == 1))
    return (k + q + up.astype(q.dtype) - 1) % target_len + 1


def _nll_sums(model, ids, attn, is_mask, prompt_len, *, logits_from, shift, cfg, mask_id):
    """Σ over the masked positions of each row of the cross-entropy of the true token."""
    noisy = jnp.where(is_mask, mask_id, ids)
    positions = jnp.arange(ids.shape[1])[None, :]
    if cfg > 0:
        uncond = jnp.where(positions < prompt_len[:, None], mask_id, noisy)
        both = model(jnp.concatenate([noisy, uncond]), jnp.concatenate([attn, attn]), logits_from=logits_from)
        cond, un = jnp.split(both.astype(jnp.float32), 2)
        logits = un + (cfg + 1.0) * (cond - un)
    else:
        logits = model(noisy, attn, logits_from=logits_from).astype(jnp.float32)
    # Position j is predicted by logit j - shift: logits[:, t] predict position logits_from + shift + t.
    start = logits_from + shift
    logits = logits[:, : ids.shape[1] - start]
    true = ids[:, start:]
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, true[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(is_mask[:, start:], ce, 0.0), axis=1)


def _sample_masks(seeds, prompt_len, target_len, length: int, group: int, base_key):
    """The masks of one call's draws: ``seeds`` [D, 2] (request hash, draw index) -> [D·group, N]."""

    def one_draw(seed, p, t):
        key = jax.random.fold_in(jax.random.fold_in(base_key, seed[0]), seed[1])
        k_key, perm_key = jax.random.split(key)
        k = jax.random.randint(k_key, (), 1, t + 1)
        counts = stratified_counts(k, t, group)
        pos = jnp.arange(length)
        target = (pos >= p) & (pos < p + t)
        u = jax.random.uniform(perm_key, (group, length))
        u = jnp.where(target[None, :], u, 2.0)  # only continuation positions can be masked
        rank = jnp.argsort(jnp.argsort(u, axis=1), axis=1)
        return rank < counts[:, None], counts

    firsts = jnp.arange(0, prompt_len.shape[0], group)
    masks, counts = jax.vmap(one_draw)(seeds, prompt_len[firsts], target_len[firsts])
    return masks.reshape(-1, length), counts.reshape(-1)


def _draw_losses(graphdef, params, ids, attn, prompt_len, target_len, seeds, base_seed, *, static):
    """Per-draw estimates ``mean_rows (T / m) · Σ_masked CE`` [D] of one call."""
    logits_from, shift, cfg, mask_id, group = static
    model = nnx.merge(graphdef, params)
    base_key = jax.random.key(base_seed)
    is_mask, counts = _sample_masks(seeds, prompt_len, target_len, ids.shape[1], group, base_key)
    sums = _nll_sums(
        model, ids, attn, is_mask, prompt_len, logits_from=logits_from, shift=shift, cfg=cfg, mask_id=mask_id
    )
    weighted = sums * target_len.astype(jnp.float32) / counts.astype(jnp.float32)
    return weighted.reshape(-1, group).mean(axis=1)


def _subset_sums(graphdef, params, ids, attn, is_mask, prompt_len, *, static):
    logits_from, shift, cfg, mask_id = static
    model = nnx.merge(graphdef, params)
    return _nll_sums(
        model, ids, attn, is_mask, prompt_len, logits_from=logits_from, shift=shift, cfg=cfg, mask_id=mask_id
    )


def request_hash(ids: Sequence[int]) -> int:
    """A request's 32-bit identity, so its random masks follow it into any batch."""
    return zlib.crc32(np.asarray(ids, np.int64).tobytes())


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class LikelihoodScorer:
    """Scores ``(context ids, continuation ids)`` pairs on a loaded model with an ``Estimator``.

    Compilation is ahead of time, once per (rows, padded length, logits_from), and timed apart;
    ``calls``, ``rows``, ``seconds`` and ``compile_seconds`` accumulate over the scorer's life."""

    def __init__(self, lm: LoadedModel, est: Estimator):
        self.lm, self.est = lm, est
        self._compiled: dict[tuple, object] = {}
        self.calls, self.rows, self.seconds, self.compile_seconds = 0, 0, 0.0, 0.0

    # ------------------------------------------------------------------------- preparing
    def prepare(self, context: Sequence[int], continuation: Sequence[int]) -> Prepared:
        """Shape one request, or raise ``InputError`` (before any model call) if it cannot run."""
        cfg, bucket = self.lm.config, self.est.bucket
        ids = [int(t) for t in (*context, *continuation)]
        if not context or not continuation:
            raise InputError("a loglikelihood request needs a non-empty context and continuation (in tokens)")
        if len(ids) > cfg.max_length:
            raise InputError(
                f"a loglikelihood request of {len(ids)} tokens ({len(context)} context + {len(continuation)} "
                f"continuation) exceeds the model's context of {cfg.max_length}"
            )
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InputError(f"token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
        padded = min(padded_length(len(ids), bucket), cfg.max_length)
        logits_from = (len(context) - cfg.logit_shift) // bucket * bucket
        return Prepared(ids, len(context), len(continuation), padded, logits_from)

    def _arrays(self, preps: list[Prepared], rows_each: int):
        padded = preps[0].padded
        ids = np.full((len(preps), padded), self.lm.config.pad_id, np.int32)
        attn = np.zeros((len(preps), padded), np.int32)
        for row, p in enumerate(preps):
            ids[row, : len(p.ids)] = p.ids
            attn[row, : len(p.ids)] = 1
        prompt = np.array([p.prompt_len for p in preps], np.int32)
        target = np.array([p.target_len for p in preps], np.int32)
        rep = partial(np.repeat, repeats=rows_each, axis=0)
        return rep(ids), rep(attn), rep(prompt), rep(target)

    def _placed(self, args: tuple) -> tuple:
        """The call's arrays on the model's devices: per-row arrays split by rows as decoding
        splits a batch, the rest whole on every device (on several processes: every process's)."""
        rows = args[0].shape[0]
        per_row = [i for i, a in enumerate(args) if np.ndim(a) and a.shape[0] == rows]
        placed = dict(zip(per_row, self.lm.placed.on_devices(*(args[i] for i in per_row))))
        return tuple(placed[i] if i in placed else self.lm.placed.replicated(a) for i, a in enumerate(args))

    def _call(self, name: str, impl, static: tuple, args: tuple) -> np.ndarray:
        args = self._placed(args)
        key = (name, static, *(a.shape for a in args))
        if key not in self._compiled:
            start = time.perf_counter()
            fn = jax.jit(partial(impl, self.lm.graphdef, static=static))
            self._compiled[key] = fn.lower(self.lm.params, *args).compile()
            self.compile_seconds += time.perf_counter() - start
        start = time.perf_counter()
        out = to_host(jax.block_until_ready(self._compiled[key](self.lm.params, *args)))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.rows += args[0].shape[0] * (2 if self.est.cfg > 0 else 1)
        return out

    def _static(self, logits_from: int) -> tuple:
        cfg = self.lm.config
        return (logits_from, cfg.logit_shift, float(self.est.cfg), cfg.mask_id)

    # --------------------------------------------------------------------------- scoring
    def draw_losses(self, preps: list[Prepared]) -> list[np.ndarray]:
        """Each request's per-draw estimates of the negative bound, ``[mc_num / mc_batch]``."""
        est = self.est
        n_draws, group = est.mc_num // est.mc_batch, est.mc_batch
        out = [np.zeros(n_draws) for _ in preps]
        hashes = [request_hash(p.ids) for p in preps]
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for r, p in enumerate(preps):
            by_shape[(p.padded, p.logits_from)] += [(r, d) for d in range(n_draws)]
        for (_, logits_from), items in by_shape.items():
            for chunk in _chunks(items, est.draws_per_call):
                full = chunk + [chunk[-1]] * (est.draws_per_call - len(chunk))  # static shapes
                arrays = self._arrays([preps[r] for r, _ in full], group)
                seeds = np.array([[hashes[r], d] for r, d in full], np.uint32)
                args = (*arrays, seeds, np.uint32(est.seed))
                losses = self._call("draws", _draw_losses, (*self._static(logits_from), group), args)
                for (r, d), value in zip(chunk, losses):
                    out[r][d] = value
        return out

    def loglikelihoods(self, preps: list[Prepared]) -> list[float]:
        """The estimate of each request's log-likelihood (minus the mean of its samples)."""
        return [-float(np.mean(d)) for d in self.draw_losses(preps)]

    def exact_nll(self, context: Sequence[int], continuation: Sequence[int]) -> float:
        """The estimator's exact expectation (its negative bound) for one short continuation: every
        non-empty mask subset is scored once, averaged per size, and weighted by the stratified
        counts' distribution over ``k``."""
        p = self.prepare(context, continuation)
        t, group = p.target_len, self.est.mc_batch
        if t > MAX_EXACT_TOKENS:
            raise InputError(f"exact_nll enumerates 2**T subsets; T = {t} > {MAX_EXACT_TOKENS}")
        subsets = [s for m in range(1, t + 1) for s in itertools.combinations(range(t), m)]
        ids, attn, prompt, _ = self._arrays([p], len(subsets))
        is_mask = np.zeros_like(ids, bool)
        for row, subset in enumerate(subsets):
            is_mask[row, [p.prompt_len + j for j in subset]] = True
        sums = self._call("subsets", _subset_sums, self._static(p.logits_from), (ids, attn, is_mask, prompt))
        sizes = np.array([len(s) for s in subsets])
        mean_by_size = np.array([0.0] + [sums[sizes == m].mean() for m in range(1, t + 1)])
        total = 0.0
        for k in range(1, t + 1):
            counts = stratified_counts(k, t, group, xp=np)
            total += float(np.mean(t / counts * mean_by_size[counts]))
        return total / t

    def greedy(self, preps: list[Prepared], batch: int) -> list[bool]:
        """Whether one-token-per-step greedy decoding (the most confident position each step, as
        LLaDA's ``suffix_greedy_prediction``) of a fully masked continuation gives it exactly."""
        out = [False] * len(preps)
        by_length: dict[int, list[int]] = defaultdict(list)
        for r, p in enumerate(preps):
            by_length[p.target_len].append(r)
        for t, rows in by_length.items():
            settings = DecodeConfig(gen_length=t, block_length=t, eos_early_stop=False, cfg_scale=float(self.est.cfg))
            for chunk in _chunks(rows, batch):
                prompts = [preps[r].ids[: preps[r].prompt_len] for r in chunk]
                results = self.lm.generate(prompts, settings, seed=self.est.seed, prompt_bucket=self.est.bucket)
                self.calls += max(g.nfe for g in results)
                self.seconds += results[0].seconds
                self.compile_seconds += results[0].compile_seconds
                for r, g in zip(chunk, results):
                    out[r] = g.output_ids == preps[r].ids[preps[r].prompt_len :]
        return out
