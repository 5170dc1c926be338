"""Int8 activations on quantized weights (ops.quant_linear_dynamic, csrc/cpu/linear_dynamic.h) and the
switch that turns them on for an engine's quantized target (``int8_activations``).

Properties proven here:
- the interleaved weight order is a permutation (the C++ op equals the torch reference, and inverts);
- batch invariance: every row of an M-row call (M = 1..16) is bit-identical to that row computed
  alone, for every quantized kind, odd block counts and super-block tails, 1 and 2 threads, and the
  AVX-512-VNNI, AVX2 and portable paths agree bit for bit with reference.quant_linear_dynamic (the
  order), int8 weights of -128 included;
- layers and models: interleaving in place changes no result, state dict or embedding row; switching
  int8 activations off restores the float-activation logits bit for bit;
- engine: greedy speculative output equals autoregressive output with a quantized, int8-activation
  target; bad values of the switch raise errors naming it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specrt import ops
from specrt.ops import reference
from specrt.models.linear import KernelPolicy, QuantLinear, quantize

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # the bench package; after site-packages

torch.set_num_threads(1)
KINDS = ("int8", "q8_0", "q4_0", "q4_1")
BUILTIN = Path(__file__).resolve().parent.parent / "specrt" / "builtin"
PROMPTS = ["The quick brown fox", "Once upon a time there was", "def fibonacci(n):", "1, 2, 3, 4,"]


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


def quant_args(n, k, kind, seed=0):
    q, s, m = quantize(rand(n, k, seed=seed, scale=0.1), kind)
    return q, s, m, rand(n, seed=seed + 1)


# ----------------------------------------------------------------------------- interleaved order
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [32, 96, 512, 544, 1056])  # 1, 3, 16, 17 (tail of 1), 33 blocks
def test_interleave_is_the_reference_permutation(kind, k):
    q, _, _, _ = quant_args(7, k, kind, seed=k)
    w = ops.interleave_quant_weight(q, kind)
    assert w.dtype == q.dtype and w.shape == q.shape and torch.equal(w, q) == (k == 32)  # one block: in place
    assert torch.equal(w, reference.interleave_quant_weight(q, kind))
    assert torch.equal(ops.interleave_quant_weight(w, kind, inverse=True), q)
    assert torch.equal(reference.interleave_quant_weight(w, kind, inverse=True), q)
    assert torch.equal(torch.sort(w.flatten())[0], torch.sort(q.flatten())[0])  # the same bytes
    if k >= 512:  # a full super-block: step t of block l sits at (t * 16 + l) * 4
        b = 16 if kind in ("q4_0", "q4_1") else 32
        words, out = q.view(torch.int32), w.view(torch.int32)
        for blk, step in ((0, 0), (5, 2), (15, b // 4 - 1)):
            assert torch.equal(out[:, step * 16 + blk], words[:, blk * (b // 4) + step])


def test_interleave_errors_and_opcheck():
    q, _, _, _ = quant_args(4, 96, "q4_1")
    torch.library.opcheck(torch.ops.specrt.interleave_quant_weight.default, (q, "q4_1", False))
    with pytest.raises(ValueError, match="kind must be one of"):
        ops.interleave_quant_weight(q, "q5_0")
    with pytest.raises(TypeError, match="qweight must have dtype uint8"):
        ops.interleave_quant_weight(q.view(torch.int8), "q4_1")
    with pytest.raises(ValueError, match="needs a multiple of 32"):
        ops.interleave_quant_weight(torch.zeros(3, 40, dtype=torch.int8), "int8")
    with pytest.raises(TypeError, match="qweight must be a torch.Tensor"):
        ops.interleave_quant_weight([1, 2], "int8")


# ----------------------------------------------------------------------------- the kernel's order
@pytest.mark.parametrize("kind", KINDS)
# block counts 3, 5, 17, 18, 22, 24, 28, 33: compact tails (linear_dynamic.h) of 3, 5 (alone), 1, 2, 6
# and 8 blocks; 896: a 12-block tail on full-width steps (both AVX2 halves)
@pytest.mark.parametrize("k", [96, 160, 544, 576, 704, 768, 896, 1056])
def test_rows_batch_invariant_every_isa_and_thread_count(kind, k):
    """Row i of an M-row call == row i alone, bit for bit, M = 1..16, 1 and 2 threads, the VNNI, AVX2
    and portable paths; and reference.quant_linear_dynamic (the documented order, in torch) gives the same bits."""
    n = 37  # not a multiple of the 4-row tiles
    q, s, mn, b = quant_args(n, k, kind, seed=k)
    if kind in ("int8", "q8_0"):  # -128 (never made by quantize, legal in a file): AVX2's |w| trick must hold
        q.view(torch.int8)[::3, ::7] = -128
    w = ops.interleave_quant_weight(q, kind)
    x = rand(16, k, seed=k + 7)
    x[4, :32] = 0  # a block of zeros (dx = 0)
    x[9, 33] = 3e4  # one large value: the rest of its block rounds to 0
    alone = torch.cat([ops.quant_linear_dynamic(x[i:i + 1], w, s, mn, b, kind, interleaved=True) for i in range(16)])
    assert same_bits(alone, reference.quant_linear_dynamic(x, q, s, mn, b, kind))
    prev_threads, prev_isa = torch.get_num_threads(), ops.set_linear_isa("")
    try:
        for isa in [i for i in ("", "avx2", "scalar") if i in ops.linear_isa_names() + [""]]:
            ops.set_linear_isa(isa)
            assert isa == "" or ops.linear_dynamic_isa() == isa
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for m in range(1, 17):
                    y = ops.quant_linear_dynamic(x[:m], w, s, mn, b, kind, interleaved=True)
                    assert same_bits(y, alone[:m]), (isa, threads, m)
    finally:
        torch.set_num_threads(prev_threads)
        ops.set_linear_isa(prev_isa)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_order_is_not_a_plain_float_sum(kind):
    """The bit-exact reference would be meaningless if any summation order gave these bits: a plain
    float32 sum of the same block terms differs, while float64 math agrees to rounding."""
    q, s, mn, b = quant_args(64, 1056, kind, seed=5)
    x = rand(8, 1056, seed=6)
    y = ops.quant_linear_dynamic(x, q, s, mn, b, kind)
    xq, dx = reference.quantize_activations(x)
    xd = (xq.double().reshape(8, -1, 32) * dx.double()[..., None]).reshape(8, -1)
    exact = xd @ reference.dequantize_weight(q, s, mn, kind).double().t() + b.double()
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    naive = (xd.float() @ reference.dequantize_weight(q, s, mn, kind).t()) + b
    assert not same_bits(y, naive)


def test_dynamic_wrapper_checks():
    q, s, mn, b = quant_args(6, 64, "q4_1")
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        ops.quant_linear_dynamic(rand(2, 64), q, s, mn, b, "q4_1", interleaved=1)
    with pytest.raises(ValueError, match="qweight must have shape"):
        ops.quant_linear_dynamic(rand(2, 64), q[:, :16], s, mn, b, "q4_1")


# ----------------------------------------------------------------------------- layers and models
@pytest.mark.parametrize("kind", KINDS)
def test_quant_linear_interleaved_in_place_changes_nothing_visible(kind):
    layer = QuantLinear.from_float(rand(40, 96, seed=1, scale=0.1), kind, bias=rand(40, seed=2))
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    deq, rows = layer.dequantize(), layer.rows(torch.tensor([[3, 0], [39, 3]]))
    x = rand(5, 96, seed=3)
    ref = ops.quant_linear_dynamic(x, layer.weight, layer.weight_scale, layer.weight_min, layer.bias, kind)
    exact = layer(x)
    ptr = layer.weight.data_ptr()
    layer.set_interleaved(True)
    assert layer.interleaved and layer.weight.data_ptr() == ptr and not torch.equal(layer.weight, sd["weight"])
    assert all(torch.equal(v, sd[k]) for k, v in layer.state_dict().items())
    assert torch.equal(layer.dequantize(), deq) and torch.equal(layer.rows(torch.tensor([[3, 0], [39, 3]])), rows)
    assert same_bits(layer(x), exact)  # no policy: the exact op, on the weight put back in order
    layer.policy = KernelPolicy(int8_activations=True)
    assert same_bits(layer(x), ref)
    layer.load_state_dict(sd)  # GGUF-order bytes land in the buffer: the layer knows
    assert not layer.interleaved and torch.equal(layer.weight, sd["weight"]) and same_bits(layer(x), ref)
    with pytest.raises(ValueError, match="interleaved weights need"):
        QuantLinear.from_float(rand(4, 40), "int8").set_interleaved(True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from _model_utils import make_checkpoint

    folders = {}
    for kind in ("llama", "qwen2"):  # untied + tied embeddings (the tied head is the embedding's source)
        folder = tmp_path_factory.mktemp(kind)
        make_checkpoint(folder, kind, seed=3, hidden_size=64, intermediate_size=96)
        folders[kind] = folder
    return folders


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_switch_interleaves_and_restores(tiny, arch):
    """set_int8_activations(True) interleaves every quantized weight in place (fused parts, tied head);
    False puts them back: float-activation logits bit for bit as before, int8 ones as the first time."""
    from _model_utils import Runner
    from specrt.models import load_model

    model = load_model(tiny[arch], quantize="q4_1")
    prompt = list(range(3, 30))
    base = Runner(model).prefill("a", prompt)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_int8_activations(True)
    a8 = Runner(model).prefill("b", prompt)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(m.interleaved for m in quant)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    assert not torch.equal(a8, base) and (a8 - base).abs().max() < 0.15 * base.abs().max()  # activation rounding
    model.set_int8_activations(False)
    assert same_bits(Runner(model).prefill("c", prompt), base) and not any(m.interleaved for m in quant)
    model.set_int8_activations(True)
    assert same_bits(Runner(model).prefill("d", prompt), a8)


# ----------------------------------------------------------------------------- engine switch
def _greedy(llm, prompts, n):
    from specrt import SamplingParams

    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n,
                                                                      ignore_eos=True))]


@pytest.mark.skipif(not (BUILTIN / "draft" / "config.json").is_file(), reason="built-in pair not present")
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_engine_int8_activations_speculative_equals_autoregressive(kind):
    """Greedy: a quantized int8-activation target gives the same tokens with a draft model (float, and
    quantized with int8 activations too), the n-gram drafter and self-drafting as autoregressive decoding."""
    import specrt

    opts = dict(target="builtin", seed=0, target_quantize=kind, int8_activations=True)
    ar = specrt.LLM(draft=None, **opts)
    assert ar.engine.target.linear_policy.int8_activations
    ref = _greedy(ar, PROMPTS, 24)
    assert all(m.interleaved for m in ar.engine.target.modules() if isinstance(m, QuantLinear))  # at prepare()
    spec = specrt.SpecConfig(max_draft_length=4)
    for draft, extra in (("builtin", {}), ("builtin", {"draft_quantize": "q4_1"}), ("ngram", {}), ("self:1", {})):
        llm = specrt.LLM(draft=draft, spec=spec, **opts, **extra)
        if extra:
            assert llm.engine.drafter.model.linear_policy.int8_activations
        assert _greedy(llm, PROMPTS, 24) == ref, (draft, extra)


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(draft=None, int8_activations=True), ValueError, "int8_activations=True needs a quantized target"),
    (dict(draft="builtin", draft_quantize="q4_1", int8_activations=True), ValueError,
     "int8_activations=True needs a quantized target"),
    (dict(draft=None, target_quantize="q4_1", int8_activations="yes"), TypeError, "int8_activations must be a bool"),
    (dict(draft=None, target_quantize="q4_1", int8_activations=True, device="cuda"), ValueError,
     "int8_activations=True is a CPU mode"),
    (dict(draft=None, target_quantize="q4_1-a8"), ValueError, "target_quantize must be None or one of"),
])
def test_engine_int8_activations_bad_input(kwargs, err, msg):
    import specrt

    with pytest.raises(err, match=msg):
        specrt.LLMEngine("builtin", **kwargs)


def test_serve_and_peers_flags():
    from bench.peers import parse_args
    from specrt.server.serve import build_parser, engine_kwargs

    args = build_parser().parse_args(["--target-model", "builtin", "--target-quantize", "q4_1",
                                      "--int8-activations"])
    kw = engine_kwargs(args)
    assert kw["int8_activations"] is True and kw["target_quantize"] == "q4_1"
    assert "int8_activations" not in engine_kwargs(build_parser().parse_args(["--target-model", "builtin"]))
    assert parse_args(["--target-quantize", "q4_1", "--int8-activations"]).int8_activations
    from specrt.cli.demo import build_parser as demo_parser
    assert demo_parser().parse_args(["--target-quantize", "q4_1", "--int8-activations"]).int8_activations
    with pytest.raises(SystemExit):
        parse_args(["--int8-activations"])


def test_serve_draft_quantize_flag_auto_none_and_kinds():
    """--draft-quantize: absent or auto leaves the engine's default (auto), none is a full-precision
    draft, a kind is passed as is."""
    from specrt.server.serve import build_parser, engine_kwargs

    base = ["--target-model", "builtin", "--speculative-decoding", "--draft-model", "builtin"]
    kw = lambda *extra: engine_kwargs(build_parser().parse_args(base + list(extra)))  # noqa: E731
    assert "draft_quantize" not in kw() and "draft_quantize" not in kw("--draft-quantize", "auto")
    assert kw("--draft-quantize", "none")["draft_quantize"] is None
    assert kw("--draft-quantize", "q8_0")["draft_quantize"] == "q8_0"
