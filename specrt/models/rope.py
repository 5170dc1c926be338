"""RMSNorm and rotary position embeddings of the Llama family (the torch path; the CPU fused path
runs ops.rms_norm and ops.rotary_write_kv on the same tables). Numerics follow transformers: norm
statistics in fp32, cos/sin in fp32 cast to the activation dtype."""
from __future__ import annotations

import math

import torch
from torch import nn

from specrt.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) with the statistics in fp32 (as transformers' LlamaRMSNorm).

    sum(x^2) comes from ``vector_norm`` (one fused reduction; ``mean(x.pow(2))`` and
    ``F.rms_norm`` cost ~3-10x more per call on the CPU); differs from transformers by ~1 ulp."""
    dtype = x.dtype
    xf = x.float()
    n = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)  # [T, 1]
    r = (n * n).mul_(1.0 / x.shape[-1]).add_(eps).rsqrt_()  # 1 / rms
    return weight * (xf * r).to(dtype)


class RotaryEmbedding:
    """RoPE tables: default, "linear", "dynamic" (NTK, per call) and "llama3" scaling."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.dim = config.head_dim
        self.scaling = config.rope_scaling or {}
        self.rope_type = self.scaling.get("rope_type", "default")
        self._cache: dict = {}

    def _base_inv_freq(self, base: float, device) -> torch.Tensor:
        d = self.dim
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / d))

    def inv_freq(self, device, seq_len: int) -> torch.Tensor:
        cfg, s, base = self.config, self.scaling, self.config.rope_theta
        if self.rope_type == "dynamic":
            max_pos = cfg.max_position_embeddings
            seq_len = max(seq_len, max_pos)
            key = (str(device), seq_len)
            if key not in self._cache:
                factor, d = s["factor"], self.dim
                base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
                self._cache[key] = self._base_inv_freq(base, device)
            return self._cache[key]
        key = str(device)
        if key in self._cache:
            return self._cache[key]
        inv = self._base_inv_freq(base, device)
        if self.rope_type == "linear":
            inv = inv / s["factor"]
        elif self.rope_type == "llama3":
            factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old_ctx = s["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
            wavelen = 2 * math.pi / inv
            inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv = torch.where(medium, smoothed, inv_l)
        self._cache[key] = inv
        return inv

    def cos_sin(self, positions: torch.Tensor, dtype, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for ``positions`` [T] (all < seq_len, a host-side bound: no sync)."""
        if self.rope_type != "dynamic":  # one table per (device, dtype), rows indexed by position
            key = ("table", str(positions.device), dtype)
            table = self._cache.get(key)
            if table is None or table[0].shape[0] < seq_len:  # grow by doubling, up to the context
                n = min(max(256, 1 << (seq_len - 1).bit_length()), max(self.config.max_model_len, seq_len))
                table = self._cache[key] = self._cos_sin(torch.arange(n, device=positions.device), dtype, n)
            return table[0].index_select(0, positions), table[1].index_select(0, positions)
        return self._cos_sin(positions, dtype, seq_len)

    def _cos_sin(self, positions: torch.Tensor, dtype, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq(positions.device, seq_len)
        freqs = positions[:, None].float() * inv  # [T, D/2] (exact: same numbers as the table rows)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_operands(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] -> (cos [T, 1, D], sin with its first half negated [T, 1, D]), once per forward,
    so that ``rotate_half(x) * sin == roll(x, D/2) * signed_sin`` exactly (negation is exact)."""
    half = cos.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None], signed_sin[:, None]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos / signed_sin [T, 1, D] from rope_operands: x*cos + rotate_half(x)*sin in 3-4 ops
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), signed_sin)
    # half precision: round each product like transformers does (addcmul rounds once: a different error)
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin
