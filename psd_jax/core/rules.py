"""The decoding rules every decoder shares, written once for both backends against the Python array
API standard.

Defined here and only here: ranks, block membership and advance, the cache's phases, and the static
sizes (forward sizes, logit windows, cache window lengths). What one policy or one decoder decides
lives in its own module, written the same way: each policy's counts and commit set in
``policies/``, PSD's draft sizes, levels and acceptance in ``decoders/psd.py``, RPS's pivot, branches
and scoring in ``decoders/rps.py``. The JAX engine (``engine``, ``decoders``) and the PyTorch backend
(``torch_backend``) both call these functions, so the two cannot drift apart (they once did: the
torch backend ran the factor rule for ``threshold_schedule``).

Design: a rule takes the array namespace ``xp`` as its first argument and uses only what the
standard defines (its functions, operators, basic indexing), so one body runs on either library.
JAX passes ``jax.numpy``, which implements the standard; torch passes ``array_api_compat.torch``
(the ``torch`` extra's ``array-api-compat``), so this module imports neither. Static parts are
plain Python/numpy (``forward_sizes``, ``logit_width``, ``window_lengths``,
``covering_index`` on Python ints). Index dtypes are each library's own (int32 in JAX, int64 in
torch), so results feed either library's indexing directly; values are equal across the two.
tests/decoding/test_rules.py checks each rule against a plain-Python for-loop definition (the
docs/algorithms.md wording) on small random inputs, in both namespaces.

Shapes: B rows, N canvas positions, D PSD levels, k RPS values.

Settings: ``program`` decides the rule (policy, decoder, acceptance, depth, draft_rate, block
length, eos_early_stop: the fields of ``ProgramFields``); the values a rule compares against
(``threshold``, ``factor``, ``ratio``, ``pivot_tau``, ``lam``, ``accept_confidence``, ``num_blocks``)
are read from ``values``. The engine passes its compiled ``runtime.Program`` and one array per row
[B] (``runtime.RowValues``), so rows with different thresholds share one compiled program; the
PyTorch backend passes its ``DecodeConfig`` as both (Python numbers). Whether a rule compares at
all is the program's (``gated``).
"""

from __future__ import annotations

from typing import Any, Protocol


class ProgramFields(Protocol):
    """What a rule is specialised on: the fields of a compiled ``runtime.Program`` that the rules read
    (the engine passes its program; the PyTorch backend its ``DecodeConfig``, which holds them too).
    Each one sets a shape or a code path; the values compared against are the rows' own (``values``)."""

    gen_length: int
    block_length: int
    steps: int | None
    policy: str
    predict_mask: bool
    eos_early_stop: bool
    dream_eps: float
    decoder: str
    depth: int
    acceptance: str
    draft_rate: int | None
    draft_next_block: bool
    k_max: int
    cache: str
    vicinity: int
    gated: bool

    @property
    def steps_per_block(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...


Array = Any  # an array of the namespace ``xp`` (jax.Array, torch.Tensor)


def device_of(x: Array):
    """``x``'s device, or None where it has none to give (a JAX tracer: default placement is right)."""
    try:
        return x.device
    except (AttributeError, ValueError):
        return None


def arange_like(xp, n: int, like: Array) -> Array:
    return xp.arange(n, device=device_of(like))


def leading_true(xp, flags: Array) -> Array:
    """[..., J] bool -> [...]: how many leading entries are True."""
    return xp.sum(xp.cumulative_prod(xp.astype(flags, xp.int32), axis=-1), axis=-1)


def one_hot(xp, index: Array, n: int) -> Array:
    """[B] -> [B, n] int32, row b one at ``index[b]`` (all zeros where it is outside 0..n-1)."""
    return xp.astype(index[:, None] == arange_like(xp, n, index)[None, :], xp.int32)


def per_row(value: Any, ndim: int = 2) -> Any:
    """A setting as a rule compares it against [B, ...] arrays of ``ndim`` dimensions: a Python
    number as it is, one value per row [B] with ``ndim - 1`` trailing unit axes."""
    if getattr(value, "ndim", 0) == 0:
        return value
    return value[(slice(None),) + (None,) * (ndim - 1)]


def repeat_rows(values: Any, times: int) -> Any:
    """``values`` for rows repeated ``times`` each ([B] -> [B * times]: ``runtime.RowValues.repeat``);
    a ``DecodeConfig``'s Python numbers as they are."""
    return values.repeat(times) if hasattr(values, "repeat") else values


def covering_index(xp, sizes: tuple[int, ...], most: Array) -> Array:
    """Index of the smallest of the ascending static ``sizes`` that is >= ``most`` (0-d): how many
    sizes fall short of it."""
    return xp.sum(xp.asarray(sizes, device=device_of(most)) < most)


# ---------------------------------------------------------------------------------- geometry


def block_start(prompt_length: int, block: Array, block_length: int) -> Array:
    """The canvas index where each row's block ``block`` [B] starts."""
    return prompt_length + block * block_length


def in_block(xp, n: int, start: Array, block_length: int) -> Array:
    """[B, N]: the positions of each row's block, which starts at ``start`` [B]."""
    pos = arange_like(xp, n, start)[None, :]
    return (pos >= start[:, None]) & (pos < start[:, None] + block_length)


def committable(
    xp, canvas: Array, start: Array, done: Array, block_length: int, mask_id: int, since: int | None = None
) -> Array:
    """M(x): the masked positions of each row's current block ([B, N]); nothing for done rows.

    ``since`` (``predict_mask``: LLaDA's ``generate.py``, whose candidates are every masked position
    before the block's end): also the masked positions from canvas index ``since`` (the first
    generated one) up to the block, where an earlier block's step wrote [MASK]."""
    if since is None:
        return (canvas == mask_id) & in_block(xp, canvas.shape[-1], start, block_length) & ~done[:, None]
    pos = arange_like(xp, canvas.shape[-1], start)[None, :]
    return (canvas == mask_id) & (pos >= since) & (pos < start[:, None] + block_length) & ~done[:, None]


def _isin(x: Array, values: tuple[int, ...]) -> Array:
    out = x == values[0]
    for value in values[1:]:
        out = out | (x == value)
    return out


def advance(
    xp, canvas: Array, block: Array, step: Array, done: Array, prompt_length: int, mcfg, program: ProgramFields, values
):
    """Rows whose block is complete move to the next block with step 0; a row stops after its last
    block (``values.num_blocks``: its own generation, in blocks), or (``eos_early_stop``) after a
    complete block holding a stop token, every later position then set to EOS (docs/algorithms.md
    "Decode loop"). Returns (canvas, block, step, done).

    ``mcfg`` is any family's config (``mask_id``, ``eos_id``, ``stop_ids``); the block-causal rule
    is the engine's own (``layouts.BlockCausalLayout.advance``)."""
    b = program.block_length
    start = block_start(prompt_length, block, b)
    inside = in_block(xp, canvas.shape[-1], start, b)
    if program.predict_mask:
        # LLaDA's generate.py: a block ends after its steps, whether or not a step wrote [MASK] in it
        # (such a position stays masked, so the mask rule below might never end the block).
        complete = (step >= program.steps_per_block) & ~done
    else:
        complete = ~xp.any(inside & (canvas == mcfg.mask_id), axis=-1) & ~done
    eos_stop = complete & xp.any(inside & _isin(canvas, mcfg.stop_ids), axis=-1) & program.eos_early_stop
    after = arange_like(xp, canvas.shape[-1], canvas)[None, :] >= (start + b)[:, None]
    canvas = xp.where(eos_stop[:, None] & after, mcfg.eos_id, canvas)
    new_done = done | eos_stop | (complete & (block + 1 >= values.num_blocks))
    block = xp.where(complete & ~new_done, block + 1, block)
    if program.draft_next_block and program.policy == "fixed":  # steps the accepted drafts took in the next block
        return canvas, block, xp.where(complete, xp.clip(step - program.steps_per_block, min=0), step), new_done
    return canvas, block, xp.where(complete, 0, step), new_done


def logit_width(program: ProgramFields, region_length: int) -> int | None:
    """Positions per row that get logits, from its current block's start: the block with a cache
    (a row whose block completes gets the next block's predictions from its block-start forward),
    the block and the next without (a row whose block completes commits from this forward next),
    and one more block with ``draft_next_block`` (uncached, a row that moved on by accepting drafts
    in the next block drafts from this forward into the one after; cached, the next block is what
    the drafts verified by a window call reach, and a row that moved on is refreshed first);
    None when that covers every position after ``prompt_length`` (``region_length`` of them):
    then the logits of those. Both backends' calls use this window (docs/algorithms.md "Prediction")."""
    if program.predict_mask:  # a [MASK] an earlier block left is still committable (``committable``'s ``since``)
        return None
    width = program.block_length * ((1 if program.cache != "none" else 2) + program.draft_next_block)
    return None if width >= region_length else width


def logit_count(program: ProgramFields, region_length: int) -> int:
    """Positions per row that get logits: ``logit_width``, or every position after the prompt."""
    return logit_width(program, region_length) or region_length


def logit_window(
    program: ProgramFields, prompt_length: int, region_length: int, block: Array
) -> tuple[Array, int] | None:
    """The logit window of a call: (each row's first position [B], ``logit_width``) from the
    start of the row's current block ``block`` [B]; None when it would cover every position after
    ``prompt_length`` (then the logits of those are computed)."""
    width = logit_width(program, region_length)
    return None if width is None else (block_start(prompt_length, block, program.block_length), width)


def logit_positions(xp, start: Array, width: int) -> Array:
    """[M, W]: the canvas positions of a logit window of ``width`` from each row's ``start`` [M]."""
    return start[:, None] + arange_like(xp, width, start)[None, :]


def logit_index(xp, start: Array, width: int, n: int, shift: int) -> Array:
    """[M, W]: the logit rows a window's positions read (position i reads logit i - shift), inside
    the canvas of ``n`` positions."""
    return xp.clip(logit_positions(xp, start, width) - shift, 0, n - 1)


def window_lengths(program: ProgramFields, block_causal: bool = False) -> tuple[int, ...]:
    """Static query windows of a cached call, ascending: the block (block-causal models, whose later
    blocks are never visible), and for dual the block and its ``vicinity``; for prefix, the rest of
    the canvas rounded up to block_length * 2^i, or to gen_length (a few compiled sizes)."""
    block, gen = program.block_length, program.gen_length
    if block_causal:
        return (block,)
    if program.cache == "dual":
        return (block + program.vicinity,)
    lengths, w = [], block
    while w < gen:
        lengths.append(w)
        w *= 2
    return (*lengths, gen)


def cache_phase(xp, stale: Array, done: Array) -> tuple[Array, Array]:
    """Block KV cache: (rows that wait, rows refreshed now) [B]. Rows move through blocks together,
    as in Fast-dLLM's batched loop: a row whose block changed since its last full forward
    (``stale``) waits, frozen, until every live row has; then one block-start forward refreshes
    them all (docs/algorithms.md "Block KV cache")."""
    stale_live = stale & ~done
    synced = xp.all(stale | done)  # every live row is at a block start
    return stale_live & ~synced, stale_live & synced


def refresh_due(xp, since_refresh: Array, stale: Array, done: Array, every: int) -> Array:
    """[B] rows whose cache is refreshed now within their block (``refresh_every``): live rows that
    made ``every`` window calls since their last full forward. They do not wait for the others:
    every live row of a block makes one window call per iteration, so rows of one block are due
    together and one full forward serves them."""
    if not every:
        return xp.zeros_like(done)
    return (since_refresh >= every) & ~stale & ~done


def cache_stale(xp, waiting: Array, done: Array, block_before: Array, block_after: Array) -> tuple[Array, Array]:
    """After a cached iteration: (done, stale) [B]. A waiting row is not done yet; a row that
    moved to a new block, or waits, needs the block-start forward."""
    done = done & ~waiting
    return done, waiting | ((block_after != block_before) & ~done)


def forward_sizes(k: int) -> tuple[int, ...]:
    """The static numbers of leading candidates a call may forward: s0 alone, about half, all K.

    A call forwards the smallest size that covers every live row's ``needed`` candidates (deep PSD
    levels past a block's last step, RPS branches past the ratio filter are never forwarded); three
    sizes keep the compiled model calls few.
    """
    return tuple(sorted({1, (k + 1) // 2, k}))


def most_needed(xp, needed: Array, rows: Array) -> Array:
    """The most leading candidates any of ``rows`` [B] can choose (1 when none is a row)."""
    return xp.max(xp.where(rows, needed, 1))


# ---------------------------------------------------------------------------------- ranks


FLOAT32_MAX = 3.4028234663852886e38


def rank_keys(xp, conf: Array, valid: Array) -> Array:
    """Ascending sort keys of ``conf`` [B, N]: ``-conf`` for valid positions, clipped into the finite
    float32 range (a NaN confidence counts as the lowest), and ``+inf`` for invalid ones. So every
    valid position sorts before every invalid one whatever the scores are (NaN, +-inf): a policy's
    top-ranked position is always committable, and a step always commits one."""
    finite = xp.clip(-xp.where(xp.isnan(conf), -float("inf"), conf), min=-FLOAT32_MAX, max=FLOAT32_MAX)
    return xp.where(valid, finite, float("inf"))


def ranks(xp, conf: Array, valid: Array) -> Array:
    """Rank of each valid position by confidence (0 = most confident), ties to the lower position;
    invalid positions rank after every valid one (their order among themselves is not used).

    One stable sort on ``rank_keys``, then its inverse permutation."""
    order = xp.argsort(rank_keys(xp, conf, valid), axis=-1, stable=True)
    return xp.argsort(order, axis=-1, stable=True)
