"""User-facing configuration: SamplingParams (per request) and SpecConfig (per engine).

Both validate on construction and raise ValueError naming the field, so a bad
request is refused before it reaches the scheduler.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

POLICIES = ("fixed", "confidence", "head", "budget")
ACCEPTANCE_METHODS = ("rejection", "coupled")
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How one request samples. temperature 0 is greedy (top_k/top_p then do nothing).

    top_k 0 (or -1) disables top-k; top_p 1.0 disables top-p. seed None draws a
    seed once at admission; a fixed seed makes the output reproducible
    (token-identical to autoregressive sampling under ``acceptance="coupled"``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (_INT64_MIN <= self.seed <= _INT64_MAX)):
            raise ValueError(f"seed must be None or a 64-bit integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SpecConfig:
    """Speculative decoding settings of one engine.

    policy: "fixed" (K = max_draft_length), "confidence" (stop drafting when the
    draft's probability of its own token falls below a per-request adaptive
    threshold), "head" (a learned acceptance head estimates P(accept); stop when
    P(all accepted) < confidence_threshold), "budget" (batch-wide allocation of
    draft tokens by expected accepted tokens per unit of measured cost).
    acceptance: "rejection" (optimal acceptance rate) or "coupled" (output
    token-identical to autoregressive sampling with the same seed).
    """

    min_draft_length: int = 0
    max_draft_length: int = 4
    confidence_threshold: float = 0.3
    acceptance_window: int = 32
    adaptive_enabled: bool = True
    policy: str = "fixed"
    acceptance: str = "rejection"
    overlap: bool = False
    max_batch_size: int = 32
    block_size: int = 16
    kv_cache_budget: float | int = 0.5   # fraction of free device memory, or bytes
    max_model_len: int | None = None
    prefix_sharing: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("min_draft_length", "max_draft_length", "acceptance_window", "max_batch_size", "block_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.max_draft_length > 64:
            raise ValueError(f"max_draft_length must be <= 64, got {self.max_draft_length}")
        if self.min_draft_length > self.max_draft_length:
            raise ValueError(f"min_draft_length ({self.min_draft_length}) must be <= max_draft_length "
                             f"({self.max_draft_length})")
        if self.acceptance_window < 1:
            raise ValueError("acceptance_window must be >= 1")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not (0.0 <= float(self.confidence_threshold) <= 1.0):
            raise ValueError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_METHODS}, got {self.acceptance!r}")
        budget = self.kv_cache_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0 \
                or (isinstance(budget, float) and budget > 1.0):
            raise ValueError("kv_cache_budget must be a fraction in (0, 1] of free memory or a byte count (int), "
                             f"got {budget!r}")
