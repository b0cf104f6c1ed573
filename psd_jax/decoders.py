"""The three decoders, as two pure functions each around the single batched model call.

``propose`` builds the K candidate canvases of every row from the current forward ``F(x)``
without calling the model; the engine forwards all ``[B, K, N]`` canvases at once; ``choose``
picks one candidate per row (its forward becomes the next ``F``). This is the only place plain
decoding, PSD and RPS differ; all three reuse the same policies.

- plain: K = 1, the policy's commit ``s0``.
- PSD (algorithms.md "PSD"): ``s0`` plus D temporal drafts ``s1..sD`` from the same ``F(x)``;
  hierarchical acceptance keeps the deepest consistent level.
- RPS (algorithms.md "RPS"): ``s0`` plus one branch per pivot candidate; the branch with the best
  lookahead score wins (branch 0, the MASK branch, is ``s0`` itself).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .config import DecodeConfig
from .policies import commit_mask, ranks, step_counts
from .predict import Prediction


@struct.dataclass
class Proposal:
    candidates: jax.Array  # [B, K, N] canvases to forward
    s0: jax.Array  # [B, N] the policy's commit (candidate 0)
    valid: jax.Array  # [B, N] masked positions of the current block before the commit
    added: jax.Array  # [B, K, N] positions each candidate commits beyond s0 (PSD: level j's own)
    needed: jax.Array  # [B] leading candidates the row can choose from (1: only s0); the rest need no forward
    extra: dict  # decoder-specific values needed by `choose`


@struct.dataclass
class Choice:
    index: jax.Array  # [B] chosen candidate
    steps: jax.Array  # [B] schedule steps consumed (1 + accepted PSD levels)
    stats: dict  # decoder statistics increments


def initial_stats(dcfg: DecodeConfig, batch: int) -> dict:
    """Per-row decoder statistics carried in the loop state."""
    if dcfg.decoder == "psd":
        return {"accepted_depth": jnp.zeros((batch, dcfg.depth + 1), jnp.int32)}
    if dcfg.decoder == "rps":
        return {
            "pivot_searched": jnp.zeros(batch, jnp.int32),
            "pivot_found": jnp.zeros(batch, jnp.int32),
            "pivot_committed": jnp.zeros(batch, jnp.int32),
            "winner_rank": jnp.zeros((batch, dcfg.k_max), jnp.int32),
        }
    return {}


def spatial_commit(pred: Prediction, canvas: jax.Array, valid: jax.Array, step: jax.Array, dcfg: DecodeConfig):
    """The policy step shared by every decoder: (commit mask S0, canvas s0)."""
    chosen = commit_mask(pred.conf, valid, step, dcfg)
    return chosen, jnp.where(chosen, pred.token, canvas)


def propose(pred: Prediction, canvas: jax.Array, valid: jax.Array, step: jax.Array, dcfg: DecodeConfig) -> Proposal:
    chosen, s0 = spatial_commit(pred, canvas, valid, step, dcfg)
    if dcfg.decoder == "psd":
        return _psd_propose(pred, s0, chosen, valid, step, dcfg)
    if dcfg.decoder == "rps":
        return _rps_propose(pred, s0, chosen, valid, dcfg)
    return Proposal(s0[:, None], s0, valid, jnp.zeros_like(s0, bool)[:, None], jnp.ones(s0.shape[:1], jnp.int32), {})


def choose(proposal: Proposal, preds: Prediction, live: jax.Array, step: jax.Array, dcfg: DecodeConfig, mask_id: int) -> Choice:
    """Pick one candidate per row given the forward of every candidate (``preds`` [B, K, N])."""
    batch = live.shape[0]
    if dcfg.decoder == "psd":
        return _psd_choose(proposal, preds, live, step, dcfg, mask_id)
    if dcfg.decoder == "rps":
        return _rps_choose(proposal, preds, live, dcfg)
    return Choice(jnp.zeros(batch, jnp.int32), jnp.ones(batch, jnp.int32), {})


def _leading_true(flags: jax.Array) -> jax.Array:
    """[B, J] bool -> [B] int32: how many leading entries are True."""
    return jnp.cumprod(flags, axis=-1).sum(-1).astype(jnp.int32)


def forward_sizes(k: int) -> tuple[int, ...]:
    """The static numbers of leading candidates a call may forward: s0 alone, about half, all K.

    A call forwards the smallest size that covers every live row's ``needed`` candidates (deep PSD
    levels past a block's last step, RPS branches past the ratio filter are never forwarded); three
    sizes keep the compiled model calls few.
    """
    return tuple(sorted({1, (k + 1) // 2, k}))


def forward_size_index(needed: jax.Array, live: jax.Array, k: int) -> jax.Array:
    """Index into ``forward_sizes(k)`` of the call that covers the live rows (0 if none is live)."""
    most = jnp.max(jnp.where(live, needed, 1))
    return jnp.sum(jnp.asarray(forward_sizes(k)) < most).astype(jnp.int32)


# ----------------------------------------------------------------------------------------- PSD


def _draft_sizes(chosen: jax.Array, step: jax.Array, dcfg: DecodeConfig) -> jax.Array:
    """m_j for levels j = 1..D, per row: [B, D]."""
    levels = jnp.arange(1, dcfg.depth + 1)
    if dcfg.policy == "fixed":
        # The schedule's next counts; past the last step nothing is drafted.
        counts = jnp.asarray(step_counts(dcfg))
        nxt = step[:, None] + levels[None, :]
        return jnp.where(nxt < counts.shape[0], counts[jnp.clip(nxt, 0, counts.shape[0] - 1)], 0)
    if dcfg.draft_rate is not None:
        rate = jnp.full(chosen.shape[:1], dcfg.draft_rate, jnp.int32)
    else:
        rate = jnp.maximum(1, chosen.sum(-1)).astype(jnp.int32)
    return jnp.broadcast_to(rate[:, None], (chosen.shape[0], dcfg.depth))


def _psd_propose(pred, s0, chosen, valid, step, dcfg) -> Proposal:
    remaining = valid & ~chosen
    rank = ranks(pred.conf, remaining)  # confidence descending, ties to the lower position
    sizes = _draft_sizes(chosen, step, dcfg)  # [B, D]
    ends = jnp.cumsum(sizes, axis=-1)
    starts = ends - sizes
    level = remaining[:, None, :] & (rank[:, None, :] >= starts[..., None]) & (rank[:, None, :] < ends[..., None])
    cumulative = jnp.cumsum(level, axis=1) > 0  # s_j = s_{j-1} + level j
    drafts = jnp.where(cumulative, pred.token[:, None, :], s0[:, None, :])
    candidates = jnp.concatenate([s0[:, None], drafts], axis=1)
    added = jnp.concatenate([jnp.zeros_like(level[:, :1]), level], axis=1)
    # Acceptance stops at the first empty level, so the levels after it are never chosen.
    return Proposal(candidates, s0, valid, added, 1 + _leading_true(level.any(-1)), {})


def _psd_choose(proposal, preds, live, step, dcfg, mask_id) -> Choice:
    level = proposal.added[:, 1:]  # [B, D, N]
    prev_token = preds.token[:, :-1]  # F(s_{j-1}) for j = 1..D
    draft_token = proposal.candidates[:, 1:]
    consistent = jnp.all(~level | (prev_token == draft_token), axis=-1) & level.any(-1)
    if dcfg.acceptance == "strict":
        # The policy run on F(s_{j-1}) at step + j must choose exactly level j's positions.
        prev_canvas = proposal.candidates[:, :-1]
        valid_prev = proposal.valid[:, None, :] & (prev_canvas == mask_id)
        b, d, n = level.shape
        steps = step[:, None] + jnp.arange(1, d + 1)[None, :]
        policy_choice = commit_mask(
            preds.conf[:, :-1].reshape(b * d, n), valid_prev.reshape(b * d, n), steps.reshape(b * d), dcfg
        ).reshape(b, d, n)
        consistent &= jnp.all(policy_choice == level, axis=-1)
    accepted = _leading_true(consistent)
    accepted = jnp.where(live, accepted, 0)
    hist = jax.nn.one_hot(accepted, dcfg.depth + 1, dtype=jnp.int32) * live[:, None]
    return Choice(accepted, 1 + accepted, {"accepted_depth": hist})


# ----------------------------------------------------------------------------------------- RPS


def _rps_propose(pred, s0, chosen, valid, dcfg) -> Proposal:
    remaining = valid & ~chosen
    p, ids = pred.topk_prob, pred.topk_id  # [B, N, k] from F(x)
    mass = p.sum(-1)
    trunc_entropy = -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)
    eligible = remaining & (mass >= dcfg.pivot_tau)
    found = eligible.any(-1)
    pivot = jnp.argmax(jnp.where(eligible, trunc_entropy, -jnp.inf), axis=-1)  # ties: lower position
    pivot_p = jnp.take_along_axis(p, pivot[:, None, None], axis=1)[:, 0]  # [B, k]
    pivot_ids = jnp.take_along_axis(ids, pivot[:, None, None], axis=1)[:, 0]
    branch_ok = found[:, None] & (pivot_p >= dcfg.ratio * pivot_p[:, :1])
    n = s0.shape[-1]
    at_pivot = jnp.arange(n)[None, :] == pivot[:, None]  # [B, N]
    branches = jnp.where(at_pivot[:, None, :], pivot_ids[:, :, None], s0[:, None, :])  # [B, k, N]
    candidates = jnp.concatenate([s0[:, None], branches], axis=1)
    added = jnp.concatenate([jnp.zeros_like(at_pivot[:, None]), jnp.broadcast_to(at_pivot[:, None], branches.shape)], 1)
    extra = {
        "searched": remaining.any(-1),
        "found": found,
        "pivot": pivot,
        "branch_ok": branch_ok,
        "log_p": jnp.log(jnp.maximum(pivot_p, 1e-30)),
        "others": remaining & ~at_pivot,
    }
    return Proposal(candidates, s0, valid, added, 1 + _leading_true(branch_ok), extra)


def _rps_choose(proposal, preds, live, dcfg) -> Choice:
    e = proposal.extra
    others = e["others"][:, None, :]  # R \ {i*}
    n_others = jnp.maximum(others.sum(-1), 1)
    mean_entropy = jnp.sum(jnp.where(others, preds.entropy, 0.0), axis=-1) / n_others  # [B, K]
    plausibility = jnp.concatenate([jnp.zeros_like(e["log_p"][:, :1]), e["log_p"]], axis=1)
    score = -mean_entropy + dcfg.lam * plausibility
    ok = jnp.concatenate([jnp.ones_like(e["branch_ok"][:, :1]), e["branch_ok"]], axis=1)
    winner = jnp.argmax(jnp.where(ok, score, -jnp.inf), axis=-1).astype(jnp.int32)  # ties: MASK first
    winner = jnp.where(live, winner, 0)
    committed = winner > 0
    live_i = live.astype(jnp.int32)
    stats = {
        "pivot_searched": e["searched"] * live_i,
        "pivot_found": e["found"] * live_i,
        "pivot_committed": committed.astype(jnp.int32),
        "winner_rank": jax.nn.one_hot(winner - 1, dcfg.k_max, dtype=jnp.int32) * committed[:, None],
    }
    return Choice(winner, jnp.ones_like(winner), stats)
