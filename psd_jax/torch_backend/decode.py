"""The decoders (plain, PSD, RPS) over the PyTorch model, with the JAX engine's exact semantics.

This is ``psd_jax.core.engine`` + ``decoders`` + ``predict`` written as a PyTorch user would: eager
tensors under ``torch.inference_mode``, a Python ``while`` loop over iterations, every per-row
decision a batched tensor op (no Python loop over rows), and all candidates of all rows verified
in ONE model call of shape ``[B*K, N]``. The decoding rules themselves (ranks, every policy's
counts and commit set, PSD's drafts and acceptance, RPS's pivot and scoring, block advance, the
forward sizes and the logit window) are not re-written here: the decoder is the engine's own
object (``decoders.decoder_for``: the one registration of a decoder) and the shared rules are
``psd_jax.core.rules``, both run with the array namespace ``array_api_compat.torch``. What this
module adds is the loop, the model calls and the bookkeeping, as the engine's:

- rows decode independently: own block, own schedule step, own ``done`` flag;
- one iteration = policy commit ``s0`` and the candidates (no model call) -> one batched forward
  of all candidates -> per-row choice -> block advance / EOS early exit;
- a row is *live* when it still decodes after its policy commit; when no row is live the forward
  is skipped (so the last, unused forward of upstream's loop is never run), and ``row_nfe``
  counts a row's calls only while it is live;
- a call forwards only the leading candidates some live row can choose (PSD levels up to the
  first empty one, RPS branches that pass the ratio filter), rounded up to one of the engine's
  ``forward_sizes`` (s0 alone, about half, all K), so the sequence counts equal the engine's;
- a call computes logits only in the engine's logit window (``rules.logit_window``: the current
  block and the next); the other positions predict their current token with zero confidence,
  as ``predict.on_canvas`` places them;
- ``nfe`` counts model calls (the initial forward included), ``sequence_forwards`` the sequences
  the model processed (``B*K`` per full call, doubled under classifier-free guidance).

With ``cache="prefix"|"dual"`` the loop is ``torch_backend.cache`` (Fast-dLLM's block KV cache,
the engine's ``step_cached``); it shares this module's predictions, decoders and ``apply_choice``.
Block-causal families (LLaDA2.0) are not implemented here and are refused by name
(``check_supported``) before any model work.

Host synchronisation: two reads per iteration (``any(live)`` and the live rows' most ``needed``
candidates in one, to size or skip the forward, and ``all(done)`` to stop), which an eager
decoder's loop needs anyway.

Where this backend differs from the JAX one by construction: sampling (``temperature > 0``) and
``confidence="random"`` draw from ``torch.Generator`` instead of ``jax.random``, so those tokens
are reproducible from the seed but not equal across backends. Greedy decoding with the
``prob``/``margin``/``entropy`` confidences is deterministic and equals the JAX backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from functools import partial

import array_api_compat.torch as xp
import torch

from models import ModelConfig

from ..core import rules
from ..core.config import ENTROPY_BOUND_FAMILY, DecodeConfig
from ..core.decoders import Decoder, Proposal, decoder_for  # the engine's decoders, run on torch tensors
from ..core.errors import InputError
from ..core.predict import ENTROPY_EPS, sequences_forwarded
from ..core.records import DecodeOutput
from ..core.sampling import filters_set, sampler_for

FAMILIES = ("llada", "dream")  # the families this backend's model (``torch_backend.model``) implements


def check_supported(mcfg: ModelConfig, dcfg: DecodeConfig | None = None) -> None:
    """Refuse, by name, what this backend does not implement: block-causal families (LLaDA2.0's and
    SDAR's block diffusion, ``mcfg.block_causal``), families other than LLaDA and Dream, PSD's drafts into the next block,
    LLaDA generate.py's [MASK] rule, token editing and the top-p/top-k filters (``dcfg``). Every policy,
    confidence, decoder and cache is implemented (through ``psd_jax.core.rules``)."""
    if mcfg.family == ENTROPY_BOUND_FAMILY:
        raise InputError(
            "the PyTorch backend does not implement DiffusionGemma (its entropy-bound sampler); decode this "
            "model with the JAX engine (psd_jax.load_model)"
        )
    if mcfg.block_causal:
        raise InputError(
            f"the PyTorch backend does not implement block-causal decoding ({mcfg.family!r}: block diffusion); "
            "decode this model with the JAX engine (psd_jax.load_model)"
        )
    if mcfg.family not in FAMILIES:
        raise InputError(
            f"the PyTorch backend implements the LLaDA and Dream families only, not {mcfg.family!r}; "
            "decode this model with the JAX engine (psd_jax.load_model)"
        )
    if dcfg is not None and dcfg.draft_next_block:
        raise InputError(
            "the PyTorch backend does not implement PSD's drafts into the next block (draft_next_block); "
            "decode with the JAX engine (psd_jax.load_model)"
        )
    if dcfg is not None and dcfg.predict_mask:
        raise InputError(
            "the PyTorch backend does not implement LLaDA generate.py's [MASK] rule (predict_mask); decode with the "
            "JAX engine (psd_jax.load_model)"
        )
    if dcfg is not None and dcfg.trace:
        raise InputError(
            "the PyTorch backend does not record a decode's trace (trace); decode with the JAX engine "
            "(psd_jax.load_model)"
        )
    if dcfg is not None and dcfg.decoder == "edit":
        raise InputError(
            "the PyTorch backend does not implement token editing (decoder 'edit', LLaDA2.1's); decode with the JAX "
            "engine (psd_jax.load_model)"
        )
    if dcfg is not None and filters_set(dcfg):
        raise InputError(
            f"the PyTorch backend does not implement {' and '.join(filters_set(dcfg))} filtering; decode with "
            "the JAX engine (psd_jax.load_model)"
        )


# ------------------------------------------------------------------------------ predictions


@dataclasses.dataclass
class Prediction:
    token: torch.Tensor  # [..., N] predicted token (int64)
    conf: torch.Tensor  # [..., N] float32 policy confidence
    entropy: torch.Tensor | None = None  # [..., N] full-vocabulary entropy (RPS)
    topk_prob: torch.Tensor | None = None  # [..., N, k_max] (RPS)
    topk_id: torch.Tensor | None = None  # [..., N, k_max] (RPS)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Prediction:
        # getattr, not dataclasses.astuple: astuple deep-copies every tensor.
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Prediction(*(None if v is None else fn(v) for v in values))


def logits_to_prediction(
    logits: torch.Tensor,
    mcfg: ModelConfig,
    dcfg: DecodeConfig,
    gumbel: torch.Tensor | None = None,
    random_conf: torch.Tensor | None = None,
):
    """Token choice and confidence from (shifted) logits [M, N, V]; modifies ``logits`` in place.

    Returns a tuple (token, conf, entropy, topk_prob, topk_id) so that it can be compiled.
    Random inputs (Gumbel noise, random confidences) are drawn by the caller.
    """
    logits[..., mcfg.mask_id] = -torch.inf  # never predict [MASK]
    if dcfg.logits_eos_inf:
        logits[..., mcfg.eos_id] = -torch.inf
    if dcfg.temperature > 0:
        token = torch.argmax(logits / dcfg.temperature + gumbel, dim=-1)
        if sampler_for(mcfg.family).confidence == "sampled":  # Dream: scored on what the token is drawn from
            logits = logits / dcfg.temperature
    else:
        token = torch.argmax(logits, dim=-1)
    token = torch.where(token == mcfg.mask_id, mcfg.eos_id, token)  # as the engine: a commit writes a token
    if dcfg.confidence_eos_eot_inf and mcfg.eot_id is not None:
        logits[..., mcfg.eot_id] = -torch.inf
    probs = torch.softmax(logits, dim=-1)
    entropy = None
    if dcfg.confidence == "entropy" or dcfg.decoder == "rps":
        entropy = -torch.sum(probs * torch.log(probs + ENTROPY_EPS), dim=-1)
    if dcfg.confidence == "prob":
        conf = probs.gather(-1, token[..., None])[..., 0]
    elif dcfg.confidence == "margin":
        top2 = torch.topk(probs, 2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif dcfg.confidence == "entropy":
        conf = -entropy
    else:
        conf = random_conf
    topk_prob = topk_id = None
    if dcfg.decoder == "rps":
        topk_prob, topk_id = torch.topk(probs, dcfg.k_max, dim=-1)
    return token, conf.float(), entropy, topk_prob, topk_id


class Predictor:
    """The model calls: canvases [B, K, N] -> ``Prediction`` [B, K, N] (see psd_jax.core.predict), and
    with a block KV cache the full forward that fills it (``prefill``) and the window calls
    against it (``window``).

    With ``compile=True`` each call's forward and logits-to-prediction step are one
    ``torch.compile``d function (static shapes; random draws stay outside it, so the compiled
    graph is pure).
    """

    def __init__(self, model: torch.nn.Module, mcfg: ModelConfig, dcfg: DecodeConfig, compile: bool = False):
        self.model, self.mcfg, self.dcfg = model, mcfg, dcfg
        cores = (self._forward_predict, self._prefill_predict, self._window_predict)
        if compile:
            # One graph per (shape, mask or not, settings): several per decode, across decoders.
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
            dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
            cores = tuple(torch.compile(core, dynamic=False) for core in cores)
        self._core, self._prefill_core, self._window_core = cores

    def _forward_predict(self, flat, mask, logit_index, prompt_length: int, gumbel, random_conf):
        dcfg, mcfg = self.dcfg, self.mcfg
        if dcfg.cfg_scale > 0:
            # Classifier-free guidance: the prompt replaced by [MASK] gives the unconditional branch.
            uncond = flat.clone()
            uncond[:, :prompt_length] = mcfg.mask_id
            both_mask = None if mask is None else torch.cat([mask, mask])
            both = self.model(torch.cat([flat, uncond]), both_mask, torch.cat([logit_index, logit_index]))
            cond_logits, uncond_logits = both.chunk(2)
            logits = uncond_logits + (dcfg.cfg_scale + 1.0) * (cond_logits - uncond_logits)
        else:
            logits = self.model(flat, mask, logit_index)
        return logits_to_prediction(logits, mcfg, dcfg, gumbel, random_conf)

    def _prefill_predict(self, canvas, mask, logit_index, gumbel, random_conf):
        logits, keys, values = self.model.prefill(canvas, mask, logit_index)
        return logits_to_prediction(logits, self.mcfg, self.dcfg, gumbel, random_conf), keys, values

    def _window_predict(self, tokens, positions, keys, values, key_mask, out_length: int, gumbel, random_conf):
        logits = self.model.window(tokens, positions, keys, values, key_mask, out_length)
        return logits_to_prediction(logits, self.mcfg, self.dcfg, gumbel, random_conf)

    def _draws(self, shape: tuple[int, int], device, generator: torch.Generator | None):
        """(Gumbel noise [*shape, V], random confidences [*shape]) where the settings need them."""
        gumbel = random_conf = None
        if self.dcfg.temperature > 0:  # Gumbel-max sampling, as LLaDA's add_gumbel_noise
            u = torch.rand((*shape, self.mcfg.vocab_size), generator=generator, device=device)
            gumbel = -torch.log(-torch.log(u.clamp_(min=torch.finfo(torch.float32).tiny)))
        if self.dcfg.confidence == "random":
            random_conf = torch.rand(shape, generator=generator, device=device)
        return gumbel, random_conf

    def __call__(
        self, canvases, attention_mask, prompt_length: int, window: tuple, generator: torch.Generator | None
    ) -> Prediction:
        """One call over canvases [B, K, N], logits only in the rows' logit ``window`` ((start [B],
        width), ``logit_window``): Prediction [B, K, N] (``on_canvas``)."""
        b, k, n = canvases.shape
        flat = canvases.reshape(b * k, n)
        mask = None if attention_mask is None else attention_mask.repeat_interleave(k, dim=0)
        start, width = window[0].repeat_interleave(k), window[1]
        logit_index = rules.logit_index(xp, start, width, n, self.mcfg.logit_shift)
        draws = self._draws((b * k, width), canvases.device, generator)
        win = Prediction(*self._core(flat, mask, logit_index, prompt_length, *draws))
        placed = on_canvas(win, flat, rules.logit_positions(xp, start, width))
        return placed.map(lambda a: a.reshape(b, k, *a.shape[1:]))

    def prefill(self, canvas, attention_mask, window: tuple, generator: torch.Generator | None):
        """Full forward of canvas [B, N] with logits in the logit ``window`` only: (Prediction
        [B, N], keys, values [L, B, KV, N, hd])."""
        start, width = window
        logit_index = rules.logit_index(xp, start, width, canvas.shape[1], self.mcfg.logit_shift)
        draws = self._draws((canvas.shape[0], width), canvas.device, generator)
        out, keys, values = self._prefill_core(canvas, attention_mask, logit_index, *draws)
        return on_canvas(Prediction(*out), canvas, rules.logit_positions(xp, start, width)), keys, values

    def window(self, tokens, positions, cache, key_mask, out_length: int, generator) -> Prediction:
        """Window call, tokens/positions [B*M, W] against the cache -> Prediction [B*M, out_length]
        of the first ``out_length`` window positions (unshifted: the caller places them)."""
        draws = self._draws((tokens.shape[0], out_length), tokens.device, generator)
        return Prediction(*self._window_core(tokens, positions, *cache, key_mask, out_length, *draws))


def on_canvas(win: Prediction, canvas: torch.Tensor, positions: torch.Tensor) -> Prediction:
    """A Prediction of the window's positions [M, W] (``positions``) -> of the canvas [M, N]: a
    position without logits predicts its current token with zero confidence (``predict.on_canvas``);
    positions past the canvas end are dropped."""
    m, n = canvas.shape
    rows = torch.arange(m, device=canvas.device)[:, None]
    at = torch.where(positions < n, positions, n)  # one spare column takes what is dropped

    def put(field: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        base[rows, at] = field.to(base.dtype)
        return base[:, :n]

    placed = win.map(lambda f: put(f, f.new_zeros((m, n + 1, *f.shape[2:]))))
    spare = canvas.new_zeros((m, 1))
    placed.token = put(win.token, torch.cat([canvas, spare], dim=1))
    return placed


# --------------------------------------------------------------------------------- decoders


def propose(loop: Loop, pred: Prediction, canvas, valid, step) -> Proposal:
    """The policy's commit and the decoder's candidates built on it: the engine's decoder object
    (``decoders.DECODERS``) over this namespace (``Loop.decoder``)."""
    return loop.decoder.propose(pred, canvas, valid, step)


def initial_stats(loop: Loop, batch: int, device) -> dict:
    """The engine's decoder statistics (same names and shapes), as zero torch counters."""
    shapes = loop.decoder.stat_shapes(batch)
    return {name: torch.zeros(shape, dtype=torch.long, device=device) for name, shape in shapes.items()}


# ------------------------------------------------------------------------------------ loop


@dataclasses.dataclass(frozen=True)
class Loop:
    """The static pieces of one decode (the engine's ``Loop``): settings, model calls, geometry."""

    mcfg: ModelConfig
    dcfg: DecodeConfig
    prompt_length: int
    predictor: Predictor
    counts: torch.Tensor | None  # the scheduled policies' count table on the decode's device
    attention_mask: torch.Tensor | None  # [B, N], None when nothing is padded
    generator: torch.Generator | None

    @functools.cached_property
    def decoder(self) -> Decoder:
        """The engine's decoder of these settings (``decoders.decoder_for``), its rules run on torch
        tensors; the settings are its runtime values too (one Python number each)."""
        return decoder_for(self.dcfg, self.dcfg, xp, self.counts)

    def block_start(self, block: torch.Tensor) -> torch.Tensor:
        return rules.block_start(self.prompt_length, block, self.dcfg.block_length)

    def committable(self, canvas: torch.Tensor, block: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
        """M(x): masked positions of each row's current block ([B, N]); nothing for frozen rows."""
        b, mask_id = self.dcfg.block_length, self.mcfg.mask_id
        return rules.committable(xp, canvas, self.block_start(block), frozen, b, mask_id)

    def advance(self, canvas, block, step, done):
        """Rows whose block is complete move on; rows stop at the end or at EOS (``rules.advance``)."""
        return rules.advance(xp, canvas, block, step, done, self.prompt_length, self.mcfg, self.dcfg, self.dcfg)

    def logit_window(self, block: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(start [B], width) of the positions a call computes logits for: the engine's window
        (``rules.logit_window``), or every generated position where that covers them all."""
        window = rules.logit_window(self.dcfg, self.prompt_length, self.dcfg.gen_length, block)
        return window or (torch.full_like(block, self.prompt_length), self.dcfg.gen_length)


@dataclasses.dataclass
class DecodeState:
    """The loop's carry (the engine's ``DecodeState``): per-row tensors and batch-wide counters."""

    canvas: torch.Tensor  # [B, N]
    pred: Prediction  # forward of `canvas`, [B, N]
    block: torch.Tensor  # [B] current block index
    step: torch.Tensor  # [B] schedule step within the block
    done: torch.Tensor  # [B] bool
    row_nfe: torch.Tensor  # [B] model calls while the row was still decoding
    nfe: int  # model calls
    sequence_forwards: int  # sequences processed by the model
    iterations: int
    stats: dict

    @classmethod
    def start(cls, loop: Loop, canvas: torch.Tensor, pred: Prediction) -> DecodeState:
        """The state after the decode's first forward ``pred`` of ``canvas`` (one model call)."""
        batch = canvas.shape[0]
        zeros = torch.zeros(batch, dtype=torch.long, device=canvas.device)
        sequences = batch * (2 if loop.dcfg.cfg_scale > 0 else 1)
        stats = initial_stats(loop, batch, canvas.device)
        return cls(canvas, pred, zeros, zeros.clone(), zeros.bool(), zeros + 1, 1, sequences, 0, stats)

    def output(self) -> DecodeOutput:
        return DecodeOutput(self.canvas, self.row_nfe, self.nfe, self.sequence_forwards, self.iterations, self.stats)


def decode_uncached(loop: Loop, canvas: torch.Tensor) -> DecodeOutput:
    """The uncached loop: every call forwards whole canvases (the engine's ``step``)."""
    call = partial(
        loop.predictor, attention_mask=loop.attention_mask, prompt_length=loop.prompt_length, generator=loop.generator
    )
    batch = canvas.shape[0]
    first = loop.logit_window(torch.zeros(batch, dtype=torch.long, device=canvas.device))
    state = DecodeState.start(loop, canvas, call(canvas[:, None], window=first).map(lambda a: a[:, 0]))
    while True:
        valid = loop.committable(state.canvas, state.block, state.done)
        proposal = propose(loop, state.pred, state.canvas, valid, state.step)
        # A row is live if it still decodes after its policy commit; only live rows need a forward.
        live = ~loop.advance(proposal.s0, state.block, state.step + 1, state.done)[3]
        # No row live: no call (every row finishes with its policy commit, the engine's `skip`).
        window = loop.logit_window(state.block)
        preds, calls, size = forward_leading(partial(call, window=window), proposal, live, state.pred)
        sequences = sequences_forwarded(batch, size, loop.dcfg)
        state = apply_choice(loop, state, proposal, preds, live, state.done, live.long(), calls, sequences)
        if bool(state.done.all()):
            return state.output()


def apply_choice(
    loop: Loop,
    state: DecodeState,
    proposal: Proposal,
    preds: Prediction,
    live: torch.Tensor,
    frozen: torch.Tensor,
    row_calls: torch.Tensor,
    calls: int,
    sequences: int,
) -> DecodeState:
    """The tail of an iteration shared by both loops: each row's choice, its canvas and forward,
    block advance, counters. ``frozen`` rows (finished, or waiting for a block-start refresh)
    keep their canvas and step."""
    choice = loop.decoder.choose(proposal, preds, live, state.step, loop.mcfg.mask_id)
    index, steps, increments = choice.index, choice.steps, choice.stats
    rows = torch.arange(index.shape[0], device=index.device)
    canvas = torch.where(frozen[:, None], state.canvas, proposal.candidates[rows, index])
    steps = state.step + torch.where(frozen, 0, steps)
    canvas, block, step, done = loop.advance(canvas, state.block, steps, frozen)
    return DecodeState(
        canvas,
        preds.map(lambda a: a[rows, index]),
        block,
        step,
        done,
        state.row_nfe + row_calls,
        state.nfe + calls,
        state.sequence_forwards + sequences,
        state.iterations + 1,
        {name: value + increments[name] for name, value in state.stats.items()},
    )


def canvas_mask(prompt_mask: torch.Tensor | None, gen_length: int) -> torch.Tensor | None:
    """The canvas attention mask, or None when nothing is padded (SDPA then takes its unmasked kernel)."""
    if prompt_mask is None or bool(prompt_mask.bool().all()):
        return None
    gen_mask = torch.ones(prompt_mask.shape[0], gen_length, dtype=torch.long, device=prompt_mask.device)
    return torch.cat([prompt_mask.long(), gen_mask], dim=1)


def broadcast(pred: Prediction, k: int) -> Prediction:
    """A Prediction [B, ...] repeated as the prediction of K candidates [B, K, ...] (a view)."""
    return pred.map(lambda a: a[:, None].expand(a.shape[0], k, *a.shape[1:]))


def forward_leading(
    call: Callable, proposal: Proposal, rows: torch.Tensor, pred: Prediction
) -> tuple[Prediction, int, int]:
    """(predictions [B, K, ...], calls made, candidates forwarded) of one call over the leading
    candidates some of ``rows`` can choose, in the engine's static sizes; the others repeat
    candidate 0's prediction (no row can choose them). No call when no row needs one: the
    predictions are then ``pred`` repeated."""
    k = proposal.candidates.shape[1]
    sizes = rules.forward_sizes(k)
    index = rules.covering_index(xp, sizes, rules.most_needed(xp, proposal.needed, rows))
    any_row, index = torch.stack([rows.any().long(), index.long()]).tolist()
    if not any_row:
        return broadcast(pred, k), 0, 0
    size = sizes[index]
    preds = call(proposal.candidates[:, :size])
    if size < k:
        preds = preds.map(lambda a: torch.cat([a, a[:, :1].expand(a.shape[0], k - size, *a.shape[2:])], dim=1))
    return preds, 1, size
