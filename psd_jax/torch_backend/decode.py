"""The decoders (plain, PSD, RPS) over the PyTorch model, with the JAX engine's exact semantics.

This is ``psd_jax.engine`` + ``decoders`` + ``policies`` + ``predict`` written as a PyTorch user
would: eager tensors under ``torch.inference_mode``, a Python ``while`` loop over iterations,
every per-row decision a batched tensor op (no Python loop over rows), and all candidates of all
rows verified in ONE model call of shape ``[B*K, N]``. The semantics are the engine's, token for
token (the JAX engine is the spec):

- rows decode independently: own block, own schedule step, own ``done`` flag;
- one iteration = policy commit ``s0`` and the candidates (no model call) -> one batched forward
  of all candidates -> per-row choice -> block advance / EOS early exit;
- a row is *live* when it still decodes after its policy commit; when no row is live the forward
  is skipped (so the last, unused forward of upstream's loop is never run), and ``row_nfe``
  counts a row's calls only while it is live;
- a call forwards only the leading candidates some live row can choose (PSD levels up to the
  first empty one, RPS branches that pass the ratio filter), rounded up to one of the engine's
  ``forward_sizes`` (s0 alone, about half, all K), so the sequence counts equal the engine's;
- ``nfe`` counts model calls (the initial forward included), ``sequence_forwards`` the sequences
  the model processed (``B*K`` per full call, doubled under classifier-free guidance).

With ``cache="prefix"|"dual"`` the loop is ``torch_backend.cache`` (Fast-dLLM's block KV cache,
the engine's ``step_cached``); it shares this module's predictions, policies, decoders and
``apply_choice``.

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
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from models import ModelConfig

from ..config import DecodeConfig
from ..decoders import decoder_for, forward_sizes  # the engine's decoders' static sizes and statistics
from ..policies import step_counts  # the engine's own count tables (numpy)
from ..predict import ENTROPY_EPS, sequences_forwarded
from ..records import DecodeOutput

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


def shift_logits(logits: torch.Tensor, shift: int) -> torch.Tensor:
    """Dream predicts position i at logit i - 1: ``cat(logits[:, :1], logits[:, :-1])``."""
    if shift == 0:
        return logits
    return torch.cat([logits[:, :shift], logits[:, :-shift]], dim=1)


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
    else:
        token = torch.argmax(logits, dim=-1)
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
    """The model calls: canvases [B, K, N] -> ``Prediction`` [B, K, N] (see psd_jax.predict), and
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

    def _forward_predict(self, flat, mask, prompt_length: int, gumbel, random_conf):
        dcfg, mcfg = self.dcfg, self.mcfg
        if dcfg.cfg_scale > 0:
            # Classifier-free guidance: the prompt replaced by [MASK] gives the unconditional branch.
            uncond = flat.clone()
            uncond[:, :prompt_length] = mcfg.mask_id
            both = self.model(torch.cat([flat, uncond]), None if mask is None else torch.cat([mask, mask]))
            cond_logits, uncond_logits = both.chunk(2)
            logits = uncond_logits + (dcfg.cfg_scale + 1.0) * (cond_logits - uncond_logits)
        else:
            logits = self.model(flat, mask)
        logits = shift_logits(logits, mcfg.logit_shift)
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

    def __call__(self, canvases, attention_mask, prompt_length: int, generator: torch.Generator | None) -> Prediction:
        b, k, n = canvases.shape
        flat = canvases.reshape(b * k, n)
        mask = None if attention_mask is None else attention_mask.repeat_interleave(k, dim=0)
        out = self._core(flat, mask, prompt_length, *self._draws((b * k, n), canvases.device, generator))
        return Prediction(*out).map(lambda a: a.reshape(b, k, *a.shape[1:]))

    def prefill(self, canvas, attention_mask, logit_index, generator: torch.Generator | None):
        """Full forward of canvas [B, N] with logits at ``logit_index`` [B, W] only:
        (Prediction [B, W] of those logits, keys, values [L, B, KV, N, hd])."""
        draws = self._draws(tuple(logit_index.shape), canvas.device, generator)
        out, keys, values = self._prefill_core(canvas, attention_mask, logit_index, *draws)
        return Prediction(*out), keys, values

    def window(self, tokens, positions, cache, key_mask, out_length: int, generator) -> Prediction:
        """Window call, tokens/positions [B*M, W] against the cache -> Prediction [B*M, out_length]
        of the first ``out_length`` window positions (unshifted: the caller places them)."""
        draws = self._draws((tokens.shape[0], out_length), tokens.device, generator)
        return Prediction(*self._window_core(tokens, positions, *cache, key_mask, out_length, *draws))


# --------------------------------------------------------------------------------- policies


def ranks(conf: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rank of each valid position by confidence descending (ties: lower position); invalid last.

    One stable sort on ``-conf`` with invalid positions keyed ``+inf``: the same order as the JAX
    ``lexsort((index, -conf, ~valid))`` for any finite confidence (all confidences are finite).
    """
    key = torch.where(valid, -conf, torch.inf)
    order = torch.sort(key, dim=-1, stable=True).indices
    positions = torch.arange(conf.shape[-1], device=conf.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


class Policy:
    """The transfer policy with its schedule table on the decode's device."""

    def __init__(self, dcfg: DecodeConfig, device):
        self.dcfg = dcfg
        counts = step_counts(dcfg)
        self.counts = None if counts is None else torch.as_tensor(counts, dtype=torch.long, device=device)

    def scheduled_count(self, step: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        last = self.counts.shape[0] - 1
        k = self.counts[step.clamp(0, last)]
        return torch.where(step >= last, remaining, k)

    def commit_mask(self, conf, valid, step) -> torch.Tensor:
        """The commit set S for rows [B]: conf/valid [B, N], step [B]."""
        dcfg = self.dcfg
        rank = ranks(conf, valid)
        remaining = valid.sum(-1)
        if dcfg.policy in ("fixed", "dream"):
            chosen = rank < self.scheduled_count(step, remaining)[:, None]
        elif dcfg.policy == "threshold":
            chosen = (rank == 0) | (conf >= dcfg.threshold)
        else:
            chosen = rank < factor_count(conf, valid, remaining, dcfg.factor)[:, None]
        return chosen & valid

    def draft_sizes(self, chosen: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """PSD m_j for levels j = 1..D per row [B, D] (as psd_jax.decoders._draft_sizes)."""
        dcfg = self.dcfg
        batch = chosen.shape[0]
        if dcfg.policy == "fixed":
            n_counts = self.counts.shape[0]
            nxt = step[:, None] + torch.arange(1, dcfg.depth + 1, device=step.device)
            return torch.where(nxt < n_counts, self.counts[nxt.clamp(0, n_counts - 1)], 0)
        if dcfg.draft_rate is not None:
            rate = torch.full((batch,), dcfg.draft_rate, dtype=torch.long, device=chosen.device)
        else:
            rate = chosen.sum(-1).clamp(min=1)
        return rate[:, None].expand(batch, dcfg.depth)


def factor_count(conf, valid, remaining, factor: float) -> torch.Tensor:
    """Fast-dLLM get_transfer_index_dynamic (upstream quirk kept: see psd_jax.policies)."""
    n = conf.shape[-1]
    sorted_conf = -torch.sort(torch.where(valid, -conf, torch.inf), dim=-1).values
    k = torch.arange(n, device=conf.device)
    passes = (sorted_conf >= 1.0 - factor / (k + 2.0)) | (k == 0)
    leading = torch.cumprod((passes & (k < remaining[:, None])).long(), dim=-1).sum(-1)
    return torch.where(leading >= remaining - 1, remaining, leading)


# --------------------------------------------------------------------------------- decoders


@dataclasses.dataclass
class Proposal:
    candidates: torch.Tensor  # [B, K, N]
    s0: torch.Tensor  # [B, N]
    valid: torch.Tensor  # [B, N]
    added: torch.Tensor  # [B, K, N]
    needed: torch.Tensor  # [B] leading candidates the row can choose from (1: only s0)
    extra: dict


def propose(policy: Policy, pred: Prediction, canvas, valid, step) -> Proposal:
    dcfg = policy.dcfg
    chosen = policy.commit_mask(pred.conf, valid, step)
    s0 = torch.where(chosen, pred.token, canvas)
    if dcfg.decoder == "psd":
        return _psd_propose(policy, pred, s0, chosen, valid, step)
    if dcfg.decoder == "rps":
        return _rps_propose(dcfg, pred, s0, chosen, valid)
    no = torch.zeros_like(valid)
    return Proposal(s0[:, None], s0, valid, no[:, None], torch.ones_like(step), {})


def choose(policy: Policy, proposal: Proposal, preds: Prediction, live, step, mask_id: int):
    """(index [B], schedule steps consumed [B], stats increments) given every candidate's forward."""
    dcfg = policy.dcfg
    if dcfg.decoder == "psd":
        return _psd_choose(policy, proposal, preds, live, step, mask_id)
    if dcfg.decoder == "rps":
        return _rps_choose(dcfg, proposal, preds, live)
    zeros = torch.zeros_like(step)
    return zeros, zeros + 1, {}


def initial_stats(dcfg: DecodeConfig, batch: int, device) -> dict:
    """The engine's decoder statistics (same names and shapes), as zero torch counters."""
    shapes = decoder_for(dcfg).stat_shapes(batch)
    return {name: torch.zeros(shape, dtype=torch.long, device=device) for name, shape in shapes.items()}


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """[B, J] bool -> [B] long: how many leading entries are True."""
    return torch.cumprod(flags.long(), dim=-1).sum(-1)


def _psd_propose(policy: Policy, pred, s0, chosen, valid, step) -> Proposal:
    remaining = valid & ~chosen
    rank = ranks(pred.conf, remaining)
    sizes = policy.draft_sizes(chosen, step)  # [B, D]
    ends = sizes.cumsum(-1)
    starts = ends - sizes
    r = rank[:, None, :]
    level = remaining[:, None, :] & (r >= starts[..., None]) & (r < ends[..., None])  # [B, D, N]
    cumulative = level.cumsum(dim=1) > 0  # s_j = s_{j-1} + level j
    drafts = torch.where(cumulative, pred.token[:, None, :], s0[:, None, :])
    candidates = torch.cat([s0[:, None], drafts], dim=1)
    added = torch.cat([torch.zeros_like(level[:, :1]), level], dim=1)
    # Acceptance stops at the first empty level, so the levels after it are never chosen.
    return Proposal(candidates, s0, valid, added, 1 + _leading_true(level.any(-1)), {})


def _psd_choose(policy: Policy, proposal, preds, live, step, mask_id):
    dcfg = policy.dcfg
    level = proposal.added[:, 1:]  # [B, D, N]
    prev_token = preds.token[:, :-1]  # F(s_{j-1}) for j = 1..D
    draft_token = proposal.candidates[:, 1:]
    consistent = (~level | (prev_token == draft_token)).all(-1) & level.any(-1)
    if dcfg.acceptance == "strict":
        # The policy run on F(s_{j-1}) at step + j must choose exactly level j's positions.
        b, d, n = level.shape
        valid_prev = proposal.valid[:, None, :] & (proposal.candidates[:, :-1] == mask_id)
        steps = step[:, None] + torch.arange(1, d + 1, device=step.device)
        policy_choice = policy.commit_mask(
            preds.conf[:, :-1].reshape(b * d, n), valid_prev.reshape(b * d, n), steps.reshape(b * d)
        ).reshape(b, d, n)
        consistent &= (policy_choice == level).all(-1)
    accepted = _leading_true(consistent)
    accepted = torch.where(live, accepted, 0)
    hist = F.one_hot(accepted, dcfg.depth + 1) * live[:, None]
    return accepted, 1 + accepted, {"accepted_depth": hist}


def _rps_propose(dcfg: DecodeConfig, pred, s0, chosen, valid) -> Proposal:
    remaining = valid & ~chosen
    p, ids = pred.topk_prob, pred.topk_id  # [B, N, k] from F(x)
    mass = p.sum(-1)
    trunc_entropy = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)
    eligible = remaining & (mass >= dcfg.pivot_tau)
    found = eligible.any(-1)
    pivot = torch.argmax(torch.where(eligible, trunc_entropy, -torch.inf), dim=-1)  # ties: lower position
    rows = torch.arange(s0.shape[0], device=s0.device)
    pivot_p, pivot_ids = p[rows, pivot], ids[rows, pivot]  # [B, k]
    branch_ok = found[:, None] & (pivot_p >= dcfg.ratio * pivot_p[:, :1])
    at_pivot = torch.arange(s0.shape[-1], device=s0.device) == pivot[:, None]  # [B, N]
    branches = torch.where(at_pivot[:, None, :], pivot_ids[:, :, None], s0[:, None, :])  # [B, k, N]
    candidates = torch.cat([s0[:, None], branches], dim=1)
    added = torch.cat([torch.zeros_like(at_pivot[:, None]), at_pivot[:, None].expand_as(branches)], dim=1)
    extra = {
        "searched": remaining.any(-1),
        "found": found,
        "branch_ok": branch_ok,
        "log_p": torch.log(pivot_p.clamp(min=1e-30)),
        "others": remaining & ~at_pivot,
    }
    return Proposal(candidates, s0, valid, added, 1 + _leading_true(branch_ok), extra)


def _rps_choose(dcfg: DecodeConfig, proposal, preds, live):
    e = proposal.extra
    others = e["others"][:, None, :]  # R \ {i*}
    n_others = others.sum(-1).clamp(min=1)
    mean_entropy = torch.where(others, preds.entropy, 0.0).sum(-1) / n_others  # [B, K]
    plausibility = torch.cat([torch.zeros_like(e["log_p"][:, :1]), e["log_p"]], dim=1)
    score = -mean_entropy + dcfg.lam * plausibility
    ok = torch.cat([torch.ones_like(e["branch_ok"][:, :1]), e["branch_ok"]], dim=1)
    winner = torch.argmax(torch.where(ok, score, -torch.inf), dim=-1)  # ties: MASK first
    winner = torch.where(live, winner, 0)
    committed = winner > 0
    stats = {
        "pivot_searched": (e["searched"] & live).long(),
        "pivot_found": (e["found"] & live).long(),
        "pivot_committed": committed.long(),
        "winner_rank": F.one_hot((winner - 1).clamp(min=0), dcfg.k_max) * committed[:, None],
    }
    return winner, torch.ones_like(winner), stats


# ------------------------------------------------------------------------------------ loop


class Blocks:
    """Block geometry of one decode (``Loop.in_block``/``advance`` of the JAX engine)."""

    def __init__(self, mcfg: ModelConfig, dcfg: DecodeConfig, prompt_length: int, device):
        self.mcfg, self.dcfg, self.prompt_length = mcfg, dcfg, prompt_length
        self.pos = torch.arange(prompt_length + dcfg.gen_length, device=device)[None, :]
        self.stop_ids = torch.tensor(mcfg.stop_ids, device=device)

    def span(self, block):
        start = self.prompt_length + block * self.dcfg.block_length
        return start, start + self.dcfg.block_length

    def in_block(self, block):
        start, end = self.span(block)
        return (self.pos >= start[:, None]) & (self.pos < end[:, None])

    def advance(self, canvas, block, step, done):
        """Rows whose block is complete move on; rows stop at the end or at EOS (early exit)."""
        in_block = self.in_block(block)
        complete = ~(in_block & (canvas == self.mcfg.mask_id)).any(-1) & ~done
        stops = torch.isin(canvas, self.stop_ids)
        eos_stop = complete & (in_block & stops).any(-1) & self.dcfg.eos_early_stop
        _, end = self.span(block)
        canvas = torch.where(eos_stop[:, None] & (self.pos >= end[:, None]), self.mcfg.eos_id, canvas)
        new_done = done | eos_stop | (complete & (block + 1 >= self.dcfg.num_blocks))
        block = torch.where(complete & ~new_done, block + 1, block)
        step = torch.where(complete, 0, step)
        return canvas, block, step, new_done


@dataclasses.dataclass(frozen=True)
class Loop:
    """The static pieces of one decode (the engine's ``Loop``): settings, model calls, geometry."""

    mcfg: ModelConfig
    dcfg: DecodeConfig
    prompt_length: int
    predictor: Predictor
    policy: Policy
    blocks: Blocks
    attention_mask: torch.Tensor | None  # [B, N], None when nothing is padded
    generator: torch.Generator | None

    def committable(self, canvas: torch.Tensor, block: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
        """M(x): masked positions of each row's current block ([B, N]); nothing for frozen rows."""
        return (canvas == self.mcfg.mask_id) & self.blocks.in_block(block) & ~frozen[:, None]


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
        stats = initial_stats(loop.dcfg, batch, canvas.device)
        return cls(canvas, pred, zeros, zeros.clone(), zeros.bool(), zeros + 1, 1, sequences, 0, stats)

    def output(self) -> DecodeOutput:
        return DecodeOutput(self.canvas, self.row_nfe, self.nfe, self.sequence_forwards, self.iterations, self.stats)


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    settings: DecodeConfig,
    mcfg: ModelConfig,
    *,
    generator: torch.Generator | None = None,
    predictor: Predictor | None = None,
) -> DecodeOutput:
    """Decode left-padded prompts [B, P] (0/1 mask [B, P] or None) with the JAX engine's semantics;
    ``settings.cache`` "prefix"/"dual" runs Fast-dLLM's block KV cache (``torch_backend.cache``)."""
    dcfg = settings  # checked when made: a cache with classifier-free guidance is refused there
    device = prompt_ids.device
    batch, prompt_length = prompt_ids.shape
    loop = Loop(
        mcfg,
        dcfg,
        prompt_length,
        predictor or Predictor(model, mcfg, dcfg),
        Policy(dcfg, device),
        Blocks(mcfg, dcfg, prompt_length, device),
        _canvas_mask(prompt_mask, dcfg.gen_length),
        generator,
    )
    gen = torch.full((batch, dcfg.gen_length), mcfg.mask_id, dtype=torch.long, device=device)
    canvas = torch.cat([prompt_ids.long(), gen], dim=1)
    if dcfg.cache != "none":
        from .cache import decode_cached  # builds on this module's loop pieces

        return decode_cached(loop, canvas)
    return _decode(loop, canvas)


def _decode(loop: Loop, canvas: torch.Tensor) -> DecodeOutput:
    """The uncached loop: every call forwards whole canvases (the engine's ``step``)."""
    call = partial(
        loop.predictor, attention_mask=loop.attention_mask, prompt_length=loop.prompt_length, generator=loop.generator
    )
    state = DecodeState.start(loop, canvas, call(canvas[:, None]).map(lambda a: a[:, 0]))
    batch = canvas.shape[0]
    while True:
        valid = loop.committable(state.canvas, state.block, state.done)
        proposal = propose(loop.policy, state.pred, state.canvas, valid, state.step)
        # A row is live if it still decodes after its policy commit; only live rows need a forward.
        live = ~loop.blocks.advance(proposal.s0, state.block, state.step + 1, state.done)[3]
        # No row live: no call (every row finishes with its policy commit, the engine's `skip`).
        preds, calls, size = forward_leading(call, proposal, live, state.pred)
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
    index, steps, increments = choose(loop.policy, proposal, preds, live, state.step, loop.mcfg.mask_id)
    rows = torch.arange(index.shape[0], device=index.device)
    canvas = torch.where(frozen[:, None], state.canvas, proposal.candidates[rows, index])
    steps = state.step + torch.where(frozen, 0, steps)
    canvas, block, step, done = loop.blocks.advance(canvas, state.block, steps, frozen)
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


def _canvas_mask(prompt_mask: torch.Tensor | None, gen_length: int) -> torch.Tensor | None:
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
    any_row, most_needed = torch.stack([rows.any().long(), torch.where(rows, proposal.needed, 1).max()]).tolist()
    k = proposal.candidates.shape[1]
    if not any_row:
        return broadcast(pred, k), 0, 0
    size = min(s for s in forward_sizes(k) if s >= most_needed)
    preds = call(proposal.candidates[:, :size])
    if size < k:
        preds = preds.map(lambda a: torch.cat([a, a[:, :1].expand(a.shape[0], k - size, *a.shape[2:])], dim=1))
    return preds, 1, size
