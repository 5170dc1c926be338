"""The small-M linear kernel (ops.linear / ops.quant_linear) and the layers built on it.

Properties proven here:
- batch invariance: row i of y for M rows equals, bit for bit, the M = 1 result of row i
  (any M, odd K and N), and the thread count and the ISA (AVX-512-BF16 / AVX-512 / AVX2 /
  scalar) change no bit;
- parity with torch's GEMM (float32 within float tolerance, bf16 within one rounding);
- quantized weights: quant_linear equals the float kernel on the dequantized weight bit for
  bit; quantize() and from_gguf() reproduce gguf-py (llama.cpp) bytes and values exactly;
- models: a quantized model's logits equal those of the float model holding the dequantized
  weights; bf16 greedy speculative output equals bf16 autoregressive output on the built-in pair.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specrt import ops
from specrt.ops import reference
from specrt.models.linear import QuantLinear, quantize

sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(1)
KINDS = ("int8", "q8_0", "q4_0", "q4_1")
FLOAT_CASES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16 if a.element_size() == 2
                                                                             else torch.int32),
                                                                      b.view(torch.int16 if b.element_size() == 2
                                                                             else torch.int32))


def quant_args(n, k, kind, seed=0, bias=False):
    q, s, m = quantize(rand(n, k, seed=seed, scale=0.1), kind)
    return q, s, m, (rand(n, seed=seed + 1) if bias else None)


# ----------------------------------------------------------------------------- batch invariance
@pytest.mark.parametrize("xdt,wdt", FLOAT_CASES)
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (37, 31), (5, 33), (20, 100), (9, 576)])
def test_float_rows_equal_single_row_results(xdt, wdt, n, k):
    w, b = rand(n, k, dtype=wdt, seed=1), rand(n, seed=2)
    x = rand(40, k, dtype=xdt, seed=3)
    single = torch.cat([ops.linear(x[i:i + 1], w, b) for i in range(40)])
    for m in list(range(1, 17)) + [23, 40]:
        assert same_bits(ops.linear(x[:m], w, b), single[:m]), (m, n, k)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert same_bits(ops.linear(x[perm], w, b), single[perm])  # neighbours do not matter


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_quant_rows_equal_single_row_results(kind, xdt):
    k = 96 if kind != "int8" else 45
    q, s, mn, b = quant_args(21, k, kind, bias=True)
    x = rand(19, k, dtype=xdt, seed=4)
    single = torch.cat([ops.quant_linear(x[i:i + 1], q, s, mn, b, kind) for i in range(19)])
    for m in range(1, 20):
        assert same_bits(ops.quant_linear(x[:m], q, s, mn, b, kind), single[:m]), (kind, m)


@pytest.mark.parametrize("xdt,wdt", FLOAT_CASES)
def test_thread_count_changes_no_bit(xdt, wdt):
    w, x = rand(1031, 200, dtype=wdt, seed=5), rand(7, 200, dtype=xdt, seed=6)
    q, s, mn, _ = quant_args(1031, 256, "q4_1")
    xq = rand(7, 256, dtype=xdt, seed=7)
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3, 4):
            torch.set_num_threads(t)
            outs.append((ops.linear(x, w), ops.quant_linear(xq, q, s, mn, None, "q4_1")))
    finally:
        torch.set_num_threads(before)
    for y, yq in outs[1:]:
        assert same_bits(y, outs[0][0]) and same_bits(yq, outs[0][1])


@pytest.mark.parametrize("xdt,wdt", FLOAT_CASES)
def test_every_isa_gives_identical_bits(xdt, wdt):
    names = ops.linear_isa_names()
    assert names[-1] == "scalar"
    w, b, x = rand(13, 77, dtype=wdt, seed=8), rand(13, seed=9), rand(6, 77, dtype=xdt, seed=10)
    qargs = {kind: quant_args(13, 64, kind, seed=11) for kind in KINDS}
    xq = rand(6, 64, dtype=xdt, seed=12)
    results = []
    try:
        for isa in names:
            assert ops.set_linear_isa(isa) in names
            results.append([ops.linear(x, w, b)] + [ops.quant_linear(xq, *qargs[k][:3], None, k) for k in KINDS])
    finally:
        ops.set_linear_isa("")
    for r in results[1:]:
        assert all(same_bits(a, c) for a, c in zip(r, results[0])), names


def test_set_linear_isa_refuses_unknown_names():
    with pytest.raises(ValueError, match="isa must be one of"):
        ops.set_linear_isa("sse9")


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("xdt,wdt", FLOAT_CASES)
@pytest.mark.parametrize("m,n,k", [(1, 49, 576), (5, 64, 1536), (16, 3, 31), (130, 17, 64)])
def test_parity_with_torch(xdt, wdt, m, n, k):
    w, b, x = rand(n, k, dtype=wdt, seed=13), rand(n, seed=14), rand(m, k, dtype=xdt, seed=15)
    y = ops.linear(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())  # [M, N]
    assert y.dtype == xdt and y.shape == (m, n)
    bound = 1e-6 * k ** 0.5 * 4 * (x.double().abs() @ w.double().abs().T + 1)
    if xdt == torch.bfloat16:  # plus one bf16 rounding of the output
        bound = bound + exact.abs() * 2 ** -8
    assert ((y.double() - exact).abs() <= bound).all()
    assert (y.double() - reference.linear(x, w, b).double()).abs().max() <= bound.max()


@pytest.mark.parametrize("kind", KINDS)
def test_quant_equals_float_kernel_on_dequantized_weight(kind):
    for k in ((64, 128, 576) if kind != "int8" else (5, 64, 100)):
        q, s, mn, b = quant_args(33, k, kind, seed=k, bias=True)
        w = reference.dequantize_weight(q, s, mn, kind)
        for xdt in (torch.float32, torch.bfloat16):
            x = rand(9, k, dtype=xdt, seed=16)
            got = ops.quant_linear(x, q, s, mn, b, kind)
            assert same_bits(got, ops.linear(x.float(), w, b).to(xdt)), (kind, k, xdt)
            ref = reference.quant_linear(x, q, s, mn, b, kind)
            assert (got.float() - ref.float()).abs().max() <= 1e-4 * (1 + ref.float().abs().max())


def test_torch_int8pack_baseline_agrees():
    q, s, _, _ = quant_args(40, 96, "int8")
    x = rand(5, 96, seed=17)
    ours = ops.quant_linear(x, q, s, None, None, "int8")
    torch_int8 = torch._weight_int8pack_mm(x, q, s)
    assert (ours - torch_int8).abs().max() < 1e-4


def test_empty_rows():
    w = rand(4, 8)
    assert ops.linear(torch.zeros(0, 8), w).shape == (0, 4)
    assert ops.linear(torch.zeros(2, 3, 8), w).shape == (2, 3, 4)


def test_opcheck():
    for args in [(rand(3, 40), rand(7, 40), rand(7)), (rand(2, 33, dtype=torch.bfloat16),
                                                       rand(5, 33, dtype=torch.bfloat16), None)]:
        torch.library.opcheck(torch.ops.specrt.linear.default, args)
    for kind in KINDS:
        q, s, mn, b = quant_args(6, 64, kind, bias=True)
        torch.library.opcheck(torch.ops.specrt.quant_linear.default, (rand(3, 64), q, s, mn, b, kind))


# ----------------------------------------------------------------------------- formats
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


@pytest.mark.parametrize("kind", list(GGUF_TYPES))
def test_quantize_and_dequantize_match_gguf_py(kind):
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[kind])
    w = rand(24, 160, seed=18, scale=0.05)
    w[3, :32] = 0.0  # an all-zero group (d = 0)
    w[5, 40] = 3.0  # an outlier
    raw = gguf.quants.quantize(w.numpy(), qtype)  # [24, 5 * block bytes] uint8
    layer = QuantLinear.from_gguf(kind, torch.from_numpy(raw), (24, 160))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(24, 160)
    assert torch.equal(layer.dequantize(), expected)  # llama.cpp's dequantized values, exactly
    ours = QuantLinear.from_float(w, kind)
    assert torch.equal(ours.weight, layer.weight) and torch.equal(ours.weight_scale, layer.weight_scale)
    if kind == "q4_1":
        assert torch.equal(ours.weight_min, layer.weight_min)


def test_from_blocks_packed_and_unpacked_agree():
    g = torch.Generator().manual_seed(19)
    q = torch.randint(0, 16, (6, 3, 32), generator=g, dtype=torch.uint8)
    d, m = rand(6, 3, seed=20).half(), rand(6, 3, seed=21).half()
    packed = q[..., :16] | (q[..., 16:] << 4)
    a = QuantLinear.from_blocks("q4_1", d, m, q)
    b = QuantLinear.from_blocks("q4_1", d, m, packed)
    assert torch.equal(a.weight, b.weight)
    w = a.dequantize().reshape(6, 3, 32)
    assert torch.equal(w, (d.float()[..., None] * q.float()) + m.float()[..., None])
    a0 = QuantLinear.from_blocks("q4_0", d, None, q)
    assert torch.equal(a0.dequantize().reshape(6, 3, 32), (q.float() - 8) * d.float()[..., None])
    q8 = torch.randint(-128, 128, (6, 3, 32), generator=g).to(torch.int8)
    assert torch.equal(QuantLinear.from_blocks("q8_0", d, None, q8).dequantize().reshape(6, 3, 32),
                       q8.float() * d.float()[..., None])


def test_quantize_error_bounds():
    w = rand(16, 256, seed=22)
    # half a step; q4_0 clips the side opposite its largest magnitude at 7/8 of it (1/8 error)
    for kind, tol in (("int8", 1 / 254), ("q8_0", 1 / 254), ("q4_0", 1 / 8), ("q4_1", 1 / 15)):
        deq = reference.dequantize_weight(*quantize(w, kind), kind)
        per = w.abs().amax(1, keepdim=True) if kind == "int8" else \
            w.reshape(16, 8, 32).abs().amax(-1, keepdim=True).repeat_interleave(32, 1).reshape(16, 256)
        assert ((deq - w).abs() <= per * tol * 1.01 + 1e-3 * per).all(), kind


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call,err,msg", [
    (lambda: ops.linear(rand(2, 8), rand(4, 9)), ValueError, "weight must have shape"),
    (lambda: ops.linear(rand(2, 8).half(), rand(4, 8)), TypeError, "x must be float32 or bfloat16"),
    (lambda: ops.linear(rand(2, 8), rand(4, 8).half()), TypeError, "weight must be float32 or bfloat16"),
    (lambda: ops.linear(rand(2, 8), rand(4, 8), rand(5)), ValueError, "bias must have shape"),
    (lambda: ops.linear([1.0], rand(4, 8)), TypeError, "x must be a torch.Tensor"),
    (lambda: ops.linear(rand(2, 8), rand(8, 4).T), ValueError, "weight must be contiguous"),
    (lambda: ops.quant_linear(rand(2, 64), *quant_args(4, 64, "q8_0")[:3], None, "q5_k"), ValueError,
     "kind must be one of"),
    (lambda: ops.quant_linear(rand(2, 40), *quant_args(4, 40, "int8")[:2], None, None, "q8_0"), ValueError,
     "needs a multiple of 32"),
    (lambda: ops.quant_linear(rand(2, 64), quant_args(4, 64, "q8_0")[0], rand(4, 2), None, None, "q8_0"),
     TypeError, "scales must have dtype"),
    (lambda: ops.quant_linear(rand(2, 64), *quant_args(4, 64, "q4_0")[:2], None, None, "q4_1"), ValueError,
     "mins must be given"),
    (lambda: ops.quant_linear(rand(2, 64), *quant_args(4, 64, "q8_0")[:2], None, None, "q4_0"), TypeError,
     "qweight must have dtype"),
    (lambda: QuantLinear.from_blocks("q4_1", rand(2, 1).half(), None, torch.zeros(2, 1, 32, dtype=torch.uint8)),
     ValueError, "m must be given"),
    (lambda: QuantLinear.from_blocks("q4_0", rand(2, 1).half(), None, torch.full((2, 1, 32), 16, dtype=torch.uint8)),
     ValueError, "values above 15"),
    (lambda: QuantLinear.from_blocks("q8_0", rand(2, 1) / 3, None, torch.zeros(2, 1, 32, dtype=torch.int8)),
     ValueError, "float16 values exactly"),
    (lambda: QuantLinear.from_gguf("q8_0", torch.zeros(33, dtype=torch.uint8), (1, 32)), ValueError,
     "raw must be uint8"),
    (lambda: quantize(rand(4, 40), "q4_0"), ValueError, "divisible by 32"),
])
def test_bad_input_names_the_argument(call, err, msg):
    with pytest.raises(err, match=msg):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_torch_path():
    x, w = rand(3, 64).cuda(), rand(5, 64).cuda()
    torch.testing.assert_close(ops.linear(x, w).cpu(), ops.linear(x.cpu(), w.cpu()), rtol=1e-4, atol=1e-4)
    q, s, m, _ = quant_args(5, 64, "q4_1")
    got = ops.quant_linear(x, q.cuda(), s.cuda(), m.cuda(), None, "q4_1").cpu()
    torch.testing.assert_close(got, ops.quant_linear(x.cpu(), q, s, m, None, "q4_1"), rtol=1e-4, atol=1e-4)


def test_hugepage_copy_keeps_values():
    from specrt.models.linear import hugepage_copy

    for t in (rand(1024, 1024, dtype=torch.bfloat16), rand(3, 5), torch.arange(3 << 20, dtype=torch.int8)):
        h = hugepage_copy(t)
        assert h.dtype == t.dtype and h.shape == t.shape and h.is_contiguous() and torch.equal(h, t)


# ----------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from _model_utils import make_checkpoint

    folders = {}
    for kind, tie in (("llama", False), ("qwen2", True)):  # untied + tied embeddings; qwen2 has q/k/v bias
        folder = tmp_path_factory.mktemp(kind)
        make_checkpoint(folder, kind, seed=3, hidden_size=64, intermediate_size=96)
        folders[kind] = folder
    return folders


def _dequantized_float_model(folder, qmodel, dtype):
    """The float model whose every quantized matrix is replaced by its dequantized values."""
    from specrt.models import load_model

    fmodel = load_model(folder, dtype=dtype)
    with torch.no_grad():
        for name, mod in qmodel.named_modules():
            if isinstance(mod, QuantLinear) and not name.endswith("embed_tokens.quant"):
                fmodel.get_submodule(name).weight.copy_(mod.dequantize())
        emb = qmodel.model.embed_tokens
        if hasattr(emb, "quant"):  # untied: its own quantized matrix
            fmodel.model.embed_tokens.weight.copy_(emb.quant.dequantize())
    return fmodel


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_model_equals_dequantized_float_model(tiny, kind, arch):
    from _model_utils import Runner
    from specrt.models import load_model

    qmodel = load_model(tiny[arch], quantize=kind)
    assert sum(isinstance(m, QuantLinear) for m in qmodel.modules()) == 3 * 7 + 1 + (arch == "llama")
    fmodel = _dequantized_float_model(tiny[arch], qmodel, torch.float32)
    prompt = list(range(3, 40))
    rq, rf = Runner(qmodel), Runner(fmodel)
    assert same_bits(rq.prefill("a", prompt), rf.prefill("a", prompt))  # both on the kernel: bit for bit
    for t in (5, 9, 11):
        assert same_bits(rq.decode("a", [t]), rf.decode("a", [t]))
    fmodel.set_linear_kernel(0)  # the float model on torch's GEMM: float tolerance
    got = Runner(fmodel).prefill("b", prompt)
    assert (got - Runner(qmodel).prefill("b", prompt)).abs().max() < 1e-4


def test_quantized_model_memory_and_bf16_activations(tiny):
    from _model_utils import Runner
    from specrt.models import load_model

    def nbytes(m):
        return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))

    f32 = load_model(tiny["qwen2"])
    sizes = {kind: nbytes(load_model(tiny["qwen2"], quantize=kind)) for kind in KINDS}
    norms = sum(p.numel() * 4 for n, p in f32.named_parameters() if "norm" in n or "bias" in n)
    matrices = nbytes(f32) - norms
    assert sizes["int8"] - norms < 0.27 * matrices and sizes["q8_0"] - norms < 0.29 * matrices
    assert sizes["q4_0"] - norms < 0.16 * matrices and sizes["q4_1"] - norms < 0.17 * matrices
    qb = load_model(tiny["qwen2"], dtype=torch.bfloat16, quantize="q8_0")
    assert qb.dtype == torch.bfloat16
    logits = Runner(qb).prefill("a", list(range(3, 20)))
    ref = Runner(load_model(tiny["qwen2"], quantize="q8_0")).prefill("a", list(range(3, 20)))
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()


def test_load_model_quantize_argument_errors(tiny):
    from specrt.models import load_model

    with pytest.raises(ValueError, match="quantize must be one of"):
        load_model(tiny["llama"], quantize="q3_k")
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        load_model(tiny["llama"], quantize="int8", tp=(0, 2, None))


def test_set_linear_kernel_validates(tiny):
    from specrt.models import load_model

    with pytest.raises(ValueError, match="max_rows"):
        load_model(tiny["llama"]).set_linear_kernel(-1)


@pytest.mark.parametrize("dtype,quant", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "q4_1"),
                                         (torch.bfloat16, "int8")])
def test_verify_logits_equal_decode_logits_bit_for_bit(tiny, dtype, quant):
    """A K+1-row verify forward gives, row for row, the very logits of one-token decodes (and a
    batch of several requests the logits of each alone): every projection (the small-M kernel)
    and the decode/verify attention (ops.paged_attention) is batch-invariant."""
    from _model_utils import Runner
    from specrt.models import load_model

    model = load_model(tiny["qwen2"], dtype=dtype, quantize=quant)
    prompt, drafts = list(range(3, 30)), [7, 19, 4, 100, 55, 8]
    r1, r2 = Runner(model), Runner(model)
    r1.prefill("v", prompt)
    verify = r1.decode("v", drafts)  # [6, V]
    r2.prefill("s", prompt)
    r2.prefill("other", list(range(50, 61)))
    singles = []
    for t in drafts:  # each decode batched with another request's decode
        assert r2.cache.append_slots("s", 1) and r2.cache.append_slots("other", 1)
        singles.append(r2.step([("s", [t]), ("other", [t + 1])])[0][0])
    assert same_bits(verify, torch.stack(singles))


BUILTIN = Path(__file__).resolve().parent.parent / "specrt" / "builtin"
PROMPTS = ["The quick brown fox", "Once upon a time there was", "In the beginning", "Hello, my name is",
           "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "She opened the door and"]


def _greedy(llm, prompts, n):
    from specrt import SamplingParams

    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n,
                                                                      ignore_eos=True))]


@pytest.mark.skipif(not (BUILTIN / "draft" / "config.json").is_file(), reason="built-in pair not present")
def test_bf16_greedy_speculative_equals_autoregressive():
    """With every decode / verify projection and the LM head on the batch-invariant linear kernel
    and attention on the batch-invariant paged-attention kernel, bf16 speculative decoding emits
    exactly the autoregressive tokens, whatever K."""
    import specrt

    ar = specrt.LLM(target="builtin", draft=None, dtype=torch.bfloat16, seed=0)
    spec = {k: specrt.LLM(target="builtin", draft="builtin", dtype=torch.bfloat16, seed=0,
                          spec=specrt.SpecConfig(max_draft_length=k)) for k in (1, 4, 7)}
    expected = _greedy(ar, PROMPTS, 48)
    assert _greedy(spec[4], PROMPTS, 48) == expected  # 8 requests x 5 verify rows

    expected = _greedy(ar, PROMPTS[:4], 48)
    for k in (1, 7):
        assert _greedy(spec[k], PROMPTS[:4], 48) == expected, k
        assert _greedy(spec[k], PROMPTS[:1], 48) == expected[:1], k


def _unpacked_logits(model, prompt):
    """Logits of a model whose prepared projections keep their own tensors (packing switched off)."""
    from unittest import mock

    from _model_utils import Runner

    with mock.patch("specrt.models.llama.pack_projections", lambda *a: False):
        return Runner(model).prefill("a", prompt)


@pytest.mark.parametrize("quant", [None, "q4_1", "int8"])
def test_prepare_packs_weights_in_forward_order(tiny, quant):
    """prepare() moves every projection's weights into one arena in the order a forward reads them:
    values, state_dict names, ties and logits unchanged; no second copy stays referenced; preparing
    again moves nothing."""
    from _model_utils import Runner
    from specrt.models import load_model

    model = load_model(tiny["qwen2"], quantize=quant)  # tied embeddings, q/k/v bias
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _unpacked_logits(load_model(tiny["qwen2"], quantize=quant), list(range(3, 30)))
    model.prepare()
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    streams = []
    for layer in model.model.layers:
        for fn in (layer.self_attn._qkv, layer.self_attn._o, layer.mlp._gate_up, layer.mlp._down):
            streams += [fn.weight] if quant is None else [t for t in (fn.__self__.weight_scale, fn.__self__.weight_min,
                                                                     fn.__self__.weight) if t is not None]
    head = model._lm_head
    streams += [head.weight] if quant is None else [t for t in (head.__self__.weight_scale, head.__self__.weight_min,
                                                               head.__self__.weight) if t is not None]
    for a, b in zip(streams, streams[1:]):  # back to back, 64-byte aligned
        gap = b.data_ptr() - a.data_ptr() - a.numel() * a.element_size()
        assert 0 <= gap < 64
    arena = streams[0].untyped_storage().data_ptr()
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert all(p.untyped_storage().data_ptr() == arena for p in parts)  # the originals view the arena
    if quant is None:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.lm_head.weight.data_ptr() == head.weight.data_ptr()
    else:
        assert model.model.embed_tokens.source is model.lm_head
    ptrs = [t.data_ptr() for t in streams]
    model.prepare()
    assert [fn.data_ptr() for fn in streams] == ptrs
    assert same_bits(Runner(model).prefill("a", list(range(3, 30))), ref)


# ----------------------------------------------------------------------------- engine options
def _param_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.skipif(not (BUILTIN / "draft" / "config.json").is_file(), reason="built-in pair not present")
def test_engine_quantized_models_stay_quantized_and_exact():
    """draft_quantize / draft_dtype / target_quantize: the draft's projections stay QuantLinear (its memory
    shrinks accordingly) and greedy speculative output equals autoregressive output of the same target."""
    import specrt

    ar = specrt.LLM(target="builtin", draft=None, seed=0)
    float_draft = specrt.LLM(target="builtin", draft="builtin", seed=0, draft_quantize=None).engine.drafter.model
    for kind, ddt in (("int8", None), ("q4_1", "bfloat16")):
        llm = specrt.LLM(target="builtin", draft="builtin", seed=0, draft_quantize=kind, draft_dtype=ddt,
                         spec=specrt.SpecConfig(max_draft_length=3))
        draft = llm.engine.drafter.model
        assert all(isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.kind == kind
                   for layer in draft.model.layers)
        assert draft.dtype == (torch.bfloat16 if ddt else torch.float32)
        assert _param_bytes(draft) < (0.3 if kind == "int8" else 0.2) * _param_bytes(float_draft)
        assert llm.engine.target.dtype == torch.float32 and not isinstance(llm.engine.target.lm_head, QuantLinear)
        assert _greedy(llm, PROMPTS[:3], 24) == _greedy(ar, PROMPTS[:3], 24), kind
    q_ar = specrt.LLM(target="builtin", draft=None, seed=0, target_quantize="q8_0")
    q_spec = specrt.LLM(target="builtin", draft="builtin", seed=0, target_quantize="q8_0", draft_quantize="q8_0")
    assert isinstance(q_spec.engine.target.lm_head, QuantLinear)
    assert _greedy(q_spec, PROMPTS[:3], 24) == _greedy(q_ar, PROMPTS[:3], 24)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(draft="ngram", draft_quantize="int8"), "apply to a draft model"),
    (dict(draft=None, draft_dtype="bfloat16"), "apply to a draft model"),
    (dict(draft="builtin", draft_quantize="q3_k"), "draft_quantize must be None or one of"),
    (dict(draft=None, target_quantize="fp8"), "target_quantize must be None or one of"),
    (dict(draft="builtin", draft_dtype="float64"), "draft_dtype: dtype 'float64' is not supported"),
])
def test_engine_quantize_options_validate(kwargs, msg):
    import specrt

    with pytest.raises(ValueError, match=msg):
        specrt.LLMEngine("builtin", **kwargs)


def test_serve_and_demo_flags():
    from specrt.server.serve import build_parser, engine_kwargs

    args = build_parser().parse_args(["--target-model", "builtin", "--speculative-decoding", "--draft-model",
                                      "builtin", "--draft-quantize", "q4_1", "--target-quantize", "int8",
                                      "--draft-dtype", "bfloat16"])
    kw = engine_kwargs(args)
    assert (kw["draft_quantize"], kw["target_quantize"], kw["draft_dtype"]) == ("q4_1", "int8", "bfloat16")
    plain = engine_kwargs(build_parser().parse_args(["--target-model", "builtin"]))
    assert not {"draft_quantize", "target_quantize", "draft_dtype"} & set(plain)
    with pytest.raises(ValueError, match="need a draft model"):
        engine_kwargs(build_parser().parse_args(["--target-model", "builtin", "--draft-quantize", "int8"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--target-model", "builtin", "--draft-quantize", "q3"])


# ----------------------------------------------------------------------------- int8 activations (opt-in)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_int8_activations_isa_rows_and_reference(kind, xdt):
    """quant_linear_dynamic: every path (VNNI, AVX2, portable) agrees bit for bit, rows are batch-invariant, the
    result is reference.quant_linear_dynamic's bit for bit and near the float64 math of the quantized
    activations; its distance from the float activations (quant_linear) is the activation rounding only."""
    for n, k in ((37, 96), (64, 576), (5, 32)):  # 96: an odd number of blocks
        q, s, mn, b = quant_args(n, k, kind, seed=n, bias=True)
        x = rand(9, k, dtype=xdt, seed=k)
        x[2, :32] = 0  # a block of zeros (dx = 0)
        x[3, 5] = 1e30  # one huge value: the rest of its block rounds to 0
        y = ops.quant_linear_dynamic(x, q, s, mn, b, kind)
        for isa in [i for i in ("avx2", "scalar") if i in ops.linear_isa_names()]:
            prev = ops.set_linear_isa(isa)
            try:
                assert ops.linear_dynamic_isa() == isa
                other = ops.quant_linear_dynamic(x, q, s, mn, b, kind)
            finally:
                ops.set_linear_isa(prev)
            assert same_bits(y, other), isa
        assert same_bits(y, torch.cat([ops.quant_linear_dynamic(x[i:i + 1], q, s, mn, b, kind) for i in range(9)]))
        assert same_bits(y, reference.quant_linear_dynamic(x, q, s, mn, b, kind))
        keep = [0, 1, 2, 4, 5, 6, 7, 8]  # row 3's huge value would dwarf every tolerance
        xq, dx = reference.quantize_activations(x.float())
        xd = (xq.double().reshape(9, -1, 32) * dx.double()[..., None]).reshape(9, -1)
        ref = (xd @ reference.dequantize_weight(q, s, mn, kind).double().t() + b.double())[keep]
        scale = ref.abs().max()
        tol = 1e-5 if xdt == torch.float32 else 1e-2
        assert (y[keep].float() - ref).abs().max() <= tol * scale
        exact = ops.quant_linear(x, q, s, mn, b, kind)[keep].float()
        assert (y[keep].float() - exact).abs().max() < 0.02 * scale


def test_int8_activations_opcheck_and_errors():
    q, s, mn, b = quant_args(6, 64, "q4_1", bias=True)
    torch.library.opcheck(torch.ops.specrt.quant_linear_dynamic.default,
                          (rand(3, 64), ops.interleave_quant_weight(q, "q4_1"), s, mn, b, "q4_1"))
    qi, si, _, _ = quant_args(6, 40, "int8")
    with pytest.raises(ValueError, match="int8 activations need a multiple of 32"):
        ops.quant_linear_dynamic(rand(2, 40), qi, si, None, None, "int8")
    with pytest.raises(ValueError, match="mins must be given"):
        ops.quant_linear_dynamic(rand(2, 64), q, s, None, None, "q4_1")


@pytest.mark.parametrize("kind", ["q4_1", "int8"])
def test_int8_activations_model_verify_equals_decode(tiny, kind):
    """With int8 activations switched on a quantized model still gives verify rows equal to single
    decodes bit for bit, and logits near the float-activation model's."""
    from _model_utils import Runner
    from specrt.models import load_model

    model = load_model(tiny["qwen2"], quantize=kind)
    base = Runner(model).prefill("b", list(range(3, 30)))
    model.set_int8_activations(True)
    r1, r2 = Runner(model), Runner(model)
    a8 = r1.prefill("v", list(range(3, 30)))
    assert not torch.equal(a8, base) and (a8 - base).abs().max() < 0.05 * base.abs().max()
    drafts = [7, 19, 4, 100]
    verify = r1.decode("v", drafts)
    r2.prefill("s", list(range(3, 30)))
    singles = [r2.decode("s", [t])[0] for t in drafts]
    assert same_bits(verify, torch.stack(singles))


def _path_logits(llm, prompt: list[int], n: int) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Greedy tokens for ``prompt`` and, per position p, the target's logits of the row at p whose
    context is the final sequence (rows after a rejected draft are off the path and left out)."""
    from specrt import SamplingParams

    target, forwards = llm.engine.target, []

    def recording(input_ids, positions, meta, kv_cache, logits_indices=None, **kw):
        logits, hidden = type(target).forward(target, input_ids, positions, meta, kv_cache,
                                              logits_indices=logits_indices, **kw)
        rows = range(len(positions)) if logits_indices is None else logits_indices.tolist()
        forwards.append((input_ids.tolist(), positions.tolist(), list(rows), logits.clone()))
        return logits, hidden

    target.forward = recording
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids
    finally:
        del target.forward
    seq, path = prompt + list(out), {}
    for ids, pos, rows, logits in forwards:
        for j, i in enumerate(rows):
            if all(ids[r] == seq[pos[r]] for r in range(i + 1)):
                path[pos[i]] = logits[j]
    return list(out), path


@pytest.mark.skipif(not (BUILTIN / "target" / "config.json").is_file(), reason="built-in model not present")
def test_bf16_speculative_prefill_rows_equal_autoregressive_bit_for_bit():
    """The forward that scores a prompt has the same rows with and without a drafter, so the prompt's
    KV and every later logit are bit-identical: drafts fed along with the prompt would change its
    rows (before every CPU row took the same kernels, prefill attention over a cached prefix and GEMMs
    above 128 rows were not row-invariant).
    Cases: a prompt whose first block is shared with an earlier one (its 30 other tokens attend over
    the cached block with masked SDPA, whose rows depend on the key count: SmolLM2 diverged so), and a
    fresh 126-token prompt (129+ rows leave the linear kernel: the case that fails here without the fix)."""
    import specrt

    ar = specrt.LLM(target="builtin", draft=None, dtype=torch.bfloat16, seed=0,
                    spec=specrt.SpecConfig(max_batch_size=1))
    ng = specrt.LLM(target="builtin", draft="ngram", dtype=torch.bfloat16, seed=0,
                    spec=specrt.SpecConfig(max_batch_size=1, max_draft_length=4))
    loop = [11, 57, 302, 9, 1024, 77]  # repeats: the n-gram drafter proposes from the prompt itself
    first = list(range(100, 140))
    shared = first[:16] + (loop * 5)[:30]
    fresh = list(range(200, 230)) + (loop * 16)[:96]
    for prompt in (first, shared, fresh):
        expected, ar_rows = _path_logits(ar, prompt, 12)
        tokens, ng_rows = _path_logits(ng, prompt, 12)
        assert tokens == expected, len(prompt)
        assert ng_rows.keys() <= ar_rows.keys() and len(ng_rows) == len(ar_rows)
        for p, row in ng_rows.items():
            assert torch.equal(row, ar_rows[p]), (len(prompt), p)


def test_draft_quantize_auto_picks_q8_0_with_int8_activations_only_where_vnni_runs(monkeypatch):
    """The default draft_quantize="auto": Q8_0 + int8 activations for a draft model on a CPU whose int8
    kernel has VNNI, full precision elsewhere and for drafters without a model; None and a kind as given."""
    from specrt import ops
    from specrt.models import sources
    from specrt.drafters.spec import parse_draft

    def resolve(quantize, draft, device):   # what the engine asks: the draft string parsed once
        return sources.resolve_draft_quantize(quantize, parse_draft(draft).loads_model, device)

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(ops, "linear_dynamic_isa", lambda: "avx512vnni")
    assert resolve("auto", "some/folder", cpu) == ("q8_0", True)
    assert resolve("auto", "some/folder", gpu) == (None, False)
    assert resolve("auto", "some/folder+suffix", cpu) == ("q8_0", True)
    for d in (None, "none", "ngram", "ngram:3", "self:2", "suffix", "suffix:scoped=1"):
        assert resolve("auto", d, cpu) == (None, False), d
    assert resolve(None, "some/folder", cpu) == (None, False)
    assert resolve("q4_1", "some/folder", cpu) == ("q4_1", False)
    with pytest.raises(ValueError, match="draft_quantize"):
        resolve("q3", "some/folder", cpu)
    for isa in ("avx2", "scalar"):
        monkeypatch.setattr(ops, "linear_dynamic_isa", lambda isa=isa: isa)
        assert resolve("auto", "some/folder", cpu) == (None, False)


@pytest.mark.skipif(not (BUILTIN / "draft" / "config.json").is_file(), reason="built-in pair not present")
def test_the_default_draft_is_what_auto_resolves_to_and_stays_exact():
    import specrt
    from specrt import ops

    llm = specrt.LLM(target="builtin", draft="builtin", seed=0, spec=specrt.SpecConfig(max_draft_length=3))
    draft = llm.engine.drafter.model
    quantized = any(isinstance(m, QuantLinear) for m in draft.modules())
    assert quantized == (ops.linear_dynamic_isa() == "avx512vnni")
    assert draft.linear_policy.int8_activations == quantized
    assert all(m.kind == "q8_0" for m in draft.modules() if isinstance(m, QuantLinear))
    ar = specrt.LLM(target="builtin", draft=None, seed=0)
    assert _greedy(llm, PROMPTS[:3], 24) == _greedy(ar, PROMPTS[:3], 24)
    # a loader that hands out an already quantized model: used as it is, not quantized twice
    from specrt.models.sources import default_loader
    from specrt.models.quant import quantize_model_

    def shared(path, role, dtype, device):
        m = default_loader(path, role, dtype, device)
        return quantize_model_(m, "int8") if role == "draft" else m
    pre = specrt.LLM(target="builtin", draft="builtin", seed=0, model_loader=shared)
    assert all(m.kind == "int8" for m in pre.engine.drafter.model.modules() if isinstance(m, QuantLinear))
