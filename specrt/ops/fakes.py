"""Fake (meta) kernels of every specrt op: output shapes and dtypes without data, so the ops trace
under ``torch.compile(fullgraph=True)`` and pass ``torch.library.opcheck``."""
from __future__ import annotations

import torch

from specrt.ops import library  # noqa: F401  (loads the extension: the ops must exist to get fakes)


@torch.library.register_fake("specrt::probs_from_logits")
def _probs_from_logits_fake(logits, temperature, top_k, top_p, min_p=None, check_values=True):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D, got shape {list(logits.shape)}")
    return torch.empty_like(logits)


@torch.library.register_fake("specrt::apply_token_bitmask")
def _apply_token_bitmask_fake(logits, bitmask, rows, check_values=True):
    return None


@torch.library.register_fake("specrt::apply_penalties")
def _apply_penalties_fake(logits, row_request, row_offset, draft_token_ids, entry_start, entry_token, entry_count,
                          entry_in_prompt, entry_bias, repetition_penalty, frequency_penalty, presence_penalty,
                          check_values=True):
    return None


def _tokens_and_counts(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(like.dim() == 3, lambda: f"expected [B, K+1, V], got shape {list(like.shape)}")
    b, width = like.shape[0], like.shape[1]
    return like.new_empty((b, width), dtype=torch.int32), like.new_empty((b,), dtype=torch.int32)


@torch.library.register_fake("specrt::verify_greedy")
def _verify_greedy_fake(target_logits, draft_token_ids, num_draft_tokens, check_values=True):
    return _tokens_and_counts(target_logits)


@torch.library.register_fake("specrt::rejection_sample")
def _rejection_sample_fake(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seeds, positions,
                           method="rejection", check_values=True):
    return _tokens_and_counts(target_probs)


def _tree_outputs(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(like.dim() == 3, lambda: f"expected [B, N+1, V], got shape {list(like.shape)}")
    b, n1 = like.shape[0], like.shape[1]
    return (like.new_empty((b, n1), dtype=torch.int32), like.new_empty((b,), dtype=torch.int32),
            like.new_empty((b, n1 - 1), dtype=torch.int32))


@torch.library.register_fake("specrt::verify_tree_greedy")
def _verify_tree_greedy_fake(target_logits, node_token_ids, node_parents, num_nodes, check_values=True):
    return _tree_outputs(target_logits)


@torch.library.register_fake("specrt::rejection_sample_tree")
def _rejection_sample_tree_fake(target_probs, draft_probs, node_token_ids, node_parents, num_nodes, seeds, positions,
                                method="rejection", check_values=True):
    return _tree_outputs(target_probs)


@torch.library.register_fake("specrt::sample_tokens")
def _sample_tokens_fake(probs, seeds, positions, purpose=4, check_values=True):
    torch._check(probs.dim() == 2, lambda: f"probs must be 2-D, got shape {list(probs.shape)}")
    return probs.new_empty((probs.shape[0],), dtype=torch.int32)


@torch.library.register_fake("specrt::copy_blocks")
def _copy_blocks_fake(caches, block_mapping, check_values=True):
    return None


@torch.library.register_fake("specrt::copy_slots")
def _copy_slots_fake(caches, slot_mapping, check_values=True):
    return None


@torch.library.register_fake("specrt::write_kv")
def _write_kv_fake(cache, layer, k, v, slot_mapping, check_values=True):
    return None


@torch.library.register_fake("specrt::uniform_noise")
def _uniform_noise_fake(seeds, positions, purpose, index):
    return seeds.new_empty(seeds.shape, dtype=torch.float32)


@torch.library.register_fake("specrt::log_det")
def _log_det_fake(x):
    return torch.empty_like(x)


@torch.library.register_fake("specrt::paged_attention")
def _paged_attention_fake(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, window, max_query_len,
                          max_seq_len, check_values, tree_mask=None):
    return torch.empty_like(q)


@torch.library.register_fake("specrt::linear")
def _linear_fake(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("specrt::quant_linear")
def _quant_linear_fake(x, qweight, scales, mins, bias, kind):
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.register_fake("specrt::quant_linear_dynamic")
def _quant_linear_dynamic_fake(x, qweight, scales, mins, bias, kind):
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.register_fake("specrt::interleave_quant_weight")
def _interleave_quant_weight_fake(qweight, kind, inverse=False):
    return torch.empty_like(qweight, memory_format=torch.contiguous_format)


@torch.library.register_fake("specrt::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.register_fake("specrt::add_rms_norm_")
def _add_rms_norm_fake(residual, x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.register_fake("specrt::silu_mul")
def _silu_mul_fake(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.register_fake("specrt::rotary_write_kv")
def _rotary_write_kv_fake(qkv, cos, sin, num_heads, num_kv_heads, kv_cache, layer, slot_mapping, q_dtype=None):
    return qkv.new_empty(qkv.shape[0], num_heads, cos.shape[1], dtype=q_dtype or qkv.dtype)
