"""Decoding settings: one frozen, hashable dataclass (a static argument of the jitted loop).

``validate`` checks everything that can be checked before tracing, so bad input fails early with
a message that names the problem instead of deep inside XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

POLICIES = ("fixed", "threshold", "factor", "dream")
CONFIDENCES = ("prob", "margin", "entropy", "random")
DECODERS = ("plain", "psd", "rps")
ACCEPTANCES = ("tokens", "strict")
CACHES = ("none", "prefix", "dual")

# Upstream names of the confidence kinds, accepted as aliases.
CONFIDENCE_ALIASES = {
    "low_confidence": "prob",
    "maskgit_plus": "prob",
    "topk_margin": "margin",
    "neg_entropy": "entropy",
}


class DecodeConfigError(ValueError):
    """Decoding settings that cannot run, with the reason."""


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None  # total steps over all blocks; default: gen_length (one token per step)
    policy: Literal["fixed", "threshold", "factor", "dream"] = "fixed"
    confidence: Literal["prob", "margin", "entropy", "random"] = "prob"
    threshold: float = 0.9
    factor: float = 1.0
    temperature: float = 0.0
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    eos_early_stop: bool = True
    dream_eps: float = 1e-3
    decoder: Literal["plain", "psd", "rps"] = "plain"
    # PSD
    depth: int = 3
    acceptance: Literal["tokens", "strict"] = "tokens"
    draft_rate: int | None = None
    # RPS
    k_max: int = 10
    ratio: float = 0.1
    pivot_tau: float = 0.9
    lam: float = 0.3
    cache: Literal["none", "prefix", "dual"] = "none"  # block KV cache (Fast-dLLM)

    def __post_init__(self) -> None:
        object.__setattr__(self, "confidence", CONFIDENCE_ALIASES.get(self.confidence, self.confidence))
        if self.steps is None:
            object.__setattr__(self, "steps", self.gen_length)
        self._check()

    def replace(self, **changes) -> "DecodeConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def branches(self) -> int:
        """Canvases per row in one model call (K): 1 plain, D + 1 for PSD, k_max + 1 for RPS."""
        return {"plain": 1, "psd": self.depth + 1, "rps": self.k_max + 1}[self.decoder]

    def _check(self) -> None:
        def fail(msg: str) -> None:
            raise DecodeConfigError(msg)

        for name, allowed in (
            ("policy", POLICIES),
            ("confidence", CONFIDENCES),
            ("decoder", DECODERS),
            ("acceptance", ACCEPTANCES),
            ("cache", CACHES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                fail(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
        if self.gen_length <= 0:
            fail(f"gen_length must be positive, got {self.gen_length}")
        if self.block_length <= 0:
            fail(f"block_length must be positive, got {self.block_length}")
        if self.gen_length % self.block_length:
            fail(f"block_length {self.block_length} does not divide gen_length {self.gen_length}")
        if self.steps <= 0:
            fail(f"steps must be positive, got {self.steps}")
        if self.steps % self.num_blocks:
            fail(f"steps {self.steps} is not divisible by the number of blocks {self.num_blocks} (gen_length / block_length)")
        if not 0.0 < self.threshold <= 1.0:
            fail(f"threshold must be in (0, 1], got {self.threshold}")
        if self.factor <= 0:
            fail(f"factor must be positive, got {self.factor}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if self.cfg_scale < 0:
            fail(f"cfg_scale must be >= 0, got {self.cfg_scale}")
        if not 0.0 < self.dream_eps < 1.0:
            fail(f"dream_eps must be in (0, 1), got {self.dream_eps}")
        if self.depth < 0:
            fail(f"PSD depth must be >= 0, got {self.depth}")
        if self.draft_rate is not None and self.draft_rate < 1:
            fail(f"PSD draft_rate must be >= 1, got {self.draft_rate}")
        if self.k_max < 1:
            fail(f"RPS k_max must be >= 1, got {self.k_max}")
        if not 0.0 <= self.ratio <= 1.0:
            fail(f"RPS ratio must be in [0, 1], got {self.ratio}")
        if self.lam < 0:
            fail(f"RPS lam must be >= 0, got {self.lam}")
        if self.cache != "none" and self.cfg_scale > 0:
            fail(f"cache {self.cache!r} does not support classifier-free guidance (cfg_scale > 0); use cache='none'")
