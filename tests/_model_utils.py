"""Helpers for tests/test_models.py: tiny random HF checkpoints and a paged-cache driver."""
from __future__ import annotations

import pytest
import torch

from specrt.models.attention import AttentionMetadata
from specrt.models.kv_cache import PagedKVCache

VOCAB = 160

ARCH_KWARGS = {
    "llama": dict(tie_word_embeddings=False),
    "llama3": dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=48),
    "qwen2": dict(tie_word_embeddings=True),
    "mistral": dict(sliding_window=None),
    "mistral_sw": dict(sliding_window=7),
}


def hf_config(kind: str, **overrides):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    base.update(ARCH_KWARGS[kind])
    base.update(overrides)
    cls = {"qwen2": Qwen2Config, "mistral": MistralConfig, "mistral_sw": MistralConfig}.get(kind, LlamaConfig)
    if kind == "qwen2":
        base.setdefault("use_sliding_window", False)
    return cls(**base)


def make_checkpoint(folder, kind: str, seed: int = 0, max_shard_size=None, **overrides):
    """Random-init tiny HF model saved as safetensors into `folder`; returns the HF model (fp32, eval)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # biases are zero-initialised: randomise them so Qwen2's q/k/v bias is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), safe_serialization=True, **kw)
    return model


class Runner:
    """Drives a specrt model through a PagedKVCache one request at a time or in mixed batches."""

    def __init__(self, model, num_blocks=64, block_size=4, enable_prefix_sharing=False):
        self.model = model
        self.cache = PagedKVCache({"target": model.config}, num_blocks, block_size, dtype=model.dtype,
                                  enable_prefix_sharing=enable_prefix_sharing)

    @property
    def kv(self):
        return self.cache["target"]

    def step(self, items, num_layers=None, return_hidden=False):
        """items: list of (request_id, new_token_ids); slots must already be reserved
        (allocate/append_slots). Returns per-request logits [q, V]."""
        qls = [len(t) for _, t in items]
        meta = self.cache.metadata([r for r, _ in items], qls)
        ids = torch.tensor([x for _, t in items for x in t], dtype=torch.long)
        pos = torch.tensor([p for s, q in zip(meta.seq_lens_host, qls) for p in range(s - q, s)], dtype=torch.long)
        logits, hidden = self.model(ids, pos, meta, self.kv, num_layers=num_layers, return_hidden=return_hidden)
        out = list(torch.split(logits, qls))
        return (out, hidden) if return_hidden else out

    def prefill(self, rid, tokens):
        cached = self.cache.allocate(rid, tokens)
        assert cached == 0
        return self.step([(rid, tokens)])[0]

    def decode(self, rid, tokens):
        assert self.cache.append_slots(rid, len(tokens))
        return self.step([(rid, tokens)])[0]

    def greedy(self, prompt, n, rid="g"):
        logits = self.prefill(rid, prompt)
        out = []
        for _ in range(n):
            tok = int(logits[-1].argmax())
            out.append(tok)
            logits = self.decode(rid, [tok])
        return out


@torch.no_grad()
def hf_logits(hf_model, tokens):
    return hf_model(torch.tensor([tokens])).logits[0].float()


def simple_meta(seq_lens, query_lens, tables, block_size):
    return AttentionMetadata.build(seq_lens, query_lens, tables, block_size, "cpu")
