"""Per-step commit counts of the scheduled policies, computed on the host exactly as upstream.

Every block starts with ``block_length`` masked positions, so one table of ``steps_per_block``
counts serves every block and is baked into the compiled loop as a constant.
"""

from __future__ import annotations

import numpy as np


def llada_schedule(masked: int, steps: int) -> np.ndarray:
    """LLaDA's ``get_num_transfer_tokens``: ``masked // steps`` each, the remainder on the first steps."""
    base, remainder = divmod(masked, steps)
    counts = np.full(steps, base, dtype=np.int32)
    counts[:remainder] += 1
    return counts


def torch_linspace_f32(start: float, end: float, num: int) -> np.ndarray:
    """``torch.linspace(start, end, num)`` in float32, reproducing its two-sided formula."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float32((end32 - start32) / np.float32(num - 1))
    halfway = num // 2
    out = np.empty(num, dtype=np.float32)
    for i in range(num):
        out[i] = start32 + step * np.float32(i) if i < halfway else end32 - step * np.float32(num - i - 1)
    return out


def dream_schedule(masked: int, steps: int, eps: float = 1e-3) -> np.ndarray:
    """Dream ``_sample``: ``int(#masked * (1 - s / t))`` in float32 per step, all remaining at the last.

    Counts can be 0 on early steps (upstream then runs a step that commits nothing); they are kept
    so that outputs match upstream token for token.
    """
    timesteps = torch_linspace_f32(1.0, eps, steps + 1)
    counts = np.zeros(steps, dtype=np.int32)
    remaining = masked
    for i in range(steps):
        if i < steps - 1:
            t, s = timesteps[i], timesteps[i + 1]
            ratio = np.float32(np.float32(1.0) - np.float32(s / t))
            k = int(np.float32(np.float32(remaining) * ratio))
        else:
            k = remaining
        counts[i] = k
        remaining -= k
    return counts
