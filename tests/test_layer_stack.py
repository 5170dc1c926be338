"""The C++ layer stack (csrc/layer_stack.cpp, specrt/models/layer_stack.py): decode and verify steps
run every layer in one call with the same kernels as the Python fused loop, so logits and hidden
states are bit-identical; it stands aside where it does not apply; bad input names the argument."""
import pytest
import torch

KINDS = ["llama3", "qwen2", "mistral_sw"]  # rope scaling; q/k/v bias; sliding window
# (dtype, weight format, int8 activations)
MODES = [(torch.float32, None, False), (torch.bfloat16, None, False), (torch.float32, "q4_1", False),
         (torch.float32, "q4_1", True), (torch.bfloat16, "q8_0", True), (torch.float32, "int8", False)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from _model_utils import make_checkpoint

    out = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(kind)
        make_checkpoint(folder, kind, seed=11)
        out[kind] = folder
    return out


def load(folder, dtype, quant, a8, stack):
    from specrt.models import load_model

    model = load_model(folder, dtype=dtype, quantize=quant)
    model.set_int8_activations(a8)
    model.set_layer_stack(stack)
    return model.prepare()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def drive(model):
    """Prefill two requests, then mixed decode / verify steps; every step's (logits, hidden)."""
    from _model_utils import Runner

    r = Runner(model, num_blocks=96, block_size=4)
    outs = []
    for rid, prompt in (("a", list(range(3, 30))), ("b", list(range(40, 51)))):
        r.cache.allocate(rid, prompt)
        outs.append(r.step([(rid, prompt)], return_hidden=True))
    for toks_a, toks_b in (([5], [6]), ([7, 9, 11, 13, 2], [8]), ([4], [3, 12, 17]), ([19], [21])):
        assert r.cache.append_slots("a", len(toks_a)) and r.cache.append_slots("b", len(toks_b))
        outs.append(r.step([("a", toks_a), ("b", toks_b)], return_hidden=True))
    return outs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,quant,a8", MODES)
def test_stack_equals_python_loop_bit_for_bit(folders, kind, dtype, quant, a8):
    """Prefills (Python path) then batched decode / verify steps (the stack): logits and final hidden
    states equal the per-op Python loop's bit for bit, so greedy outputs and every exactness test
    built on the fused path are unchanged."""
    fast, slow = load(folders[kind], dtype, quant, a8, True), load(folders[kind], dtype, quant, a8, False)
    assert fast._stack is not None and len(fast._stack) == fast.config.num_layers and not slow.layer_stack
    for (la, ha), (lb, hb) in zip(drive(fast), drive(slow)):
        assert all(same_bits(x, y) for x, y in zip(la, lb))
        assert same_bits(ha, hb)


def test_stack_stands_aside(folders):
    """SDPA attention, attention in the model dtype, the op-by-op path, or more rows than the small-M
    kernel takes: no stack, or the Python loop for that step (same results as the loop)."""
    model = load(folders["llama3"], torch.bfloat16, None, False, True)
    assert model._stack is not None
    for toggle, undo in ((lambda: model.set_attention_backend("sdpa"), lambda: model.set_attention_backend("kernel")),
                         (lambda: model.set_attention_fp32(False), lambda: model.set_attention_fp32(True)),
                         (lambda: model.set_fused_ops(False), lambda: model.set_fused_ops(True))):
        toggle()
        assert model.prepare()._stack is None
        undo()
        assert model.prepare()._stack is not None
    model.set_linear_kernel(2)  # a 5-row verify step: the float projections leave the kernel
    ref = load(folders["llama3"], torch.bfloat16, None, False, False)
    ref.set_linear_kernel(2)
    for (la, ha), (lb, hb) in zip(drive(model), drive(ref)):
        assert all(same_bits(x, y) for x, y in zip(la, lb)) and same_bits(ha, hb)


def test_greedy_decoding_unchanged_on_the_builtin_pair():
    """The engine on the built-in pair: greedy tokens with the stack equal those without it."""
    import specrt

    params = specrt.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for stack in (True, False):
        llm = specrt.LLM(spec=specrt.SpecConfig(max_batch_size=2, max_model_len=256, max_draft_length=3))
        for model in (llm.engine.target, getattr(llm.engine.drafter, "model", None)):
            if model is not None and hasattr(model, "set_layer_stack"):
                model.set_layer_stack(stack)
        outs.append([o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10, 11]], params)])
    assert outs[0] == outs[1]


def test_bad_input_names_the_argument(folders):
    model = load(folders["llama3"], torch.float32, None, False, True)
    stack = model._stack
    x = torch.zeros(1, model.config.hidden_size)
    cos = sin = torch.zeros(1, model.config.head_dim)
    kv = torch.zeros(model.config.num_layers, 2, 4, 4, model.config.num_kv_heads, model.config.head_dim)
    args = (torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 1, 1)
    with pytest.raises(ValueError, match="n = 0"):
        stack.run(x, cos, sin, kv, *args, 0)
    with pytest.raises(ValueError, match="residual"):
        stack.run(x.bfloat16(), cos, sin, kv, *args, 1)
    with pytest.raises(ValueError, match="slot_mapping"):
        stack.run(x, cos, sin, kv, torch.tensor([99]), *args[1:], 1)
    with pytest.raises(ValueError, match="kv_cache"):
        stack.run(x, cos, sin, kv[:, :, :, :, :1], *args, 1)
    with pytest.raises(TypeError, match="dtype"):
        type(stack)(4, 2, 16, "float16")
