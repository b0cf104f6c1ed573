"""Fast-dLLM's block KV cache (``cache="prefix"|"dual"``) for the PyTorch backend's decoders.

The engine's ``step_cached`` (docs/algorithms.md "Block KV cache") in eager torch, for every
decoder, with the same tokens and call counts as the JAX backend:

- **Block-start refresh.** A row whose block changed since its last full forward (``stale``) gets
  a full forward of its canvas that refreshes its cache rows (every layer's keys after RoPE and
  values) and its prediction: one model call, ``B`` sequences. Block 0's refresh is the decode's
  first forward. Rows move through blocks together, as in Fast-dLLM's batched loop: a row that
  completed its block waits (frozen, no calls counted for it) until every live row has, so one
  block-start forward serves the whole batch.
- **Within a block** a row may also be refreshed after ``refresh_every`` window calls since its
  last full forward, without waiting for the others (``rules.refresh_due``). The candidates of the rows that stay in their block after the policy commit
  are forwarded as windows against the cache (prefix: ``x[start:]``, rounded up to one of the
  engine's static window lengths; dual: the block and its ``vicinity``), PSD's levels and RPS's branches as ``M``
  windows per row in the same call. A row whose commit completes its block needs no window call:
  the next block-start forward refreshes it.
- Logits are computed only for the current block (``rules.logit_window``, the engine's window): a
  full forward's prediction covers the block, a window call's the block positions it predicts
  (Dream's logit shift leaves the block's first position to the block-start forward, as
  Fast-dLLM does).

Each kind of call runs only if some row needs it and results merge per row, so a row decodes as
it would alone.
"""

from __future__ import annotations

import dataclasses

import array_api_compat.torch as xp
import torch

from ..core import rules
from ..core.predict import sequences_forwarded
from ..core.records import DecodeOutput
from .decode import DecodeState, Loop, Prediction, apply_choice, forward_leading, propose


@dataclasses.dataclass
class KVCache:
    """Every layer's keys and values of each row's last full forward, and which rows need one."""

    keys: torch.Tensor  # [L, B, KV, N, hd]
    values: torch.Tensor  # [L, B, KV, N, hd]
    stale: torch.Tensor  # [B] bool: the row's block changed since
    since_refresh: torch.Tensor  # [B] window calls since the row's last full forward (refresh_every)


@dataclasses.dataclass(frozen=True)
class Windows:
    """What a window call reads besides the candidates: the canvas's position ids (the family's
    rule), the keys that are not pads, and the static window lengths."""

    positions: torch.Tensor  # [B, N]
    not_pad: torch.Tensor  # [B, N] bool
    lengths: tuple[int, ...]  # ascending

    @classmethod
    def of(cls, loop: Loop, canvas: torch.Tensor) -> Windows:
        batch, n = canvas.shape
        model, mask = loop.predictor.model, loop.attention_mask
        not_pad = torch.ones_like(canvas, dtype=torch.bool) if mask is None else mask.bool()
        return cls(model.positions(mask, batch, n, canvas.device), not_pad, rules.window_lengths(loop.dcfg))


def decode_cached(loop: Loop, canvas: torch.Tensor) -> DecodeOutput:
    """The cached loop: block 0's full forward fills the cache, then ``step`` until every row is done."""
    windows = Windows.of(loop, canvas)
    block = torch.zeros(canvas.shape[0], dtype=torch.long, device=canvas.device)
    pred, keys, values = prefill(loop, canvas, block)
    state = DecodeState.start(loop, canvas, pred)
    cache = KVCache(keys, values, torch.zeros_like(block, dtype=torch.bool), torch.zeros_like(block))
    while True:
        state, cache = step(loop, windows, state, cache)
        if bool(state.done.all()):
            return state.output()


def step(loop: Loop, windows: Windows, state: DecodeState, cache: KVCache) -> tuple[DecodeState, KVCache]:
    """One iteration with the cache: block-start refresh (if due), commit + candidates, one window
    call for the rows that stay in their block, choice, advance (the engine's ``step_cached``)."""
    batch = state.canvas.shape[0]
    waiting, refresh = rules.cache_phase(xp, cache.stale, state.done)
    refresh |= rules.refresh_due(xp, cache.since_refresh, cache.stale, state.done, loop.dcfg.refresh_every)
    pred, cache, refresh_calls = _refresh(loop, state, cache, refresh)

    frozen = state.done | waiting  # waiting rows are frozen like finished ones
    valid = loop.committable(state.canvas, state.block, frozen)
    proposal = propose(loop, pred, state.canvas, valid, state.step)
    _, block_after_s0, _, done_after_s0 = loop.advance(proposal.s0, state.block, state.step + 1, frozen)
    live = ~done_after_s0
    windowed = live & (block_after_s0 == state.block)  # rows whose forward is a window call
    preds, window_calls, size = _window_forward(loop, windows, cache, pred, state.block, proposal, windowed)
    sequences = refresh_calls * batch + sequences_forwarded(batch, size, loop.dcfg)
    row_calls = refresh.long() + windowed.long()
    new = apply_choice(loop, state, proposal, preds, live, frozen, row_calls, refresh_calls + window_calls, sequences)
    done, stale = rules.cache_stale(xp, waiting, new.done, state.block, new.block)
    since_refresh = torch.where(refresh, 0, cache.since_refresh) + windowed.long()
    return dataclasses.replace(new, done=done), dataclasses.replace(cache, stale=stale, since_refresh=since_refresh)


def prefill(loop: Loop, canvas: torch.Tensor, block: torch.Tensor) -> tuple[Prediction, torch.Tensor, torch.Tensor]:
    """The block-start full forward of canvas [B, N], logits only in each row's logit window at
    block ``block`` (``Loop.logit_window``): (Prediction [B, N], keys, values)."""
    return loop.predictor.prefill(canvas, loop.attention_mask, loop.logit_window(block), loop.generator)


def _refresh(loop: Loop, state: DecodeState, cache: KVCache, rows: torch.Tensor):
    """The block-start forward of ``rows`` (one call, only if some row needs it): their prediction
    and cache rows replaced by those of their current canvas. Returns (pred, cache, calls made)."""
    if not bool(rows.any()):
        return state.pred, cache, 0
    pred, keys, values = prefill(loop, state.canvas, state.block)
    pred = _where_rows(rows, pred, state.pred)
    select = rows[None, :, None, None, None]
    keys, values = torch.where(select, keys, cache.keys), torch.where(select, values, cache.values)
    return pred, dataclasses.replace(cache, keys=keys, values=values), 1


def _window_forward(loop, windows: Windows, cache: KVCache, pred, block, proposal, windowed):
    """The window call of the ``windowed`` rows' leading candidates: (preds [B, K, N], calls, forwarded).

    Prefix windows use the shortest static length covering every windowed row's rest of the canvas."""
    start = loop.block_start(block)
    w = windows.lengths[0]
    if len(windows.lengths) > 1:
        rest = torch.where(windowed, windows.positions.shape[1] - start, 0).max()
        w = windows.lengths[int(rules.covering_index(xp, windows.lengths, rest))]

    def call(candidates: torch.Tensor) -> Prediction:
        return _window_call(loop, windows, cache, pred, start, w, candidates)

    return forward_leading(call, proposal, windowed, pred)


def _window_call(loop, windows: Windows, cache: KVCache, pred, start, w: int, candidates) -> Prediction:
    """Forward candidates [B, M, N] as windows of w positions from each row's block start against
    the cache; the window's fresh keys/values replace the cached ones at its positions, and its
    predictions overwrite the candidates' (``pred``'s) at the block positions they predict."""
    b, m, n = candidates.shape
    device, shift = candidates.device, loop.mcfg.logit_shift
    index = start[:, None] + torch.arange(w, device=device)  # [B, W]
    window_mask = index < n  # prefix windows may reach past the canvas end: those keys are masked
    index = index.clamp(max=n - 1)
    in_window = rules.in_block(xp, n, start, w)
    key_mask = torch.cat([windows.not_pad & ~in_window, window_mask], dim=1).repeat_interleave(m, dim=0)
    tokens = candidates.gather(2, index[:, None].expand(b, m, w)).reshape(b * m, w)
    positions = windows.positions.gather(1, index).repeat_interleave(m, dim=0)
    out_length = loop.dcfg.block_length - shift
    cache_kv = (cache.keys, cache.values)
    win = loop.predictor.window(tokens, positions, cache_kv, key_mask, out_length, loop.generator)
    # Window position j predicts canvas position start + j + shift.
    targets = (start + shift)[:, None] + torch.arange(out_length, device=device)
    placed = _place(pred.map(lambda a: a.repeat_interleave(m, dim=0)), win, targets.repeat_interleave(m, dim=0))
    return placed.map(lambda a: a.reshape(b, m, *a.shape[1:]))


def _place(base: Prediction, win: Prediction, positions: torch.Tensor) -> Prediction:
    """``base`` [R, N, ...] with ``win`` [R, W, ...] written at ``positions`` [R, W] (in place)."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    for name in ("token", "conf", "entropy", "topk_prob", "topk_id"):
        field = getattr(base, name)
        if field is not None:
            field[rows, positions] = getattr(win, name).to(field.dtype)
    return base


def _where_rows(rows: torch.Tensor, new: Prediction, old: Prediction) -> Prediction:
    """Per-row select of two Predictions [B, ...]."""

    def pick(name: str):
        a, b = getattr(new, name), getattr(old, name)
        return None if a is None else torch.where(rows.view(-1, *[1] * (a.ndim - 1)), a, b)

    return Prediction(*(pick(f.name) for f in dataclasses.fields(Prediction)))
