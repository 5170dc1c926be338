"""Paged KV cache bookkeeping: allocation, out-of-blocks, free, prefix sharing, rollback, fork/CoW."""
from __future__ import annotations

import os
import random

import pytest
import torch

from specrt.models import kv_cache as kvc
from specrt.models.attention import AttentionMetadata, copy_blocks, write_kv
from specrt.models.kv_cache import (
    KVCacheManager,
    OutOfBlocksError,
    PagedKVCache,
    allocate_kv_cache,
    kv_bytes_per_block,
    num_blocks_for_budget,
)
from specrt.models.config import ModelConfig

torch.set_num_threads(1)


def tiny_config(layers=2, kv_heads=2, head_dim=4) -> ModelConfig:
    return ModelConfig.from_json({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": kv_heads * head_dim * 2,
        "intermediate_size": 16, "num_hidden_layers": layers, "num_attention_heads": kv_heads * 2,
        "num_key_value_heads": kv_heads, "head_dim": head_dim})


def check_invariants(m: KVCacheManager):
    refs = [0] * m.num_blocks
    for req in m._reqs.values():
        assert len(req.block_table) == m.blocks_needed(req.num_tokens)
        for b in req.block_table:
            refs[b] += 1
    assert refs == m._ref
    assert m.num_free_blocks == sum(1 for r in refs if r == 0)
    assert set(m._free) == {b for b, r in enumerate(refs) if r == 0}
    assert {b: h for h, b in m._block_of_hash.items()} == m._hash_of_block
    assert m._target_only <= set(m._hash_of_block)   # only registered blocks can be target-only


def test_out_of_blocks_is_a_signal_not_a_crash():
    m = KVCacheManager(num_blocks=4, block_size=4)
    assert not m.can_allocate(17)
    assert m.allocate("big", list(range(17))) is None  # needs 5 blocks
    assert m.num_free_blocks == 4 and not m.has_request("big")
    assert m.allocate("a", list(range(9))) == 0  # 3 blocks
    assert m.num_free_blocks == 1
    assert m.append_slots("a", 3)  # 12 tokens: still 3 blocks
    assert m.append_slots("a", 4)  # 16 tokens: 4 blocks
    assert m.num_free_blocks == 0
    table = m.block_table("a")
    assert m.can_append_slots("a", 0) and not m.can_append_slots("a", 1)
    assert not m.append_slots("a", 1)  # nothing half-done
    assert m.num_tokens("a") == 16 and m.block_table("a") == table
    assert m.allocate("b", [1]) is None
    m.rollback("a", 2)  # 14 tokens: the last block is partial, a fork must copy it
    with pytest.raises(OutOfBlocksError):
        m.fork("a", "child")
    assert not m.has_request("child")
    check_invariants(m)
    m.free("a")
    m.free("a")  # cancel twice: idempotent
    assert m.num_free_blocks == 4


def test_every_block_returned_after_random_workload():
    rng = random.Random(0)
    m = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_sharing=True)
    tokens: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(600):
        op = rng.random()
        live = list(tokens)
        if op < 0.25 or not live:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]  # tiny alphabet: prefix hits
            if m.allocate(next_id, prompt) is not None:
                tokens[next_id] = prompt
            next_id += 1
        elif op < 0.5:
            rid = rng.choice(live)
            n = rng.randrange(1, 6)
            expect = m.can_append_slots(rid, n)
            if m.append_slots(rid, n) is not expect:
                raise AssertionError("can_append_slots disagrees with append_slots")
            if expect:
                m.pop_pending_copies()
                tokens[rid] = tokens[rid] + [rng.randrange(3) for _ in range(n)]
        elif op < 0.65:
            rid = rng.choice(live)
            r = rng.randrange(0, len(tokens[rid]))
            m.rollback(rid, r)
            tokens[rid] = tokens[rid][:len(tokens[rid]) - r]
        elif op < 0.75:
            rid = rng.choice(live)
            m.commit(rid, tokens[rid])
        elif op < 0.85:
            rid = rng.choice(live)
            try:
                m.fork(rid, next_id)
                tokens[next_id] = list(tokens[rid])
            except OutOfBlocksError:
                pass
            next_id += 1
        else:
            rid = rng.choice(live)
            m.free(rid)
            del tokens[rid]
        check_invariants(m)
        for rid, t in tokens.items():
            assert m.num_tokens(rid) == len(t)
    for rid in list(tokens):
        m.free(rid)
    assert m.num_free_blocks == 40 and all(r == 0 for r in m._ref)


def test_prefix_sharing_by_hash_with_refcounts():
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert m.allocate("a", prompt) == 0
    m.commit("a", prompt)  # 2 full blocks registered
    a = m.block_table("a")
    assert m.allocate("b", prompt[:8] + [99]) == 8
    b = m.block_table("b")
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [m.ref_count(x) for x in a] == [2, 2, 1]
    # a prompt identical to a cached one still computes its last token: the last block is never shared
    assert m.allocate("c", prompt[:8]) == 4
    assert m.ref_count(a[0]) == 3 and m.block_table("c")[1] != a[1]
    # a different first block breaks the chain even if the second block's tokens match
    assert m.allocate("d", [0, 0, 0, 0] + prompt[4:8] + [1]) == 0
    check_invariants(m)
    for r in "abcd":
        m.free(r)
    assert m.num_free_blocks == 8
    # freed prefix blocks stay cached: a new request revives them
    assert m.allocate("e", prompt) == 8 and m.block_table("e")[:2] == a[:2]
    m.free("e")
    # commit may include a sampled token whose KV is not written yet: only slotted positions count
    m.allocate("h", [40, 41, 42, 43, 44, 45, 46])
    m.commit("h", [40, 41, 42, 43, 44, 45, 46, 47])  # 8 tokens, 7 positions: only block 0 registered
    assert m.allocate("i", [40, 41, 42, 43, 44, 45, 46, 47, 1]) == 4
    m.free("h"), m.free("i")
    # ...until their memory is needed: fill every block, the cache entries are evicted
    assert m.allocate("f", list(range(100, 132))) == 0  # all 8 blocks
    m.free("f")
    assert m.allocate("g", prompt) == 0
    check_invariants(m)


def test_prefix_blocks_the_draft_has_not_written_are_target_only():
    """A draft whose KV lags must not cost the target its prefix sharing: blocks committed past
    all_caches_upto are reused for the target, recomputed for the draft, and upgraded once a
    request has written them everywhere."""
    m = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(40, 53))                       # 13 tokens: 3 full blocks
    m.allocate("a", prompt)
    m.commit("a", prompt, all_caches_upto=5)           # the draft holds positions < 5: block 0 only
    a = m.block_table("a")
    assert m._target_only == {a[1], a[2]}
    m.free("a")
    assert m.allocate("b", prompt + [1]) == 12         # the target reuses all 3 blocks
    assert m.cached_in_all_caches("b") == 4            # the draft only block 0
    assert m.block_table("b")[:3] == a[:3]
    # b's draft catches up through position 9: block 1 is now written everywhere, block 2 is not
    m.commit("b", prompt + [1], all_caches_upto=9)
    assert m._target_only == {a[2]}
    m.free("b")
    assert m.allocate("c", prompt + [2]) == 12 and m.cached_in_all_caches("c") == 8
    m.commit("c", prompt + [2])                        # None: every cache holds everything
    assert m._target_only == set()
    m.free("c")
    assert m.allocate("d", prompt + [3]) == 12 and m.cached_in_all_caches("d") == 12
    m.free("d")
    check_invariants(m)
    # an evicted target-only block loses the mark with its hash
    m.allocate("e", list(range(100, 109)))
    m.commit("e", list(range(100, 109)), all_caches_upto=0)
    e = m.block_table("e")
    assert m._target_only == {e[0], e[1]}
    m.free("e")
    m.allocate("f", list(range(200, 264)))             # every block: the cached ones are evicted
    assert m._target_only == set()
    check_invariants(m)
    m.free("f")
    # a rollback into a block forgets that it was written everywhere
    m.allocate("g", list(range(300, 309)))
    m.commit("g", list(range(300, 309)))
    m.rollback("g", 5)                                 # 4 positions left: block 1 will be rewritten
    assert m._reqs["g"].valid_in_all == 1
    check_invariants(m)


def test_prefix_sharing_disabled():
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_sharing=False)
    m.allocate("a", list(range(10)))
    m.commit("a", list(range(10)))
    assert m.allocate("b", list(range(10))) == 0
    assert set(m.block_table("a")).isdisjoint(m.block_table("b"))


def test_rollback_frees_blocks_and_stale_hashes():
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(20, 29))  # 9 tokens, 3 blocks
    m.allocate("a", prompt)
    m.commit("a", prompt)
    assert m.append_slots("a", 5)  # K+1 = 5: 14 tokens, 4 blocks
    assert m.num_free_blocks == 4
    m.rollback("a", 3)  # 11 tokens: 3 blocks
    assert m.num_free_blocks == 5 and m.num_tokens("a") == 11
    m.rollback("a", 5)  # 6 tokens: block 1 (committed) will be rewritten -> its hash must go
    assert m.num_free_blocks == 6 and len(m.block_table("a")) == 2
    assert m.allocate("b", prompt) == 4  # only block 0 still shareable
    with pytest.raises(ValueError, match="rollback"):
        m.rollback("a", 7)
    check_invariants(m)


def test_fork_and_copy_on_write():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("p", list(range(6)))  # blocks [x, y], y partial
    p = m.block_table("p")
    copies = m.fork("p", "c")
    c = m.block_table("c")
    assert c[0] == p[0] and m.ref_count(p[0]) == 2
    assert copies == [(p[1], c[1])] and c[1] != p[1]
    assert m.num_tokens("c") == 6
    # full last block: nothing to copy
    m.allocate("q", list(range(8)))
    assert m.fork("q", "q2") == [] and m.block_table("q2") == m.block_table("q")
    # writing into a shared block asks for a copy first
    assert m.prepare_write("q2", 6, 2) == [(m.block_table("q")[1], m.block_table("q2")[1])]
    assert m.block_table("q2")[1] != m.block_table("q")[1] and m.ref_count(m.block_table("q")[1]) == 1
    assert m.prepare_write("q2", 6, 2) == []  # already private
    # append_slots after a rollback into a shared block queues the copy
    m.rollback("c", 3)  # c: 3 tokens, inside shared block p[0]
    assert m.append_slots("c", 2)
    assert m.pop_pending_copies() == [(p[0], m.block_table("c")[0])]
    assert m.pop_pending_copies() == []
    check_invariants(m)
    for r in ("p", "c", "q", "q2"):
        m.free(r)
    assert m.num_free_blocks == 8


def test_attention_metadata_build():
    meta = AttentionMetadata.build(seq_lens=[6, 1, 9], query_lens=[6, 1, 3], block_tables=[[3, 7], [0], [5, 1, 2]],
                                   block_size=4, device="cpu")
    assert meta.query_start_loc.tolist() == [0, 6, 7, 10]
    assert meta.seq_lens.tolist() == [6, 1, 9]
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 7, -1], [0, -1, -1], [5, 1, 2]]
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 28, 29, 0, 4 + 2, 4 + 3, 8 + 0]
    assert meta.token_request_ids.tolist() == [0] * 6 + [1] + [2] * 3
    assert meta.token_query_idx.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 1, 2]
    assert meta.query_lens_host == [6, 1, 3] and meta.num_tokens == 10
    with pytest.raises(ValueError, match="query_len=4 must be in"):
        AttentionMetadata.build([3], [4], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match="2 needed for 5 tokens"):
        AttentionMetadata.build([5], [1], [[0]], 4, "cpu")


def _reference_ops():
    try:
        from specrt.ops import reference
        return reference
    except Exception:  # noqa: BLE001
        pytest.skip("specrt.ops.reference not available")


def test_write_kv_and_copy_blocks_match_reference():
    ref = _reference_ops()
    write, copy = write_kv, copy_blocks
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, 6, 4, 2, 3, generator=g)
    expected = cache.clone()
    k, v = torch.randn(5, 2, 3, generator=g), torch.randn(5, 2, 3, generator=g)
    slots = torch.tensor([3, -1, 17, 4, 23])
    write(cache, 1, k, v, slots)
    ref.write_kv(expected, 1, k, v, slots)
    assert torch.equal(cache, expected)
    other, other_exp = torch.randn(1, 2, 6, 4, 2, 3, generator=g), None
    other_exp = other.clone()
    mapping = torch.tensor([[0, 5], [4, 2]])
    copy([cache, other], mapping)
    ref.copy_blocks([expected, other_exp], mapping)
    assert torch.equal(cache, expected) and torch.equal(other, other_exp)


def test_paged_cache_applies_copies_to_target_and_draft():
    cfg_t, cfg_d = tiny_config(layers=3), tiny_config(layers=1, kv_heads=1, head_dim=8)
    pc = PagedKVCache({"target": cfg_t, "draft": cfg_d}, num_blocks=6, block_size=4)
    assert pc["target"].shape == (3, 2, 6, 4, 2, 4) and pc["draft"].shape == (1, 2, 6, 4, 1, 8)
    pc.allocate("p", [1, 2, 3, 4, 5, 6])
    for t in pc.caches.values():
        t.normal_()
    pc.fork("p", "c")
    src, dst = pc.block_table("p")[1], pc.block_table("c")[1]
    for t in pc.caches.values():
        assert torch.equal(t[:, :, dst], t[:, :, src])
    meta = pc.metadata(["p", "c"], [1, 6])
    assert meta.seq_lens_host == [6, 6] and meta.slot_mapping.tolist()[0] == src * 4 + 1
    pc.free("p"), pc.free("c")
    assert pc.num_free_blocks == 6


def test_budget_and_allocation():
    cfg = tiny_config(layers=2, kv_heads=2, head_dim=4)
    per_block = 2 * 2 * 16 * 2 * 4 * 4  # layers * k/v * block_size * heads * dim * fp32
    assert num_blocks_for_budget([cfg], 16, torch.float32, per_block * 10 + 5, "cpu") == 10
    assert num_blocks_for_budget([cfg, cfg], 16, torch.float32, per_block * 10, "cpu") == 5  # target + draft
    assert num_blocks_for_budget([cfg], 16, torch.bfloat16, per_block * 10, "cpu") == 20
    # a fraction of free memory (pinned: the real reading moves while other jobs run)
    real = kvc._available_memory("cpu")
    assert real > 0
    kvc_avail = kvc._available_memory
    try:
        kvc._available_memory = lambda device: per_block * 1000
        assert num_blocks_for_budget([cfg], 16, torch.float32, 0.01, "cpu") == 10
    finally:
        kvc._available_memory = kvc_avail
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        num_blocks_for_budget([cfg], 16, torch.float32, 1.5, "cpu")
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget([cfg], 16, torch.float32, 100, "cpu")
    t = allocate_kv_cache(cfg, 3, 16, torch.bfloat16, "cpu", num_layers=1)
    assert t.shape == (1, 2, 3, 16, 2, 4) and t.dtype == torch.bfloat16


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_a_cpu_cache_costs_only_the_blocks_in_use():
    """A CPU KV cache sized for the worst case (every request at its full context) must be cheap
    to build and cost memory for the blocks written only: 1 GiB of blocks, a few written, reads
    zero everywhere else; dtype names are accepted like torch dtypes."""
    cfg = tiny_config(layers=4, kv_heads=4, head_dim=64)
    per_block = kv_bytes_per_block([cfg], 16, "float32")
    assert per_block == kv_bytes_per_block([cfg], 16, torch.float32) == 2 * kv_bytes_per_block([cfg], 16, "bf16")
    num_blocks = 2 ** 30 // per_block
    before = _rss_mib()
    pc = PagedKVCache({"target": cfg}, num_blocks, 16, "fp32", "cpu")
    cache = pc["target"]
    assert cache.dtype == torch.float32 and cache.shape[2] == num_blocks
    pc.allocate("a", list(range(40)))
    cache[:, :, pc.block_table("a")] = 1.0
    assert _rss_mib() - before < 64, "the cache's untouched blocks must not be resident"
    assert float(cache[:, :, -1].abs().sum()) == 0.0 and float(cache[:, :, pc.block_table("a")].mean()) == 1.0
