"""Every CUDA kernel of csrc/cuda, unchanged, run on the CPU by the SIMT emulator (csrc/emu/README.md)
and compared bit for bit with the CPU kernels, under three thread / block orders (forward,
reverse, shuffled): sampling (probs_from_logits incl. min-p, verify_greedy, rejection_sample,
coupled, sample_tokens), penalties, grammar bitmasks, paged attention (chunks, combine, tree masks), KV copy / write,
token trees. The cases are the GPU tests' own (tests/_cases.py and the case lists of
test_cuda_kernels.py, test_tree_verify.py, test_attention_kernel.py, test_tree_attention.py,
test_controls_kernels.py) at small shapes.

Also: the emulator catches deliberately broken kernels (a barrier removed, a barrier in
warp-0-only code, a shuffle over exited lanes, an index off by one, an out-of-bounds read under
AddressSanitizer) and rejects device math it cannot reproduce (expf).

Needs g++ (C++20) and ucontext; otherwise the module skips with one line saying why. The build
(~1-2 min, cached in build/cudaemu/) happens on first use; a build failure is a test failure.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import zlib

import pytest
import torch

import cudaemu
from specrt import ops
from specrt.ops import reference

from _env import CHILD_CWD, child_env  # noqa: E402
from _cases import gen, greedy_case, logits_case, random_rows, seeds_positions, spec_case, tree_case, \
    tree_greedy_case  # noqa: E402  (tests/ on sys.path)

_PROBLEM = cudaemu.environment_problem()
if _PROBLEM:
    pytest.skip(_PROBLEM, allow_module_level=True)

from test_attention_kernel import RAGGED, make_case  # noqa: E402
from test_controls_kernels import _min_ps, _params, penalty_case  # noqa: E402
from test_tree_attention import run as tree_attention_run, tree_batch  # noqa: E402
from test_token_bitmask import bitmask_case  # noqa: E402
from test_tree_verify import CUDA_CASES as TREE_CASES, MAPPINGS, _caches, _chain_parents, _equal  # noqa: E402

ORDERS = cudaemu.ORDERS
MAX_ELEMS = 400_000            # rows * V per case: keeps the emulated runs small


# --------------------------------------------------------------------------- #
# fixtures: the emulated build, and one parametrisation per thread order
# --------------------------------------------------------------------------- #
_state: dict = {"cases": 0, "t0": None}


@pytest.fixture(scope="module")
def emu(request):
    if "error" in _state:
        pytest.skip("the emulated build failed: see the first failure")
    try:
        lib = cudaemu.load()
    except cudaemu.BuildError as exc:
        _state["error"] = str(exc)
        pytest.fail(str(exc), pytrace=False)
    _state["t0"] = time.perf_counter()
    before = lib.stats()

    def summary():
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None or not _state["cases"]:
            return
        s = {k: v - before[k] for k, v in lib.stats().items()}
        capman = request.config.pluginmanager.get_plugin("capturemanager")
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            tr.write_line("")
            tr.write_line(f"specrt emu: {_state['cases']} emulated CUDA test cases ({len(ORDERS)} thread orders) in "
                          f"{time.perf_counter() - _state['t0']:.1f} s: {s['launches']} launches, {s['blocks']} "
                          f"blocks, "
                          f"{s['threads']} threads, {s['switches']} fiber switches, {s['barriers']} barriers, "
                          f"{s['collectives']} warp-collective arrivals")

    request.addfinalizer(summary)
    return lib


@pytest.fixture(params=ORDERS)
def cuda(request, emu):
    """The emulated device, in one thread order (shuffled with a seed from the test id)."""
    emu.set_order(request.param, zlib.crc32(request.node.nodeid.encode()))
    _state["cases"] += 1
    return emu


def _small(rows: int, v: int) -> bool:
    return rows * v <= MAX_ELEMS


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy whose data pointer is one element past a 16-byte boundary (scalar paths)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


def _same(got, want):
    got, want = (got, want) if isinstance(got, (tuple, list)) else ((got,), (want,))
    assert len(got) == len(want)
    for a, w in zip(got, want):
        assert a.dtype == w.dtype and a.shape == w.shape, (a.dtype, w.dtype, a.shape, w.shape)
        if a.is_floating_point():      # bit for bit, NaN included
            a, w = a.view(torch.int32 if a.element_size() == 4 else torch.int16), \
                w.view(torch.int32 if w.element_size() == 4 else torch.int16)
        assert torch.equal(a, w), (a, w)


# --------------------------------------------------------------------------- #
# sampling (test_cuda_kernels.py's cases; V = 5003 / 4096 span several vocabulary chunks)
# --------------------------------------------------------------------------- #
BATCHES = (1, 3, 17)
VOCABS = (2, 7, 1000, 4096, 5003)
KS = (0, 1, 4, 8)
CASES = [(b, v, k) for b in BATCHES for v in VOCABS for k in KS if _small(b * (k + 1), v)]


@pytest.mark.parametrize("b,v,k", CASES)
@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sample(b, v, k, with_q, cuda):
    case = spec_case(b, v, k, with_q, gen("rej", b, v, k, with_q))
    want = ops.rejection_sample(*case)
    with cuda.active():
        got = ops.rejection_sample(*case)
    _same(got, want)


@pytest.mark.parametrize("b,v,k", [(3, 1000, 4), (17, 4096, 1), (1, 5003, 4)])
def test_rejection_sample_misaligned_rows(b, v, k, cuda):
    tp, dp, ids, nd, seeds, pos = spec_case(b, v, k, True, gen("rej-mis", b, v, k))
    want = ops.rejection_sample(tp, dp, ids, nd, seeds, pos)
    with cuda.active():
        got = ops.rejection_sample(_misaligned(tp), _misaligned(dp), ids, nd, seeds, pos)
    _same(got, want)


@pytest.mark.parametrize("b,v,k", CASES)
def test_coupled(b, v, k, cuda):
    tp, dp, ids, nd, seeds, pos = spec_case(b, v, k, True, gen("coupled", b, v, k))
    for r in range(0, b, 2):   # every other request drafts the target's own race winners
        n = int(nd[r])
        if n:
            ids[r, :n] = ops.sample_tokens(tp[r, :n], seeds[r].repeat(n), pos[r] + torch.arange(n), purpose="target")
    want = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method="coupled")
    with cuda.active():
        got = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method="coupled")
    _same(got, want)
    if k > 0:
        assert int(got[1][0]) == int(nd[0])


@pytest.mark.parametrize("b,v", [(b, v) for b in BATCHES for v in VOCABS])
@pytest.mark.parametrize("purpose", sorted(ops.PURPOSES))
def test_sample_tokens(b, v, purpose, cuda):
    g = gen("sample", b, v, purpose)
    probs = random_rows(g, (b,), v)
    probs[0] = torch.nn.functional.one_hot(torch.tensor(v - 1), v).float()
    if b > 2:
        probs[2] *= 7.5        # unnormalised
        probs[1] = 0.0         # all-zero row: token 0
    seeds, pos = seeds_positions(g, b)
    want = ops.sample_tokens(probs, seeds, pos, purpose=purpose, check_values=False)
    with cuda.active():
        got = ops.sample_tokens(probs, seeds, pos, purpose=purpose)
    _same(got, want)
    assert int(got[0]) == v - 1


@pytest.mark.parametrize("b,v,k", CASES)
def test_verify_greedy(b, v, k, cuda):
    logits, ids, nd = greedy_case(b, v, k, gen("greedy", b, v, k), jitter=True)
    want = ops.verify_greedy(logits, ids, nd)
    with cuda.active():
        got = ops.verify_greedy(logits, ids, nd)
        got2 = ops.verify_greedy(_misaligned(logits), ids, nd) if v % 4 == 0 else got
    _same(got, want)
    _same(got2, want)
    assert int(got[1][0]) == k


PROBS_CASES = [(n, v) for n in (1, 3, 17, 40) for v in (2, 7, 300, 1000, 2051) if n * v <= 20_000]


@pytest.mark.parametrize("n,v", PROBS_CASES)
def test_probs_from_logits(n, v, cuda):
    """Bit for bit: both kernels use specrt/exp_det.h (the CUDA kernel's expf differed by up to 2 ulp)."""
    logits, t, k, p = logits_case(n, v, gen("probs", n, v))
    want = ops.probs_from_logits(logits, t, k, p)
    with cuda.active():
        got = ops.probs_from_logits(logits, t, k, p)
        got_mis = ops.probs_from_logits(_misaligned(logits), t, k, p)
    _same(got, want)
    _same(got_mis, want)


@pytest.mark.parametrize("v", [50, 1000])
def test_min_p(v, cuda):
    """test_controls_kernels.py's min-p case, now bit for bit (one exp on both sides)."""
    g = gen("min_p-cuda", v)
    n = 12
    logits = torch.randn(n, v, generator=g) * 2
    temps, top_k, top_p = _params(n, v, g)
    min_p = _min_ps(n, g)
    want = ops.probs_from_logits(logits, temps, top_k, top_p, min_p=min_p)
    with cuda.active():
        got = ops.probs_from_logits(logits, temps, top_k, top_p, min_p=min_p)
    _same(got, want)


@pytest.mark.parametrize("t", [1e-45, 1e-38, 1e-8])
def test_probs_from_logits_tiny_temperature_is_greedy(t, cuda):
    logits = torch.tensor([[1.0, 5.0, 3.0], [-2.0, 7.5, 7.5]])
    args = (torch.full((2,), t), torch.zeros(2, dtype=torch.int32), torch.ones(2))
    with cuda.active():
        got = ops.probs_from_logits(logits, *args)
    assert torch.equal(got, torch.tensor([[0, 1.0, 0], [0, 1.0, 0]]))


def test_bad_device_ids_never_fault(cuda):
    """Unvalidated inputs (the device's default) with out-of-range ids / slots / counts stay in bounds."""
    b, v, k = 3, 1000, 4
    tp, dp, ids, nd, seeds, pos = spec_case(b, v, k, True, gen("bad-ids"))
    ids[:, 0] = torch.tensor([v, -7, 2**30], dtype=torch.int32)
    nd = torch.tensor([k + 3, -1, k], dtype=torch.int32)
    with cuda.active():
        for method in ("rejection", "coupled"):
            out, acc = ops.rejection_sample(tp, dp, ids, nd, seeds, pos, method=method)
            out2, _ = ops.rejection_sample(tp, None, ids, nd, seeds, pos, method=method)
            assert bool(((out >= -1) & (out < v)).all()) and bool(((out2 >= -1) & (out2 < v)).all())
            assert bool(((acc >= 0) & (acc <= k)).all())
        ops.verify_greedy(tp, ids, nd)
        cache = torch.zeros(1, 2, 4, 2, 1, 8)
        ops.write_kv(cache, 0, torch.ones(3, 1, 8), torch.ones(3, 1, 8), torch.tensor([-1, 8, 2**40]),
                     check_values=False)
        ops.copy_blocks([cache], torch.tensor([[0, 99], [-3, 1]]), check_values=False)
    assert float(cache.abs().sum()) == 0.0


@pytest.mark.parametrize("b,v,k", [(1, 128256, 4), (3, 32003, 8)])
def test_large_vocabulary(b, v, k, cuda):
    """Real vocabularies: up to 8 vocabulary chunks per row in the race / argmax grids; a tree walk over 32k."""
    case = spec_case(b, v, k, True, gen("rej", b, v, k, True))
    logits, ids, nd = greedy_case(b, v, k, gen("greedy", b, v, k), jitter=True)
    tree = tree_case(1, 6, v, True, gen("tree-cuda", 1, 6, v, True))
    seeds, pos = seeds_positions(gen("large", b, v), b)
    runs = [lambda: ops.rejection_sample(*case), lambda: ops.rejection_sample(*case, method="coupled"),
            lambda: ops.verify_greedy(logits, ids, nd), lambda: ops.sample_tokens(case[0][:, 0].contiguous(), seeds, pos),
            lambda: ops.rejection_sample_tree(*tree)]
    for run in runs:
        want = run()
        with cuda.active():
            got = run()
        _same(got, want)


# --------------------------------------------------------------------------- #
# penalties
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("seed", range(4))
def test_apply_penalties(seed, cuda):
    logits, args = penalty_case(gen("penalties-cuda", seed), b=3 + seed, k=seed + 1, v=100 + 37 * seed)
    want = logits.clone()
    ops.apply_penalties(want, *args)
    got = logits.clone()
    with cuda.active():
        ops.apply_penalties(got, *args)
    _same(got, want)


# --------------------------------------------------------------------------- #
# grammar token bitmasks
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("v,n,extra", [(33, 3, 1), (2048 + 5, 4, 0), (5000, 2, 2)])
def test_apply_token_bitmask(dtype, v, n, extra, cuda):
    logits, words, rows = bitmask_case(gen("bitmask-cuda", v, n), n + 2, v, n, extra)
    logits = logits.to(dtype)
    want = logits.clone()
    ops.apply_token_bitmask(want, words, rows)
    got = logits.clone()
    with cuda.active():
        ops.apply_token_bitmask(got, words, rows)
    _same(got, want)


# --------------------------------------------------------------------------- #
# KV cache
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("misaligned", [False, True])
def test_copy_blocks(misaligned, cuda):
    g = gen("copy_blocks", False)
    shapes = [((3, 2, 11, 16, 4, 8), torch.bfloat16), ((1, 2, 11, 16, 2, 8), torch.float16),
              ((2, 2, 11, 3, 1, 5), torch.float32), ((2, 2, 11, 1, 1, 3), torch.float16),
              ((4, 2, 11, 16, 2, 64), torch.float32)]
    caches = [torch.randn(*s, generator=g).to(d) for s, d in shapes]
    if misaligned:
        caches = [_misaligned(caches[0])]
    mapping = torch.tensor([[0, 5], [3, 7], [10, 1], [2, 9]], dtype=torch.int64)
    want = [c.clone() for c in caches]
    reference.copy_blocks(want, mapping)
    with cuda.active():
        ops.copy_blocks(caches, mapping)
    for c, w in zip(caches, want):
        _same(c, w)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("hd", [(4, 64), (1, 3), (2, 8)])
def test_write_kv(dtype, hd, cuda):
    h, d = hd
    g = gen("write_kv", str(dtype), hd)
    cache = torch.randn(3, 2, 6, 4, h, d, generator=g).to(dtype)
    k = torch.randn(17, h, d, generator=g).to(dtype)
    v = torch.randn(17, h, d, generator=g).to(dtype)
    slots = torch.randperm(6 * 4, generator=g)[:17].to(torch.int64)
    slots[::5] = -1
    want = cache.clone()
    reference.write_kv(want, 1, k, v, slots)
    with cuda.active():
        ops.write_kv(cache, 1, k, v, slots)
    _same(cache, want)


@pytest.mark.parametrize("name", sorted(MAPPINGS))
def test_copy_slots(name, cuda):
    mapping = torch.tensor(MAPPINGS[name], dtype=torch.int64)
    want = _caches(gen("copy-slots-cuda", name))
    reference.copy_slots(want, mapping)
    got = _caches(gen("copy-slots-cuda", name))
    with cuda.active():
        ops.copy_slots(got, mapping)
    for c, w in zip(got, want):
        _same(c, w)


# --------------------------------------------------------------------------- #
# token trees (test_tree_verify.py's CUDA cases at small vocabularies)
# --------------------------------------------------------------------------- #
SMALL_TREES = [(b, n, v) for b, n, v in TREE_CASES if _small(b * (n + 1), v) and v <= 1000]


@pytest.mark.parametrize("b,n,v", SMALL_TREES)
@pytest.mark.parametrize("method,with_q", [("rejection", True), ("rejection", False), ("coupled", False)])
def test_rejection_sample_tree(b, n, v, method, with_q, cuda):
    case = tree_case(b, n, v, with_q, gen("tree-cuda", b, n, v, with_q))
    want = ops.rejection_sample_tree(*case, method=method)
    with cuda.active():
        got = ops.rejection_sample_tree(*case, method=method)
    _equal(got, want)


@pytest.mark.parametrize("b,n,v", SMALL_TREES)
def test_verify_tree_greedy(b, n, v, cuda):
    case = tree_greedy_case(b, n, v, gen("tree-greedy-cuda", b, n, v))
    want = ops.verify_tree_greedy(*case)
    with cuda.active():
        got = ops.verify_tree_greedy(*case)
    _equal(got, want)


def test_tree_chain_equals_chain(cuda):
    """A chain given as a tree: the tree kernel returns the chain kernels' tokens (and the CPU's)."""
    b, v, k = 5, 4099, 4
    tp, dp, ids, nd, seeds, positions = spec_case(b, v, k, True, gen("chain-cuda"))
    parents = _chain_parents(b, k)
    for method in ("rejection", "coupled"):
        want = ops.rejection_sample(tp, dp, ids, nd, seeds, positions, method=method)
        with cuda.active():
            chain = ops.rejection_sample(tp, dp, ids, nd, seeds, positions, method=method)
            tree = ops.rejection_sample_tree(tp, dp, ids, parents, nd, seeds, positions, method=method)
        _same(chain, want)
        _same(tree[:2], want)


# --------------------------------------------------------------------------- #
# paged attention (chunk + combine kernels, GQA, windows, trees, every cache dtype)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 37])
def test_paged_attention(dtype, window, cuda):
    case = make_case(**RAGGED, head_dim=40, window=window, dtype=dtype, padding_rows=2, share_prefix=True, seed=12)
    want = case.run()
    long = make_case([1100, 520, 1], [5, 1, 1], heads=4, kv_heads=2, head_dim=16, dtype=dtype, window=window,
                     seed=13)
    long_want = long.run()
    with cuda.active():
        got = ops.paged_attention(*case.args(), max_query_len=16, max_seq_len=700)
        long_got = ops.paged_attention(*long.args(), max_query_len=5, max_seq_len=1100)
    _same(got, want)
    _same(long_got, long_want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 24])
def test_tree_attention(dtype, window, cuda):
    q, cache, meta = tree_batch(dtype, seed=13, heads=4, kv_heads=2, head_dim=32)
    tm = torch.cat([meta.tree_mask, meta.tree_mask.new_full((3,), -1)])
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 32 ** -0.5, window)
    want = ops.paged_attention(*args, max_query_len=40, max_seq_len=400, tree_mask=tm)
    assert torch.equal(want, tree_attention_run(q, cache, meta, window))
    causal = ops.paged_attention(*args, max_query_len=40, max_seq_len=400, tree_mask=torch.full_like(tm, -1))
    with cuda.active():
        got = ops.paged_attention(*args, max_query_len=40, max_seq_len=400, tree_mask=tm)
        none = ops.paged_attention(*args, max_query_len=40, max_seq_len=400, tree_mask=torch.full_like(tm, -1))
    _same(got, want)
    _same(none, causal)


def test_paged_attention_smem_opt_in(cuda):
    """head_dim 256: > 48 KiB of dynamic shared memory, which the launcher opts into (cudaFuncSetAttribute)."""
    case = make_case([300, 40], [3, 2], heads=2, kv_heads=1, head_dim=256, seed=5)
    want = case.run()
    with cuda.active():
        got = ops.paged_attention(*case.args(), max_query_len=3, max_seq_len=300)
    _same(got, want)


# --------------------------------------------------------------------------- #
# the emulator catches broken kernels
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def selftest():
    return cudaemu.Selftest(cudaemu.build_selftest())


def test_selftest_correct_kernels_agree_in_every_order(selftest):
    for name in ("block_sum", "collectives", "activemask_hist", "in_bounds", "smem_optin"):
        results = {order: selftest.run(name, order, seed=11) for order in ORDERS}
        assert all(ok for ok, _ in results.values()), (name, results)
        assert len({r for _, r in results.values()}) == 1, (name, results)


def test_selftest_missing_barrier_changes_the_result(selftest):
    """A barrier removed: warps read per-warp partials before they are written; the result depends
    on the thread order (forward and reverse disagree, and neither is the right sum)."""
    right = selftest.run("block_sum", "forward")[1]
    got = {order: selftest.run("block_sum_no_barrier", order, seed=3)[1] for order in ORDERS}
    assert len(set(got.values())) > 1 and right not in got.values(), got


@pytest.mark.parametrize("name,message", [
    ("barrier_in_warp0", r"divergent __syncthreads\(\).*threads 0-31 wait at .*selftest.cu:\d+"),
    ("shfl_exited", r"warp collective over an exited lane"),
    ("lane_not_in_mask", r"mask 0x00000001, which does not include itself"),
    ("barrier_vs_shuffle", r"deadlock: threads wait at __syncthreads\(\) while lanes of a warp collective"),
    ("divergent_shuffles", r"deadlock: a warp collective can never complete"),
    ("bad_block", r"invalid block \(2048,1,1\)"),
    ("smem_over_48k", r"65536 bytes of dynamic shared memory exceed the kernel's limit of 49152"),
    ("threadidx_on_host", r"threadIdx used outside a kernel"),
])
def test_selftest_broken_kernels_are_reported(selftest, name, message):
    import re
    for order in ORDERS:
        ok, msg = selftest.run(name, order, seed=5)
        assert not ok and re.search(message, msg, re.S), (order, msg)


def test_selftest_uninitialised_shared_memory_is_poisoned(selftest):
    got = {order: selftest.run("uninit_shared", order, seed=9) for order in ORDERS}
    assert len({r for _, r in got.values()}) > 1, got   # the poison byte differs per order


def test_out_of_bounds_read_is_caught_by_address_sanitizer():
    env = cudaemu.asan_env()
    if env is None:
        pytest.skip("no libasan for this compiler")
    lib = cudaemu.build_selftest(sanitize=True)
    code = "import sys, cudaemu; print(cudaemu.Selftest(cudaemu.Path(sys.argv[1])).run(sys.argv[2]))"
    run = [sys.executable, "-c", code, str(lib)]
    kw = dict(env=child_env(**env), cwd=CHILD_CWD, capture_output=True, text=True)
    fine = subprocess.run([*run, "in_bounds"], **kw)
    assert fine.returncode == 0 and "(True," in fine.stdout, fine.stderr[-3000:]
    bad = subprocess.run([*run, "oob_read"], **kw)
    assert bad.returncode != 0
    assert "heap-buffer-overflow" in bad.stderr and "oob_read_kernel" in bad.stderr, bad.stderr[-3000:]


def test_inexact_device_math_is_rejected(tmp_path):
    """expf and friends: the GPU's bits are not the CPU's, so the emulator refuses to run them."""
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) {\n  // expf(x) in a comment is fine\n"
                   "  x[threadIdx.x] = expf(x[threadIdx.x]);\n}\n")
    with pytest.raises(cudaemu.cu2cpp.Unsupported, match=r"k.cu:3: expf\(\) in CUDA code"):
        cudaemu.cu2cpp.convert(src)
    src.write_text("__global__ void k(float* x) { x[0] = __fdividef(x[1], 3.0f); }\n")
    with pytest.raises(cudaemu.cu2cpp.Unsupported, match=r"__fdividef"):
        cudaemu.cu2cpp.convert(src)
    src.write_text("__global__ void k(float* x) { x[0] = fmaf(x[1], 3.0f, sqrtf(x[2])) + exp2_det(x[3]); }\n")
    cudaemu.cu2cpp.convert(src)   # exact operations are fine


# A deliberately broken copy of tree_cuda.cu: each break is switched on at run time (so one
# build serves both, and with both off the copy must still agree with the CPU).
_TREE_BREAKS = {
    # 1: the barrier of the residual-mass reduction removed (a race between reduction levels)
    1: ("    if (static_cast<int>(threadIdx.x) < s) lanes[threadIdx.x] = lanes[threadIdx.x] + lanes[threadIdx.x + s];\n"
        "    __syncthreads();\n",
        "    if (static_cast<int>(threadIdx.x) < s) lanes[threadIdx.x] = lanes[threadIdx.x] + lanes[threadIdx.x + s];\n"
        "    if (::emu_break != 1) __syncthreads();\n"),
    # 2: an index off by one: the race reads one token past the end of the row
    2: ("      weight[i] = base + i < V ? w[base + i] : 0.0f;\n",
        "      weight[i] = base + i < V + (::emu_break == 2) ? w[base + i] : 0.0f;\n"),
}


@pytest.fixture(scope="module")
def broken_tree(emu):
    text = (cudaemu.CSRC / "cuda" / "tree_cuda.cu").read_text()
    for old, new in _TREE_BREAKS.values():
        assert text.count(old) == 1, f"tree_cuda.cu changed: update the patch {old!r}"
        text = text.replace(old, new)
    text = "inline int emu_break = 0;\nextern \"C\" void emu_set_break(int b) { emu_break = b; }\n" + text
    lib = cudaemu.load_variant("broken", "tree_cuda_broken", text)
    import ctypes
    setter = ctypes.CDLL(str(lib.path)).emu_set_break
    yield lib, setter
    setter(0)


def _tree_runs(lib, setter, brk):
    """Runs of the broken copy over every order: (total, differing from the CPU, stopped by the emulator, an error)."""
    setter(brk)
    total, differ, stopped, example = 0, 0, 0, ""
    try:
        for b, n, v in [(5, 6, 1001), (33, 16, 7), (5, 16, 7), (1, 6, 1003)]:
            for with_q in (True, False):
                case = tree_case(b, n, v, with_q, gen("tree-broken", b, n, v, with_q))
                want = ops.rejection_sample_tree(*case, method="rejection")
                for order in ORDERS:
                    lib.set_order(order, 1)
                    total += 1
                    try:
                        with lib.active():
                            got = ops.rejection_sample_tree(*case, method="rejection")
                    except RuntimeError as exc:
                        stopped += 1
                        example = example or str(exc).splitlines()[0]
                        continue
                    differ += not all(torch.equal(a, w) for a, w in zip(got, want))
    finally:
        setter(0)
    return total, differ, stopped, example


def test_broken_tree_kernel_copy_fails(broken_tree):
    lib, setter = broken_tree
    total, differ, stopped, _ = _tree_runs(lib, setter, 0)
    assert differ == 0 and stopped == 0, f"the unbroken copy fails in {differ + stopped}/{total} runs"
    for brk, what in ((1, "barrier removed"), (2, "index off by one")):
        total, differ, stopped, example = _tree_runs(lib, setter, brk)
        print(f"\nbroken tree_cuda.cu copy, {what}: {differ}/{total} runs differ from the CPU, {stopped}/{total} "
              f"stopped by the emulator{': ' + example if example else ''}")
        assert differ + stopped > 0, what


@pytest.mark.skipif(os.environ.get("SPECRT_EMU_ASAN", "0") in ("", "0"),
                    reason="set SPECRT_EMU_ASAN=1: every emulated kernel under AddressSanitizer (~3 min more)")
def test_kernels_under_address_sanitizer():
    """The kernel tests above (forward order) on the -fsanitize=address,alignment build, in a child
    process with libasan preloaded: any out-of-bounds or misaligned access fails it."""
    env = cudaemu.asan_env()
    if env is None:
        pytest.skip("no libasan for this compiler")
    cudaemu.build_kernels(sanitize=True)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(__file__),
                        "-k", "forward and not broken and not selftest"],
                       env=child_env(**env, SPECRT_EMU_SANITIZE="1", SPECRT_EMU_ASAN="0"), cwd=CHILD_CWD,
                       capture_output=True, text=True)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0 and "AddressSanitizer" not in tail and "runtime error" not in tail, tail
    print("\n" + [line for line in r.stdout.splitlines() if "passed" in line][-1])
