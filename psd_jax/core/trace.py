"""The order of a decode: when and how each canvas position was written, recorded in the loop.

Opt-in (``DecodeConfig.trace``, so ``Program.trace``): without it the loop's state holds no trace
and the compiled program is the one it always was. With it, the state carries per row and canvas
position, as arrays of the loop's static shapes (no callback, no host trip per step):

* ``step``: the row's model calls when the position was written, i.e. the call whose prediction
  it was taken from (1 .. the row's NFE); 0 for a position the decode never wrote (the prompt,
  the padding, a position left when the row stopped);
* ``kind``: how it was written (``KINDS``): the policy's commit (LLaDA's low-confidence rule,
  Dream's and LLaDA2's schedules, the threshold rules: whatever ``policy`` is), a PSD draft
  accepted at depth d (``DRAFT + d``), an RPS pivot; DiffusionGemma, which re-decides every
  position at every step, has no commits: its trace (``diffusion_gemma_api.settled_trace``) gives
  the step from which each position's token stayed (``SETTLED``);
* ``first``: the token first written there, and ``rewritten``: the step of its last rewrite (0
  none): the editing decoder rewrites tokens it wrote (``EDIT``), so a replay shows the first token
  until then and the final one after.

Recording compares the canvas before and after each decision (``record``); it reads no logits and
changes no token and no call, which the tests check on the goldens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NONE, POLICY, PIVOT, EDIT = 0, 1, 2, 3
SETTLED = 4  # DiffusionGemma: the step from which the position's argmax stayed its final token
DRAFT = 10  # + d: a PSD draft accepted at depth d
KINDS = {NONE: "none", POLICY: "policy", PIVOT: "pivot", EDIT: "edit", SETTLED: "settled"}
FIELDS = ("step", "kind", "first", "rewritten")  # ``Trace``'s arrays, in order


def kind_name(kind: int) -> str:
    """The name of a ``kind`` code: ``policy``, ``draft-<d>``, ``pivot``, ``edit`` or ``none``."""
    return f"draft-{kind - DRAFT}" if kind > DRAFT else KINDS[kind]


@struct.dataclass
class Trace:
    step: jax.Array  # [B, N] int32: the row's calls when written (0: never written by the decode)
    kind: jax.Array  # [B, N] int32: how (module constants)
    first: jax.Array  # [B, N] int32: the token first written
    rewritten: jax.Array  # [B, N] int32: the step of the last rewrite (0: none)


def empty(canvas: jax.Array) -> Trace:
    """Nothing written yet on ``canvas`` [B, N]."""
    zeros = jnp.zeros(canvas.shape, jnp.int32)
    return Trace(zeros, zeros, zeros, zeros)


def record(
    trace: Trace,
    before: jax.Array,
    after: jax.Array,
    s0: jax.Array,
    candidates: jax.Array,
    index: jax.Array,
    calls: jax.Array,
    mask_id: int,
    decoder: str,
) -> Trace:
    """``trace`` after one decision that turned canvas ``before`` [B, N] into ``after`` (rows that
    did not decide keep their canvas, so nothing of theirs changes): ``s0`` the policy's commit,
    ``candidates`` [B, K, N] and ``index`` [B] the decoder's candidates and choice, ``calls`` [B]
    the rows' model calls so far (the prediction decided on is that of the last)."""
    written = (before == mask_id) & (after != mask_id)
    rewritten = (before != mask_id) & (after != before)
    if decoder == "psd":
        # Candidate j commits PSD's levels 1..j on top of s0: a position of level d is still masked
        # in candidates 0 .. d-1, so its depth is how many of the chosen one's predecessors mask it.
        k = jnp.arange(candidates.shape[1])
        upto = (k[None, :] <= index[:, None])[:, :, None]
        depth = jnp.sum(upto & (candidates == mask_id), axis=1, dtype=jnp.int32)
        other = DRAFT + depth
    else:
        other = jnp.full(before.shape, PIVOT if decoder == "rps" else POLICY, jnp.int32)
    kind = jnp.where(s0 != mask_id, POLICY, other)
    step = jnp.broadcast_to(calls[:, None], before.shape).astype(jnp.int32)
    return Trace(
        step=jnp.where(written, step, trace.step),
        kind=jnp.where(written, kind, jnp.where(rewritten, EDIT, trace.kind)),
        first=jnp.where(written, after, trace.first),
        rewritten=jnp.where(rewritten, step, trace.rewritten),
    )
