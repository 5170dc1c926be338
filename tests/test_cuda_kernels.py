"""CUDA kernels against the CPU kernels on identical inputs (docs/architecture.md sections 2 and 3).

The CPU op is the oracle here (it is itself proven against specrt/ops/reference.py in
test_ops_reference.py): every token-producing CUDA op must return tokens BIT-IDENTICAL
to the CPU op; probs_from_logits agrees within 1e-6 with the same support and exactly
the same one-hot rows; copy_blocks / write_kv are exact for bf16, fp16 and fp32 caches.
Also: CUDA-graph capture + replay of rejection_sample gives the eager tokens (seeds and
positions are read from device tensors), no op syncs with the host
(torch.cuda.set_sync_debug_mode("error")), ops run on the current stream, and 64-bit
offsets (B*K*V > 2^31) do not overflow.

Skipped unless a GPU is present and specrt was built with its CUDA kernels.
"""
from __future__ import annotations

import pytest
import torch

from specrt import ops
from specrt.ops import reference

from _cases import (gen, greedy_case, logits_case, random_rows, seeds_positions,  # noqa: E402  (tests/ on sys.path)
                    spec_case)

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()),
                                reason="needs a CUDA GPU and a CUDA build of specrt (SPECRT_CUDA=1)")

DEV = "cuda"
BATCHES = (1, 3, 17)
VOCABS = (2, 7, 1000, 32003, 128256)
KS = (0, 1, 4, 8)


def _cuda(*tensors):
    return [None if t is None else t.to(DEV) for t in tensors]


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0 and out.is_contiguous()
    return out


def _cases():
    for b in BATCHES:
        for v in VOCABS:
            for k in KS:
                if b * (k + 1) * v > 40_000_000:   # keep the CPU oracle quick
                    continue
                yield b, v, k


CASES = list(_cases())


# --------------------------------------------------------------------------- #
# rejection_sample / coupled / sample_tokens / verify_greedy: bit-identical tokens
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("b,v,k", CASES)
@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sample_cuda_equals_cpu(b, v, k, with_q):
    g = gen("rej", b, v, k, with_q)
    case = spec_case(b, v, k, with_q, g)
    want_out, want_acc = ops.rejection_sample(*case)
    got_out, got_acc = ops.rejection_sample(*_cuda(*case))
    assert got_out.device.type == DEV and got_out.dtype == torch.int32
    assert torch.equal(got_acc.cpu(), want_acc), (got_acc, want_acc)
    assert torch.equal(got_out.cpu(), want_out), (got_out, want_out)


@pytest.mark.parametrize("b,v,k", [(3, 1000, 4), (17, 32003, 8), (1, 128256, 4)])
def test_rejection_sample_cuda_misaligned_rows(b, v, k):
    """V % 4 != 0 or a base pointer off 16 bytes takes the scalar path: same tokens."""
    g = gen("rej-mis", b, v, k)
    tp, dp, ids, nd, seeds, pos = spec_case(b, v, k, True, g)
    want = ops.rejection_sample(tp, dp, ids, nd, seeds, pos)
    tp_d, dp_d = _misaligned(tp.to(DEV)), _misaligned(dp.to(DEV))
    got = ops.rejection_sample(tp_d, dp_d, *_cuda(ids, nd, seeds, pos))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("b,v,k", CASES)
def test_coupled_cuda_equals_cpu(b, v, k):
    g = gen("coupled", b, v, k)
    tp, dp, ids, nd, seeds, pos = spec_case(b, v, k, True, g)
    # every other request drafts the target's own race winners: long accepted prefixes
    for r in range(0, b, 2):
        n = int(nd[r])
        if n:
            rows = tp[r, :n]
            ids[r, :n] = ops.sample_tokens(rows, seeds[r].repeat(n), pos[r] + torch.arange(n), purpose="target")
    want = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method="coupled")
    got = ops.rejection_sample(*_cuda(tp, dp, ids, nd, seeds, pos), method="coupled")
    assert torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu(), want[0])
    if k > 0:
        assert int(got[1][0]) == int(nd[0])   # request 0 drafted the winners: all accepted


@pytest.mark.parametrize("b,v", [(b, v) for b in BATCHES for v in VOCABS])
@pytest.mark.parametrize("purpose", sorted(ops.PURPOSES))
def test_sample_tokens_cuda_equals_cpu(b, v, purpose):
    g = gen("sample", b, v, purpose)
    probs = random_rows(g, (b,), v)
    probs[0] = torch.nn.functional.one_hot(torch.tensor(v - 1), v).float()   # greedy row
    if b > 2:
        probs[2] *= 7.5        # unnormalised
        probs[1] = 0.0         # all-zero row: token 0 (torch.argmax of all-zero scores)
    seeds, pos = seeds_positions(g, b)
    want = ops.sample_tokens(probs, seeds, pos, purpose=purpose, check_values=False)
    got = ops.sample_tokens(*_cuda(probs, seeds, pos), purpose=purpose)
    assert torch.equal(got.cpu(), want)
    assert int(got[0]) == v - 1


@pytest.mark.parametrize("b,v,k", CASES)
def test_verify_greedy_cuda_equals_cpu(b, v, k):
    g = gen("greedy", b, v, k)
    logits, ids, nd = greedy_case(b, v, k, g, jitter=True)
    want = ops.verify_greedy(logits, ids, nd)
    got = ops.verify_greedy(*_cuda(logits, ids, nd))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert int(got[1][0]) == k
    if v % 4 == 0:   # scalar path on a misaligned copy
        got2 = ops.verify_greedy(_misaligned(logits.to(DEV)), *_cuda(ids, nd))
        assert torch.equal(got2[0].cpu(), want[0])


# --------------------------------------------------------------------------- #
# probs_from_logits
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("n", BATCHES + (40,))
@pytest.mark.parametrize("v", VOCABS)
def test_probs_from_logits_cuda_matches_cpu(n, v):
    g = gen("probs", n, v)
    logits, t, k, p = logits_case(n, v, g)
    want = ops.probs_from_logits(logits, t, k, p)
    for x in (logits.to(DEV), _misaligned(logits.to(DEV))):
        got = ops.probs_from_logits(x, *_cuda(t, k, p)).cpu()
        assert got.dtype == torch.float32 and got.shape == (n, v)
        # Same support wherever top-p is off. With top-p on, exp() may differ by an ulp
        # between libm and CUDA, which can move a cut that lands within ~1e-9 of top_p;
        # such a flip changes no probability by more than the tolerance below.
        no_top_p = p >= 1.0
        assert torch.equal((got > 0)[no_top_p], (want > 0)[no_top_p]), "support differs"
        flips = ((got > 0) != (want > 0)).sum(-1)
        assert int(flips.max()) <= max(2, v // 1000), f"top-p support differs in {int(flips.max())} tokens"
        assert torch.allclose(got, want, atol=1e-6, rtol=0), float((got - want).abs().max())
        onehot = (t < ops.TEMPERATURE_EPS) | (want == 1.0).any(-1)
        assert torch.equal(got[onehot], want[onehot]), "one-hot rows must be identical"


@pytest.mark.parametrize("t", [1e-45, 1e-38, 1e-8])
def test_probs_from_logits_tiny_temperature_cuda_is_greedy(t):
    """Issue 14, defect 3 on the device: the kernel applies the shared greedy threshold."""
    logits = torch.tensor([[1.0, 5.0, 3.0], [-2.0, 7.5, 7.5]], device=DEV)
    args = (torch.full((2,), t, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV), torch.ones(2, device=DEV))
    got = ops.probs_from_logits(logits, *args).cpu()
    assert torch.equal(got, torch.tensor([[0, 1.0, 0], [0, 1.0, 0]]))


def test_cuda_ops_check_devices_and_wide_integers():
    """Mixed devices are named; int64 ids/counts are range-checked (debug) or saturated (not wrapped)."""
    logits = torch.tensor([[[0.0, 9.0, 1.0], [0.0, 0.0, 9.0]]], device=DEV)
    with pytest.raises(ValueError, match=r"num_draft_tokens must be on cuda"):
        ops.verify_greedy(logits, torch.tensor([[1]], device=DEV), torch.tensor([1]))
    out, acc = ops.verify_greedy(logits, torch.tensor([[2**32 + 1]], device=DEV), torch.tensor([1], device=DEV))
    assert acc.tolist() == [0] and out.tolist() == [[1, -1]]
    ops.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=r"draft_token_ids\[0, 0\] = 4294967297"):
            ops.verify_greedy(logits, torch.tensor([[2**32 + 1]], device=DEV), torch.tensor([1], device=DEV))
    finally:
        ops.set_debug_checks(False)


# --------------------------------------------------------------------------- #
# KV cache
# --------------------------------------------------------------------------- #
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cache(shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("mapping_on_device", [False, True])
def test_copy_blocks_cuda_exact(mapping_on_device):
    g = gen("copy_blocks", mapping_on_device)
    # target, draft and odd-shaped caches of every dtype (odd block bytes -> narrow copy units)
    shapes = [((3, 2, 11, 16, 4, 8), torch.bfloat16), ((1, 2, 11, 16, 2, 8), torch.float16),
              ((2, 2, 11, 3, 1, 5), torch.float32), ((2, 2, 11, 1, 1, 3), torch.float16),
              ((4, 2, 11, 16, 2, 64), torch.float32)]
    caches = [_cache(s, d, g) for s, d in shapes]
    mapping = torch.tensor([[0, 5], [3, 7], [10, 1], [2, 9]], dtype=torch.int64)
    want = [c.clone() for c in caches]
    reference.copy_blocks(want, mapping)
    got = [c.to(DEV) for c in caches]
    ops.copy_blocks(got, mapping.to(DEV) if mapping_on_device else mapping)
    for c, w in zip(got, want):
        assert torch.equal(c.cpu(), w)
    # a misaligned cache (base pointer off 16 bytes) still copies exactly
    odd = _misaligned(caches[0].to(DEV))
    ops.copy_blocks([odd], mapping)
    assert torch.equal(odd.cpu(), want[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [(4, 64), (1, 3), (2, 8)])
def test_write_kv_cuda_exact(dtype, hd):
    h, d = hd
    g = gen("write_kv", str(dtype), hd)
    cache = _cache((3, 2, 6, 4, h, d), dtype, g)
    t = 17
    k = _cache((t, h, d), dtype, g)
    v = _cache((t, h, d), dtype, g)
    slots = torch.randperm(6 * 4, generator=g)[:t].to(torch.int64)
    slots[::5] = -1   # padding
    want = cache.clone()
    reference.write_kv(want, 1, k, v, slots)
    got = cache.to(DEV)
    ops.write_kv(got, 1, *_cuda(k, v, slots))
    assert torch.equal(got.cpu(), want)


# --------------------------------------------------------------------------- #
# CUDA graphs, streams, host syncs, 64-bit offsets
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("method", ["rejection", "coupled"])
def test_rejection_sample_cuda_graph_replay(method):
    g = gen("graph", method)
    b, v, k = 17, 32003, 4
    tp, dp, ids, nd, seeds, pos = _cuda(*spec_case(b, v, k, True, g))
    eager = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method=method)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # warm-up outside capture
        ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method=method)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_acc = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method=method)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager[0]) and torch.equal(static_acc, eager[1])
    # new seeds / positions written into the captured device tensors are picked up on replay
    seeds.add_(12345)
    pos.add_(7)
    graph.replay()
    torch.cuda.synchronize()
    eager2 = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method=method)
    assert torch.equal(static_out, eager2[0]) and torch.equal(static_acc, eager2[1])
    cpu2 = ops.rejection_sample(*[t.cpu() for t in (tp, dp, ids, nd, seeds, pos)], method=method)
    assert torch.equal(static_out.cpu(), cpu2[0])


def test_no_host_sync_and_current_stream():
    g = gen("nosync")
    b, v, k = 3, 1000, 4
    tp, dp, ids, nd, seeds, pos = _cuda(*spec_case(b, v, k, True, g))
    logits = torch.randn(b * (k + 1), v, generator=g).to(DEV)
    t = torch.full((b * (k + 1),), 0.8, device=DEV)
    tk = torch.full((b * (k + 1),), 20, dtype=torch.int32, device=DEV)
    tpp = torch.full((b * (k + 1),), 0.9, device=DEV)
    cache = torch.randn(2, 2, 8, 4, 2, 8, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(5, 2, 8, device=DEV, dtype=torch.bfloat16)
    slots = torch.tensor([0, 3, -1, 9, 30], device=DEV)
    mapping = torch.tensor([[0, 4], [1, 5]], device=DEV)
    rows0 = tp[:, 0].contiguous()
    expected = {
        "probs": ops.probs_from_logits(logits, t, tk, tpp),
        "greedy": ops.verify_greedy(tp, ids, nd),
        "rej": ops.rejection_sample(tp, dp, ids, nd, seeds, pos),
        "coupled": ops.rejection_sample(tp, None, ids, nd, seeds, pos, method="coupled"),
        "sample": ops.sample_tokens(rows0, seeds, pos),
    }
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            got = {
                "probs": ops.probs_from_logits(logits, t, tk, tpp),
                "greedy": ops.verify_greedy(tp, ids, nd),
                "rej": ops.rejection_sample(tp, dp, ids, nd, seeds, pos),
                "coupled": ops.rejection_sample(tp, None, ids, nd, seeds, pos, method="coupled"),
                "sample": ops.sample_tokens(rows0, seeds, pos),
            }
            ops.copy_blocks([cache], mapping)
            ops.write_kv(cache, 1, kv, kv, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    assert torch.equal(got["probs"], expected["probs"])
    for key in ("greedy", "rej", "coupled"):
        assert torch.equal(got[key][0], expected[key][0]) and torch.equal(got[key][1], expected[key][1]), key
    assert torch.equal(got["sample"], expected["sample"])


def test_bad_device_ids_never_fault():
    """Unvalidated device inputs (debug checks off) with out-of-range ids/slots: no crash."""
    g = gen("bad-ids")
    b, v, k = 3, 1000, 4
    tp, dp, ids, nd, seeds, pos = _cuda(*spec_case(b, v, k, True, g))
    ids[:, 0] = torch.tensor([v, -7, 2**30], dtype=torch.int32, device=DEV)
    nd = torch.tensor([k + 3, -1, k], dtype=torch.int32, device=DEV)
    for method in ("rejection", "coupled"):
        out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method=method)
        out2, _ = ops.rejection_sample(tp, None, ids, nd, seeds, pos, method=method)
        torch.cuda.synchronize()
        assert bool(((out >= -1) & (out < v)).all()) and bool(((out2 >= -1) & (out2 < v)).all())
        assert bool(((acc >= 0) & (acc <= k)).all())
    ops.verify_greedy(tp, ids, nd)
    cache = torch.zeros(1, 2, 4, 2, 1, 8, device=DEV)
    ops.write_kv(cache, 0, torch.ones(3, 1, 8, device=DEV), torch.ones(3, 1, 8, device=DEV),
                 torch.tensor([-1, 8, 2**40], device=DEV), check_values=False)
    ops.copy_blocks([cache], torch.tensor([[0, 99], [-3, 1]], device=DEV), check_values=False)
    torch.cuda.synchronize()
    assert float(cache.abs().sum()) == 0.0


def test_64bit_offsets():
    """N * V > 2^31 elements: row offsets must be 64-bit."""
    v = 128256
    n = (2**31) // v + 8
    need = n * v * 4 * 2
    free, _ = torch.cuda.mem_get_info()
    if free < need + (4 << 30):
        pytest.skip(f"needs {need >> 30} GiB of free GPU memory")
    g = torch.Generator(device=DEV).manual_seed(7)
    probs = torch.rand(n, v, device=DEV, generator=g)
    seeds = torch.arange(n, device=DEV, dtype=torch.int64) * 7919
    pos = torch.arange(n, device=DEV, dtype=torch.int64) + 100
    got = ops.sample_tokens(probs, seeds, pos)
    tail = slice(n - 4, n)
    want = ops.sample_tokens(probs[tail].cpu(), seeds[tail].cpu(), pos[tail].cpu())
    assert torch.equal(got[tail].cpu(), want)
    # rejection_sample with B*(K+1)*V > 2^31 (last request's rows live past 2^31 floats)
    k = 8
    b = n // (k + 1)
    tp = probs[: b * (k + 1)].view(b, k + 1, v)
    ids = torch.zeros(b, k, dtype=torch.int32, device=DEV)
    nd = torch.full((b,), k, dtype=torch.int32, device=DEV)
    out, acc = ops.rejection_sample(tp, None, ids, nd, seeds[:b], pos[:b])
    last = slice(b - 2, b)
    want_out, want_acc = ops.rejection_sample(tp[last].cpu(), None, ids[last].cpu(), nd[last].cpu(),
                                              seeds[:b][last].cpu(), pos[:b][last].cpu())
    assert torch.equal(out[last].cpu(), want_out) and torch.equal(acc[last].cpu(), want_acc)
    del probs, tp
    torch.cuda.empty_cache()
