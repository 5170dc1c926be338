"""copy_blocks / write_kv: exact byte copies across several caches of different dtypes and
shapes in one call; slot -1 skipped; bad mappings, mismatched caches and wrong layers
rejected with a ValueError naming the argument (and the op still works afterwards)."""
from __future__ import annotations

import pytest
import torch

from specrt import ops
from specrt.ops import reference


def _caches(g):
    """Target (fp32), draft (bf16) and a third cache (fp16), all different shapes."""
    return [torch.randn(3, 2, 10, 4, 2, 8, generator=g),
            torch.randn(2, 2, 12, 4, 1, 16, generator=g).to(torch.bfloat16),
            torch.randn(1, 2, 10, 2, 3, 5, generator=g).to(torch.float16)]


def test_copy_blocks_exact_across_caches_and_dtypes():
    g = torch.Generator().manual_seed(0)
    caches = _caches(g)
    before = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 9], [3, 4], [0, 6], [7, 1], [2, 8]], dtype=torch.int64)
    ops.copy_blocks(caches, mapping)
    for c, b in zip(caches, before):
        want = b.clone()
        for src, dst in mapping.tolist():
            want[:, :, dst] = b[:, :, src]
        assert torch.equal(c, want)
        # untouched blocks are untouched, copied blocks equal their source bit for bit
        untouched = [i for i in range(c.shape[2]) if i not in mapping[:, 1].tolist()]
        assert torch.equal(c[:, :, untouched], b[:, :, untouched])
    # identical to the reference
    ref = [b.clone() for b in before]
    reference.copy_blocks(ref, mapping)
    assert all(torch.equal(a, r) for a, r in zip(caches, ref))


def test_copy_blocks_single_tensor_list_input_and_empty_mapping():
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, 5, 3, 2, 4, generator=g)
    before = cache.clone()
    ops.copy_blocks(cache, [[1, 3]])               # a bare tensor and a list mapping are accepted
    assert torch.equal(cache[:, :, 3], before[:, :, 1])
    ops.copy_blocks([cache], torch.zeros(0, 2, dtype=torch.int64))
    assert torch.equal(cache[:, :, 3], before[:, :, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_exact_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(3, 2, 6, 4, 2, 8, generator=g).to(dtype)
    before = cache.clone()
    k = torch.randn(7, 2, 8, generator=g).to(dtype)
    v = torch.randn(7, 2, 8, generator=g).to(dtype)
    slots = torch.tensor([5, -1, 0, 23, 9, -1, 12])
    ops.write_kv(cache, 2, k, v, slots)
    want = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[2, 0, s // 4, s % 4] = k[t]
            want[2, 1, s // 4, s % 4] = v[t]
    assert torch.equal(cache, want)
    assert torch.equal(cache[:2], before[:2])     # other layers untouched; -1 rows wrote nothing
    ref = before.clone()
    reference.write_kv(ref, 2, k, v, slots)
    assert torch.equal(cache, ref)


def _still_works():
    cache = torch.zeros(1, 2, 3, 2, 1, 2)
    cache[:, :, 0] = 1.0
    ops.copy_blocks([cache], torch.tensor([[0, 2]]))
    assert float(cache[:, :, 2].sum()) == cache[:, :, 2].numel()
    ops.write_kv(cache, 0, torch.full((1, 1, 2), 5.0), torch.full((1, 1, 2), 6.0), torch.tensor([3]))
    assert float(cache[0, 0, 1, 1].sum()) == 10.0 and float(cache[0, 1, 1, 1].sum()) == 12.0


@pytest.mark.parametrize("mapping,match", [
    ([[0, 12]], r"block_mapping\[0\].*out of range for caches\[0\]"),
    ([[-1, 2]], r"block_mapping\[0\].*out of range"),
    ([[11, 2]], r"block_mapping\[0\].*out of range for caches\[1\]"),   # in range of caches[0] only
    ([[1, 2], [3, 2]], r"block_mapping has duplicate destination block 2"),
    ([[1, 2], [2, 3]], r"block_mapping: block 2 is both a source and a destination"),
    ([[4, 4]], r"block_mapping: block 4 is both a source and a destination"),
])
def test_copy_blocks_rejects_bad_mappings(mapping, match):
    g = torch.Generator().manual_seed(3)
    # target cache with 12 blocks, draft cache with 11 (fp16): every pair must fit BOTH
    caches = [torch.randn(1, 2, 12, 2, 1, 2, generator=g), torch.randn(1, 2, 11, 2, 1, 2, generator=g).half()]
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=match):
        ops.copy_blocks(caches, torch.tensor(mapping, dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(caches, before)), "a rejected call must not copy anything"
    _still_works()


def test_copy_blocks_rejects_mismatched_caches():
    good = torch.zeros(1, 2, 4, 2, 1, 2)
    m = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match=r"caches\[1\] must be \[layers, 2, num_blocks"):
        ops.copy_blocks([good, torch.zeros(2, 4, 2, 1, 2)], m)
    with pytest.raises(ValueError, match=r"caches\[1\] dim 1 must be 2"):
        ops.copy_blocks([good, torch.zeros(1, 3, 4, 2, 1, 2)], m)
    with pytest.raises(ValueError, match=r"caches\[1\] must be contiguous"):
        ops.copy_blocks([good, torch.zeros(1, 2, 4, 2, 2, 3).transpose(4, 5)], m)
    with pytest.raises(ValueError, match=r"caches\[1\] must be on cpu"):
        ops.copy_blocks([good, torch.zeros(1, 2, 4, 2, 1, 2, device="meta")], m)
    with pytest.raises(ValueError, match=r"caches must be a non-empty list"):
        ops.copy_blocks([], m)
    with pytest.raises(TypeError, match=r"block_mapping must have dtype int64"):
        ops.copy_blocks([good], m.int())
    with pytest.raises(ValueError, match=r"block_mapping must be \[P, 2\]"):
        ops.copy_blocks([good], torch.tensor([[0, 1, 2]]))
    _still_works()


def test_write_kv_rejects_bad_inputs():
    cache = torch.zeros(2, 2, 3, 4, 2, 5)
    k = torch.ones(3, 2, 5)
    slots = torch.tensor([0, 1, 2])
    cases = [
        (dict(layer=2), ValueError, r"layer = 2 is out of range for cache with 2 layers"),
        (dict(layer=-1), ValueError, r"layer = -1 is out of range"),
        (dict(slot_mapping=torch.tensor([0, 12, 1])), ValueError, r"slot_mapping\[1\] = 12 is out of range"),
        (dict(slot_mapping=torch.tensor([0, -2, 1])), ValueError, r"slot_mapping\[1\] = -2 is out of range"),
        (dict(slot_mapping=torch.tensor([4, 1, 4])), ValueError, r"slot_mapping has duplicate slot 4"),
        (dict(slot_mapping=torch.tensor([0, 1])), ValueError, r"slot_mapping must have size 3"),
        (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, r"slot_mapping must have dtype"),
        (dict(k=torch.ones(3, 2, 5, dtype=torch.float16)), TypeError, r"^k must have dtype"),
        (dict(v=torch.ones(3, 2, 5, dtype=torch.bfloat16)), TypeError, r"^v must have dtype"),
        (dict(k=torch.ones(3, 3, 5), v=torch.ones(3, 3, 5)), ValueError, r"k must be \[T, kv_heads=2, head_dim=5\]"),
        (dict(v=torch.ones(2, 2, 5)), ValueError, r"v must have the shape of k"),
        (dict(k=torch.ones(3, 5, 2).transpose(1, 2)), ValueError, r"^k must be contiguous"),
        (dict(cache=torch.zeros(2, 2, 3, 4, 10)), ValueError, r"cache must be \[layers, 2, num_blocks"),
        (dict(cache=torch.zeros(2, 2, 3, 4, 5, 2).transpose(4, 5)), ValueError, r"cache must be contiguous"),
        (dict(k=torch.ones(3, 2, 5, device="meta")), ValueError, r"^k must be on cpu"),
    ]
    for override, exc, match in cases:
        args = dict(cache=cache, layer=1, k=k, v=k.clone(), slot_mapping=slots)
        args.update(override)
        with pytest.raises(exc, match=match):
            ops.write_kv(args["cache"], args["layer"], args["k"], args["v"], args["slot_mapping"])
        assert float(cache.abs().sum()) == 0.0, (override, "a rejected write must not write")
    _still_works()


# Issue 14, defect 10: floats were truncated ([[0.9, 1.7]] copied block 0 to block 1, layer
# 0.9 wrote layer 0). They are rejected, and nothing is written.
@pytest.mark.parametrize("mapping", [[[0.9, 1.7]], [[0.0, 1.0]], torch.tensor([[0.0, 1.0]]), [[True, False]]])
def test_copy_blocks_rejects_non_integer_block_ids(mapping):
    cache = torch.arange(1 * 2 * 3 * 2 * 1 * 2, dtype=torch.float32).view(1, 2, 3, 2, 1, 2)
    before = cache.clone()
    with pytest.raises(TypeError, match=r"block_mapping must (hold integer block ids|have dtype int64)"):
        ops.copy_blocks([cache], mapping)
    assert torch.equal(cache, before)
    _still_works()


@pytest.mark.parametrize("layer", [0.9, 1.0, True, "0", None, torch.tensor(0.0)])
def test_write_kv_rejects_non_integer_layer(layer):
    cache = torch.zeros(2, 2, 3, 4, 2, 5)
    k = torch.ones(3, 2, 5)
    with pytest.raises(TypeError, match=r"^layer must be an integer"):
        ops.write_kv(cache, layer, k, k, torch.tensor([0, 1, 2]))
    assert float(cache.abs().sum()) == 0.0
    # integer-like layers are fine: numpy / torch integer scalars
    import numpy as np
    for ok in (np.int64(1), torch.tensor(1)):
        ops.write_kv(cache, ok, k, k, torch.tensor([0, 1, 2]))
    assert float(cache[1].abs().sum()) > 0 and float(cache[0].abs().sum()) == 0.0
    _still_works()
