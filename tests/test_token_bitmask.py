"""The apply_token_bitmask op (issue 36: a grammar's mask as one fused op over all rows, CPU and CUDA).

- The CPU kernel against specrt.ops.reference bit for bit: every dtype, vocabularies that are and are
  not multiples of 32, words that are all ones, all zeros and mixed, a subset of rows, a bitmask
  wider than the vocabulary (a tokenizer with more ids than the logits).
- The rule itself, written independently: a token is refused iff its bit is 0, and allowed logits
  keep their bits (NaN payloads included).
- Bad input names the argument. The thread count changes nothing. CUDA against the CPU bit for bit
  on a GPU (the emulated CUDA kernel runs in tests/test_cuda_emulated.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specrt import ops
from specrt.ops import reference

from _cases import gen  # noqa: E402  (tests/ on sys.path)

CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()),
                          reason="needs a CUDA GPU and a CUDA build of specrt")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}


def bitmask_case(g: torch.Generator, R: int, V: int, n: int, extra_words: int = 0):
    """(logits [R, V] float32, bitmask [n, W] int32, rows [n]): words of every kind, distinct rows."""
    W = (V + 31) // 32 + extra_words
    words = torch.randint(-2 ** 31, 2 ** 31, (n, W), generator=g, dtype=torch.int64).to(torch.int32)
    kind = torch.randint(0, 4, (n, W), generator=g)
    words[kind == 0] = 0                         # a grammar state: most words refuse every token
    words[kind == 1] = -1
    words[kind == 2] = 1 << int(torch.randint(0, 31, (1,), generator=g))   # one allowed token
    rows = torch.randperm(R, generator=g)[:n]
    return torch.randn(R, V, generator=g) * 4, words, rows


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,R,n,extra", [(1, 1, 1, 0), (31, 3, 2, 0), (32, 4, 4, 0), (33, 5, 3, 1),
                                         (1000, 7, 5, 0), (49152, 6, 6, 2), (151936, 3, 2, 0)])
def test_matches_the_reference_bit_for_bit(dtype, V, R, n, extra):
    logits, words, rows = bitmask_case(gen("bitmask", V, n), R, V, n, extra)
    logits = logits.to(dtype)
    got, want = logits.clone(), logits.clone()
    ops.apply_token_bitmask(got, words, rows)
    reference.apply_token_bitmask(want, words, rows)
    assert same_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_refuses_exactly_the_zero_bits_and_keeps_the_rest(dtype):
    """Written from the word layout (numpy's little-endian bit unpacking), not from the header:
    refused tokens are -inf, other rows and allowed tokens keep their bits, NaN and inf included."""
    V, R = 200, 5
    rng = np.random.default_rng(3)
    words = rng.integers(-2 ** 31, 2 ** 31, size=(2, 8), dtype=np.int64).astype(np.int32)   # W = 8 > 7
    words[0, 1], words[1, 2] = 0, -1
    logits = torch.randn(R, V, dtype=torch.float64).to(dtype)
    logits[1, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], dtype=torch.float64).to(dtype)
    got = logits.clone()
    ops.apply_token_bitmask(got, words, [1, 3])
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    for i, r in enumerate([1, 3]):
        keep = torch.from_numpy(allowed[i])
        assert torch.isneginf(got[r, ~keep]).all()
        assert same_bits(got[r, keep], logits[r, keep])
    for r in (0, 2, 4):
        assert same_bits(got[r], logits[r])


def test_numpy_bitmask_default_rows_and_empty():
    logits, words, _ = bitmask_case(gen("bitmask-np"), 4, 70, 4)
    got, want = logits.clone(), logits.clone()
    ops.apply_token_bitmask(got, words.numpy(), None)
    reference.apply_token_bitmask(want, words, range(4))
    assert same_bits(got, want)
    before = logits.clone()
    ops.apply_token_bitmask(logits, np.zeros((0, 3), np.int32), [])
    assert same_bits(logits, before)


def test_thread_count_changes_nothing():
    logits, words, rows = bitmask_case(gen("bitmask-threads"), 64, 4096, 48)
    out = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = logits.clone()
            ops.apply_token_bitmask(x, words, rows)
            out.append(x)
    finally:
        torch.set_num_threads(old)
    assert same_bits(out[0], out[1])


@pytest.mark.parametrize("call,exc,match", [
    (lambda L, W: ops.apply_token_bitmask(L.int(), W, [0]), TypeError, "logits must be float32"),
    (lambda L, W: ops.apply_token_bitmask(L, W.long(), [0]), TypeError, "bitmask must be an int32"),
    (lambda L, W: ops.apply_token_bitmask(L, W[:, :1], [0]), ValueError, r"bitmask must have at least ceil\(V / 32\) = 2"),
    (lambda L, W: ops.apply_token_bitmask(L, W, [3]), ValueError, r"rows\[0\] = 3 must be in \[0, R=3\)"),
    (lambda L, W: ops.apply_token_bitmask(L, W, [-1]), ValueError, r"rows\[0\] = -1"),
    (lambda L, W: ops.apply_token_bitmask(L, W, [0, 1]), ValueError, "rows must have size 1"),
    (lambda L, W: ops.apply_token_bitmask(L, W, [0.5]), TypeError, "rows must be an integer tensor"),
    (lambda L, W: ops.apply_token_bitmask(L, W, None), ValueError, "bitmask must be"),
    (lambda L, W: ops.apply_token_bitmask(L[:, ::2], W, [0]), ValueError, "logits must be contiguous"),
    (lambda L, W: ops.apply_token_bitmask(None, W, [0]), (ValueError, TypeError), "logits"),
])
def test_bad_input_names_the_argument(call, exc, match):
    logits = torch.randn(3, 40)
    words = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(exc, match=match):
        call(logits, words)


def test_unchecked_rows_out_of_range_are_skipped():
    logits = torch.randn(3, 40)
    before = logits.clone()
    ops.apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), [7, -4], check_values=False)
    assert same_bits(logits, before)


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu_bit_for_bit(dtype):
    logits, words, rows = bitmask_case(gen("bitmask-cuda"), 9, 49152 + 7, 7, 1)
    logits = logits.to(dtype)
    want = logits.clone()
    ops.apply_token_bitmask(want, words, rows)
    got = logits.cuda()
    ops.apply_token_bitmask(got, words, rows)          # a host bitmask goes to the device
    assert same_bits(got.cpu(), want)


def test_the_benchmark_compares_the_same_masks():
    """bench.structured's op-vs-torch timing checks that both refuse the same tokens before timing."""
    from bench.structured import bitmask_op

    r = bitmask_op(V=1000, rows=3, repeats=2)
    assert r["rows"] == 3 and r["fused_us"] > 0 and r["torch_us"] > 0
