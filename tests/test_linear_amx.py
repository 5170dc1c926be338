"""The AMX order of bf16 x bf16 linears (csrc/cpu/linear_kernel.h, linear_amx.cpp): on a CPU with
usable AMX-BF16 every bf16 x bf16 projection with K even accumulates as tdpbf16ps does, whatever
the path (tiles, or the portable twin under a lowered ISA cap), the row count or the threads.

Properties proven here (on AMX machines; elsewhere the order does not apply and these skip):
- the tile path equals reference.linear_amx_order bit for bit, in its bf16 outputs and in every
  bit of its fp32 sums: K a multiple of 32 or not, N not a multiple of 16 or 64, 1-64 rows, with
  and without bias;
- the comparison has power: a near miss of the order (one chain, not two) differs from the tiles;
- every ISA cap gives the tile path's bits, and row i of M rows equals the 1-row result;
- odd K keeps the vdpbf16ps order on every path.
"""
from __future__ import annotations

import pytest
import torch

from specrt import ops
from specrt.ops import reference

torch.set_num_threads(1)
AMX = "amx" in ops.linear_isa_names()
pytestmark = pytest.mark.skipif(not AMX, reason="the AMX order applies only on CPUs with usable AMX-BF16")


def rand(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("n,k", [(49, 576), (64, 1536), (3, 30), (100, 96), (77, 70), (130, 2), (1031, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_equal_the_reference(n, k, bias):
    w, x = rand(n, k, seed=1), rand(64, k, seed=2)
    b = rand(n, seed=3, dtype=torch.float32) if bias else None
    want = reference.linear_amx_order(x, w, b)
    for m in (1, 2, 5, 16, 17, 40, 64):  # whole and partial blocks of 16 x rows
        assert torch.equal(bits(ops.linear(x[:m], w, b)), bits(want[:m])), (n, k, m)


def one_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A near miss of the AMX order: one fp32 chain per chunk instead of the even and odd ones (fp32 out)."""
    xf, wf = x.float(), w.float()
    s = torch.zeros(xf.shape[0], wf.shape[0])
    for k0 in range(0, xf.shape[1], 32):
        c = torch.zeros_like(s)
        for j in range(k0, min(xf.shape[1], k0 + 32)):
            c = c + xf[:, j, None] * wf[None, :, j]
        s = s + c
    return s


def residual(x: torch.Tensor, w: torch.Tensor, sums: torch.Tensor, m: int) -> torch.Tensor:
    """ops.linear with bias = -sums[i] for row i = m - 1 of x[:m]: that row is exactly zero where the
    kernel's fp32 sum equals `sums` bit for bit (Sterbenz), and nonzero where any bit differs,
    which a bf16 output alone would round away."""
    return ops.linear(x[:m], w, -sums[m - 1])[m - 1]


@pytest.mark.parametrize("n,k", [(1031, 576), (70, 100)])
def test_every_bit_of_the_fp32_sums(n, k):
    w, x = rand(n, k, seed=4), rand(17, k, seed=5)
    sums = reference.linear_amx_order(x, w, out_dtype=torch.float32)  # [17, N]
    for m in (1, 5, 16, 17):
        assert (residual(x, w, sums, m) == 0).all(), m
    miss = one_chain(x, w)
    assert not torch.equal(miss, sums)  # the near miss is a different order...
    assert (residual(x, w, miss, 16) != 0).any()  # ...and this comparison sees it


@pytest.mark.parametrize("k", [96, 100, 77])
def test_every_isa_cap_gives_the_same_bits(k):
    w, x, b = rand(70, k, seed=6), rand(19, k, seed=7), rand(70, seed=8, dtype=torch.float32)
    out = []
    try:
        for isa in ops.linear_isa_names():
            ops.set_linear_isa(isa)
            out.append((isa, ops.linear(x, w, b)))
    finally:
        ops.set_linear_isa("")
    for isa, y in out[1:]:
        assert torch.equal(bits(y), bits(out[0][1])), (k, isa)


def test_rows_and_threads_change_no_bit():
    w, x = rand(1031, 576, seed=9), rand(33, 576, seed=10)
    single = torch.cat([ops.linear(x[i:i + 1], w) for i in range(33)])
    before = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for m in (1, 4, 16, 17, 33):
                assert torch.equal(bits(ops.linear(x[:m], w)), bits(single[:m])), (t, m)
    finally:
        torch.set_num_threads(before)


def test_odd_k_keeps_the_vdpbf16ps_order():
    w, x = rand(40, 77, seed=11), rand(6, 77, seed=12)
    with pytest.raises(ValueError, match="even"):
        reference.linear_amx_order(x, w)
    y = ops.linear(x, w)
    try:
        ops.set_linear_isa("avx512bf16")
        assert torch.equal(bits(ops.linear(x, w)), bits(y))
    finally:
        ops.set_linear_isa("")
