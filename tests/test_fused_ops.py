"""The fused decoder kernels (ops.rms_norm (+ residual), ops.silu_mul, ops.rotary_write_kv) and the
model's fused CPU path built on them.

Properties proven here:
- RoPE + KV store equals the op-by-op reference (transformers' roundings) bit for bit, fp32 and bf16;
- RMSNorm and SwiGLU match the reference within an ulp of the reduction order / exp (bf16: within one
  bf16 rounding), and silu's exp is accurate to a few ulp against float64;
- batch invariance: each row equals its single-row result bit for bit; thread count and ISA
  (scalar / AVX2 / AVX-512) change no bit;
- the model's fused path gives the logits of its op-by-op path (float tolerance) and keeps the
  greedy tokens; torch.library opcheck; bad input names the argument.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specrt import ops
from specrt.ops import reference

sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(1)
DTYPES = (torch.float32, torch.bfloat16)
ISAS = [isa for isa in ("scalar", "avx2", "avx512")]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    iv = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(iv), b.contiguous().view(iv))


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place (same-sign finite values)."""
    iv = torch.int16 if a.element_size() == 2 else torch.int32
    return int((a.contiguous().view(iv).long() - b.contiguous().view(iv).long()).abs().max())


def rope_case(T, H, Hkv, D, dtype, seed=0):
    qkv = rand(T, (H + 2 * Hkv) * D, dtype=dtype, seed=seed)
    pos = torch.arange(T) * 7 + 3
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = pos[:, None].float() * inv
    e = torch.cat((f, f), -1)
    nb = max(8, T)
    cache = torch.zeros(2, 2, nb, 4, Hkv, D, dtype=dtype)
    slots = torch.randperm(4 * nb, generator=torch.Generator().manual_seed(seed))[:T]
    return qkv, e.cos().to(dtype), e.sin().to(dtype), cache, slots


@pytest.fixture
def isa():
    """Run a body under each ISA this CPU supports; restore the default after."""
    supported = []
    prev = torch.ops.specrt.cpu_isa()
    for name in ISAS:
        try:
            torch.ops.specrt.set_cpu_isa(name)
            supported.append(name)
        except (ValueError, RuntimeError):
            pass
    torch.ops.specrt.set_cpu_isa(prev)
    yield supported
    torch.ops.specrt.set_cpu_isa("auto")


# ----------------------------------------------------------------------------- against the reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 9, 3, 64), (5, 4, 4, 64), (3, 2, 1, 40), (7, 3, 1, 8), (2, 1, 1, 2)])
def test_rotary_write_kv_equals_reference_bit_for_bit(dtype, T, H, Hkv, D):
    qkv, cos, sin, cache, slots = rope_case(T, H, Hkv, D, dtype)
    slots[0] = -1  # padding row: not stored
    for q_dtype in (None, torch.float32):
        a_qkv, b_qkv, a_cache, b_cache = qkv.clone(), qkv.clone(), cache.clone(), cache.clone()
        qa = ops.rotary_write_kv(a_qkv, cos, sin, H, Hkv, a_cache, 1, slots, q_dtype)
        qb = reference.rotary_write_kv(b_qkv, cos, sin, H, Hkv, b_cache, 1, slots, q_dtype)
        assert qa.shape == (T, H, D) and qa.dtype == (q_dtype or dtype) and qa.is_contiguous()
        assert same_bits(qa, qb) and same_bits(a_qkv, b_qkv) and same_bits(a_cache, b_cache)
        assert torch.equal(a_qkv[:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:])  # v untouched
        assert not a_cache[0].any()  # other layers untouched


def test_rotary_write_kv_cache_dtype_conversion_and_repeated_slots():
    H, Hkv, D = 2, 1, 16
    qkv, cos, sin, _, _ = rope_case(3, H, Hkv, D, torch.float32)
    cache = torch.zeros(1, 2, 2, 4, Hkv, D, dtype=torch.bfloat16)
    slots = torch.tensor([5, 5, 2])  # a repeated slot keeps the last row
    ops.rotary_write_kv(qkv, cos, sin, H, Hkv, cache, 0, slots)
    k = qkv[:, H * D:(H + Hkv) * D].view(3, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(3, Hkv, D)
    assert same_bits(cache[0, 0, 1, 1], k[1].to(torch.bfloat16)) and same_bits(cache[0, 1, 1, 1], v[1].to(torch.bfloat16))
    assert same_bits(cache[0, 0, 0, 2], k[2].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [1, 15, 16, 64, 576, 1000])
def test_rms_norm_matches_reference(dtype, H):
    x, w = rand(6, H, dtype=dtype, seed=1), (rand(H, seed=2) * 0.1 + 1).to(dtype)
    res = rand(6, H, dtype=dtype, seed=3)
    for residual in (None, res):
        r_ours = None if residual is None else residual.clone()
        r_ref = None if residual is None else residual.clone()
        got = ops.rms_norm(x, w, 1e-5, residual=r_ours)
        want = reference.rms_norm(x, w, 1e-5, residual=r_ref)
        assert got.dtype == dtype and got.shape == (6, H)
        if residual is not None:
            assert same_bits(r_ours, r_ref)  # the residual add rounds as torch's add does
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)
        else:  # the fp32 statistics may differ by an ulp: at most one bf16 rounding apart
            assert ulps(got, want) <= 1 and (got == want).float().mean() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    x = torch.cat([rand(4, 40, seed=4, scale=6.0), torch.linspace(-120, 120, 160).view(4, 40)], 1).to(dtype)
    got, want = ops.silu_mul(x), reference.silu_mul(x)
    assert got.shape == (4, 40) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-37)
    else:
        assert ulps(got, want) <= 1


def test_silu_exp_is_accurate():
    g = torch.cat([torch.linspace(-87, 87, 100_001), torch.tensor([-1e-30, 0.0, 1e-30, 1e-3, -1e-3])])
    x = torch.cat([g[:, None], torch.ones(g.shape[0], 1)], 1)
    got = ops.silu_mul(x)[:, 0].double()
    gd = g.double()
    exact = gd / (1 + torch.exp(-gd))
    rel = ((got - exact).abs() / exact.abs().clamp(min=1e-300))
    assert rel.max() < 4 * 2.0 ** -23
    big = ops.silu_mul(torch.tensor([[-200.0, 200.0, float("nan"), 1.0, 1.0, 1.0]]))[0]
    assert big[0] == 0 and big[1] == 200.0 and torch.isnan(big[2])


# ----------------------------------------------------------------------------- invariance
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_equal_single_row_results(dtype):
    x, w, res = rand(33, 100, dtype=dtype, seed=5), rand(100, dtype=dtype, seed=6), rand(33, 100, dtype=dtype, seed=7)
    one = torch.cat([ops.rms_norm(x[i:i + 1], w, 1e-6) for i in range(33)])
    assert same_bits(ops.rms_norm(x, w, 1e-6), one)
    g = rand(33, 2 * 77, dtype=dtype, seed=8)
    assert same_bits(ops.silu_mul(g), torch.cat([ops.silu_mul(g[i:i + 1]) for i in range(33)]))
    r1, r2 = res.clone(), res.clone()
    out = ops.rms_norm(x, w, 1e-6, residual=r1)
    rows = torch.cat([ops.rms_norm(x[i:i + 1], w, 1e-6, residual=r2[i:i + 1]) for i in range(33)])
    assert same_bits(out, rows) and same_bits(r1, r2)


def _all_ops(dtype):
    x, w, res = rand(900, 130, dtype=dtype, seed=9), rand(130, dtype=dtype, seed=10), rand(900, 130, dtype=dtype)
    r = res.clone()
    qkv, cos, sin, cache, slots = rope_case(300, 3, 1, 24, dtype, seed=11)  # > 1 task per op
    q = ops.rotary_write_kv(qkv, cos, sin, 3, 1, cache, 0, slots, torch.float32)
    return [ops.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5, residual=r), r, ops.silu_mul(x[:, :128] * 9), q, qkv,
            cache]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_and_thread_count_gives_identical_bits(dtype, isa):
    base = None
    for name in isa:
        torch.ops.specrt.set_cpu_isa(name)
        for threads in (1, 3):
            torch.set_num_threads(threads)
            try:
                outs = _all_ops(dtype)
            finally:
                torch.set_num_threads(1)
            if base is None:
                base = outs
            assert all(same_bits(a, b) for a, b in zip(outs, base)), (name, threads)
    assert len(isa) >= 1


def test_opcheck():
    for dtype in DTYPES:
        x, w = rand(3, 40, dtype=dtype), rand(40, dtype=dtype, seed=1)
        torch.library.opcheck(torch.ops.specrt.rms_norm.default, (x, w, 1e-5))
        torch.library.opcheck(torch.ops.specrt.add_rms_norm_.default, (rand(3, 40, dtype=dtype, seed=2), x, w, 1e-5))
        torch.library.opcheck(torch.ops.specrt.silu_mul.default, (rand(3, 64, dtype=dtype),))
        qkv, cos, sin, cache, slots = rope_case(3, 2, 1, 16, dtype)
        torch.library.opcheck(torch.ops.specrt.rotary_write_kv.default,
                              (qkv, cos, sin, 2, 1, cache, 1, slots, torch.float32))


@pytest.mark.parametrize("call,err,msg", [
    (lambda: ops.rms_norm(rand(2, 8), rand(9), 1e-5), ValueError, "weight must have shape"),
    (lambda: ops.rms_norm(rand(2, 8).half(), rand(8).half(), 1e-5), TypeError, "x must be float32 or bfloat16"),
    (lambda: ops.rms_norm(rand(2, 8), rand(8, dtype=torch.bfloat16), 1e-5), TypeError, "weight must have the dtype"),
    (lambda: ops.rms_norm(rand(2, 8), rand(8), 1e-5, residual=rand(3, 8)), ValueError, "x must have the shape"),
    (lambda: ops.rms_norm(rand(2, 8, 2), rand(2), 1e-5), ValueError, "x must be 2-D"),
    (lambda: ops.silu_mul(rand(2, 7)), ValueError, "odd width"),
    (lambda: ops.silu_mul(rand(4, 6).t()), ValueError, "unit stride"),
    (lambda: ops.rotary_write_kv(rand(2, 60), rand(2, 16), rand(2, 16), 2, 1, torch.zeros(1, 2, 2, 4, 1, 16), 0,
                                 torch.tensor([0, 1])), ValueError, "qkv must be"),
    (lambda: ops.rotary_write_kv(rand(2, 64), rand(2, 16), rand(2, 16), 2, 1, torch.zeros(1, 2, 2, 4, 1, 16), 1,
                                 torch.tensor([0, 1])), ValueError, "layer = 1 is out of range"),
    (lambda: ops.rotary_write_kv(rand(2, 64), rand(2, 16), rand(2, 16), 2, 1, torch.zeros(1, 2, 2, 4, 1, 16), 0,
                                 torch.tensor([0, 8])), ValueError, r"slot_mapping\[1\] = 8 is out of range"),
    (lambda: ops.rotary_write_kv(rand(2, 64), rand(2, 16), rand(2, 16), 2, 1, torch.zeros(1, 2, 2, 4, 1, 8), 0,
                                 torch.tensor([0, 1])), ValueError, "kv_cache must be a contiguous"),
    (lambda: ops.rotary_write_kv(rand(2, 64), rand(2, 16), rand(2, 16), 2, 1, torch.zeros(1, 2, 2, 4, 1, 16), 0,
                                 torch.tensor([0, 1]), torch.bfloat16), TypeError, "q_dtype"),
    (lambda: ops.rotary_write_kv(rand(2, 64), rand(2, 15), rand(2, 15), 2, 1, torch.zeros(1, 2, 2, 4, 1, 15), 0,
                                 torch.tensor([0, 1])), ValueError, "even head_dim"),
])
def test_bad_input_names_the_argument(call, err, msg):
    with pytest.raises(err, match=msg):
        call()


# ----------------------------------------------------------------------------- the model's fused path
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from _model_utils import make_checkpoint

    folders = {}
    for kind in ("llama3", "qwen2", "mistral_sw"):  # rope scaling; q/k/v bias; sliding window
        folder = tmp_path_factory.mktemp(kind)
        make_checkpoint(folder, kind, seed=5)
        folders[kind] = folder
    return folders


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral_sw"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_path_equals_op_by_op_path(tiny, kind, dtype):
    """Prefill, a verify chunk and single-token decodes: the fused path's logits equal the op-by-op
    torch path's within float tolerance (bf16: a bf16 ulp of the norm statistics at most), and its
    greedy tokens are the same."""
    from _model_utils import Runner
    from specrt.models import load_model

    fused, plain = load_model(tiny[kind], dtype=dtype), load_model(tiny[kind], dtype=dtype)
    plain.set_fused_ops(False)
    prompt = list(range(3, 40))
    rf, rp = Runner(fused), Runner(plain)
    a, b = rf.prefill("a", prompt), rp.prefill("a", prompt)
    assert fused._fused and not plain._fused
    tol = 1e-4 if dtype == torch.float32 else 0.06 * b.abs().max().item()
    assert (a - b).abs().max() < tol
    for toks in ([5, 9, 11], [7], [8]):
        a, b = rf.decode("a", toks), rp.decode("a", toks)
        assert (a - b).abs().max() < tol
        if dtype == torch.float32:
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_fused_path_greedy_matches_transformers(tiny):
    """fp32 greedy decoding on the fused path is token-identical to transformers' generate."""
    pytest.importorskip("transformers")
    from _model_utils import Runner
    from transformers import AutoModelForCausalLM
    from specrt.models import load_model

    model = load_model(tiny["llama3"])
    assert model.prepare()._fused
    hf = AutoModelForCausalLM.from_pretrained(tiny["llama3"]).eval()
    prompt = list(range(5, 17))
    ours = Runner(model).greedy(prompt, 24)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert ours == ref
