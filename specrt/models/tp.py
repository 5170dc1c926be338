"""Tensor parallelism: shard a loaded LlamaForCausalLM for rank ``r`` of ``N`` (Megatron layout).

    model = load_model(path)                       # full weights, on this rank's device
    shard_model_(model, rank, world_size, group)   # in place: per-rank weights + config

Per decoder layer (one all_reduce after attention, one after the MLP):
  * q/k/v_proj, gate/up_proj: column-parallel — rank r keeps heads
    ``[r*H/N, (r+1)*H/N)`` (and kv heads ``[r*Hkv/N, ...)``, so each local q head still
    maps onto its own local kv head under GQA) and ffn columns ``[r*I/N, (r+1)*I/N)``;
  * o_proj, down_proj: row-parallel — the matching input columns; the partial outputs
    are summed with ``all_reduce`` and the bias (if any) is added once, after the sum.
  * embed_tokens: vocabulary-parallel — rank r holds rows ``[r*V'/N, (r+1)*V'/N)`` of the
    vocabulary padded to a multiple of N (V'); ids outside its range embed to zero, and an
    ``all_reduce`` sums the one non-zero row per token;
  * lm_head: vocabulary-parallel (the same shard when the embeddings are tied); the logit
    shards are ``all_gather``-ed so EVERY rank holds the full [L, V] logits: all ranks then
    run identical sampling on identical numbers (see specrt.step.distributed).
The per-rank ``model.config`` says ``num_heads/N``, ``num_kv_heads/N`` and
``intermediate_size/N`` (vocab_size stays the full vocabulary: the logits are full), so a
PagedKVCache built from it holds only this rank's kv heads.

Nothing here runs when N == 1: the single-process model is untouched. Collectives use the
given process group (gloo on the CPU, NCCL on CUDA).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specrt.models.config import ModelConfig

__all__ = ["check_tp_divisible", "shard_config", "shard_model_", "shard_selector", "RowParallelLinear",
           "VocabParallelEmbedding", "VocabParallelLMHead"]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split (weight, bias, int8 scale)
_ROW = ("o_proj", "down_proj")  # input columns split (weight only)
_VOCAB = ("model.embed_tokens", "lm_head")  # vocabulary rows split, padded to ceil(V/N)


def check_tp_divisible(config: ModelConfig, world_size: int) -> None:
    """ValueError naming every dimension that ``world_size`` does not divide."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    bad = [f"{name}={v}" for name, v in (("num_attention_heads", config.num_heads),
                                          ("num_key_value_heads", config.num_kv_heads),
                                          ("intermediate_size", config.intermediate_size)) if v % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {', '.join(bad)} "
                         f"({config.architecture}): choose a size that divides every head count")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """This rank's config: heads and ffn width divided by ``world_size`` (head_dim, hidden, vocab kept)."""
    check_tp_divisible(config, world_size)
    return dataclasses.replace(config, num_heads=config.num_heads // world_size,
                               num_kv_heads=config.num_kv_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def _rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n].clone()


def _column_parallel(lin: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """Keep output rows [r*out/N, (r+1)*out/N) (weight [out, in] and bias [out])."""
    w = lin.weight.detach()
    out = nn.Linear(w.shape[1], w.shape[0] // world_size, bias=lin.bias is not None, device="meta")
    out.weight = nn.Parameter(_rows(w, rank, world_size), requires_grad=False)
    if lin.bias is not None:
        out.bias = nn.Parameter(_rows(lin.bias.detach(), rank, world_size), requires_grad=False)
    return out


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: x_r [.., in/N] is this rank's slice of the input features."""

    def __init__(self, lin: nn.Linear, rank: int, world_size: int, group):
        super().__init__()
        w = lin.weight.detach()
        n = w.shape[1] // world_size
        self.weight = nn.Parameter(w[:, rank * n:(rank + 1) * n].contiguous(), requires_grad=False)  # [out, in/N]
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # partial sum [.., out]
        dist.all_reduce(y, group=self.group)
        if self.bias is not None:
            y = y + self.bias
        return y


def _vocab_rows(w: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """Rows [start, start + ceil(V/N)) of w [V, hidden], zero-padded past V; returns (shard, start)."""
    V = w.shape[0]
    per = -(-V // world_size)  # ceil: the vocabulary is padded to a multiple of N
    start = rank * per
    shard = w[start:start + per]
    if shard.shape[0] < per:  # last rank(s): zero rows, never looked up, their logits are cut off
        shard = torch.cat([shard, shard.new_zeros(per - shard.shape[0], w.shape[1])])
    return shard.contiguous(), start


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V'/N) of the embedding; other ids embed to 0, then all_reduce."""

    def __init__(self, emb: nn.Embedding, rank: int, world_size: int, group):
        super().__init__()
        shard, self.start = _vocab_rows(emb.weight.detach(), rank, world_size)
        self.weight = nn.Parameter(shard, requires_grad=False)  # [V'/N, hidden]
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        x = x.masked_fill(outside[:, None], 0)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelLMHead(nn.Module):
    """logits shard [L, V'/N] = h @ W_r^T, all_gather -> [L, V] on every rank."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, world_size: int, group):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.world_size, self.group = vocab_size, world_size, group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight).contiguous()  # [L, V'/N]
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]  # [L, V]


def shard_selector(config: ModelConfig, rank: int, world_size: int):
    """``select(name, lazy_slice) -> Tensor`` for the loader: reads only rank ``rank``'s part of each
    checkpoint tensor (the same split as shard_model_, vocabulary shards zero-padded)."""
    check_tp_divisible(config, world_size)

    def select(name: str, sl) -> torch.Tensor:
        module, _, leaf = name.rpartition(".")
        last = module.rpartition(".")[2]
        shape = sl.get_shape()
        if last in _COLUMN and leaf in ("weight", "bias", "weight_scale"):
            n = shape[0] // world_size
            return sl[rank * n:(rank + 1) * n]
        if last in _ROW and leaf == "weight":
            n = shape[1] // world_size
            return sl[:, rank * n:(rank + 1) * n]
        if module in _VOCAB and leaf in ("weight", "weight_scale"):
            V = shape[0]
            per = -(-V // world_size)
            start, stop = min(rank * per, V), min((rank + 1) * per, V)
            part = sl[start:stop]
            if part.shape[0] < per:
                part = torch.cat([part, part.new_zeros(per - part.shape[0], *part.shape[1:])])
            return part
        return sl[:]

    return select


@torch.no_grad()
def shard_model_(model, rank: int, world_size: int, group=None):
    """Shard ``model`` (a loaded specrt LlamaForCausalLM with full weights) in place for ``rank``.

    ``group``: the torch.distributed process group of the N ranks (None = the default group).
    Returns the model. Raises ValueError (before touching anything) when N does not divide
    the head counts or the ffn width.
    """
    if world_size == 1:
        return model
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    cfg = shard_config(model.config, world_size)
    inner = model.model
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _column_parallel(attn.q_proj, rank, world_size)
        attn.k_proj = _column_parallel(attn.k_proj, rank, world_size)
        attn.v_proj = _column_parallel(attn.v_proj, rank, world_size)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size, group)
        attn.num_heads, attn.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        mlp.gate_proj = _column_parallel(mlp.gate_proj, rank, world_size)
        mlp.up_proj = _column_parallel(mlp.up_proj, rank, world_size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world_size, group)
    emb = VocabParallelEmbedding(inner.embed_tokens, rank, world_size, group)
    if model.config.tie_word_embeddings:
        head_w = emb.weight
    else:
        head_w = _vocab_rows(model.lm_head.weight.detach(), rank, world_size)[0]  # same split + padding
    inner.embed_tokens = emb
    model.lm_head = VocabParallelLMHead(head_w, model.config.vocab_size, world_size, group)
    model.config = cfg
    model.tp_rank, model.tp_size, model.tp_group = rank, world_size, group
    if hasattr(model, "invalidate_prepared"):
        model.invalidate_prepared()
    return model
