"""bench/peers.py's pure parts: the GGUF dequantize-rewrite (on a tiny GGUF written here) and the
argument parsing. The benchmark itself is run by hand (bench/README.md), never timed in tests."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
sys.path.append(str(Path(__file__).resolve().parent.parent))  # the bench package; after site-packages
from bench import gguf_float, peers  # noqa: E402

from gguf.quants import dequantize, quantize  # noqa: E402

Q = gguf.GGMLQuantizationType


def _tiny_gguf(path) -> dict[str, np.ndarray]:
    """A 2-tensor-type llama-like GGUF (Q4_1 and Q8_0 matrices, an F32 norm) with varied metadata;
    returns each tensor's dequantized float32 values."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_array("tokenizer.ggml.tokens", ["<a>", "b", "c"])
    w.add_array("tokenizer.ggml.token_type", [3, 1, 1])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    values = {}
    for name, qt, shape in (("blk.0.ffn_up.weight", Q.Q4_1, (8, 64)), ("token_embd.weight", Q.Q8_0, (3, 64))):
        raw = quantize(rng.standard_normal(shape).astype(np.float32), qt)
        w.add_tensor(name, raw, raw_dtype=qt)
        values[name] = dequantize(raw, qt)
    norm = rng.standard_normal(64).astype(np.float32)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    values["blk.0.attn_norm.weight"] = norm
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def _fields(reader) -> dict:
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}


@pytest.mark.parametrize("kind,qtype,file_type,rtol", [
    ("f16", Q.F16, gguf.LlamaFileType.MOSTLY_F16, 2.0 ** -11),
    ("bf16", Q.BF16, gguf.LlamaFileType.MOSTLY_BF16, 2.0 ** -8),
    ("f32", Q.F32, gguf.LlamaFileType.ALL_F32, 0.0)])
def test_dequantize_rewrite_keeps_values_layout_and_metadata(tmp_path, kind, qtype, file_type, rtol):
    src, dst = tmp_path / "q.gguf", tmp_path / f"{kind}.gguf"
    values = _tiny_gguf(src)
    gguf_float.dequantize_gguf(src, dst, kind)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    fa, fb = _fields(a), _fields(b)
    assert fb.pop("general.file_type") == int(file_type)
    fa.pop("general.file_type")
    assert fa == fb                                           # every other field copied as it was
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    ne = {t.name: list(t.shape) for t in a.tensors}
    for t in b.tensors:
        want = values[t.name]
        got = dequantize(t.data, t.tensor_type)
        assert t.tensor_type == (Q.F32 if want.ndim == 1 else qtype)
        assert got.shape == want.shape and list(t.shape) == ne[t.name]  # llama.cpp's layout: no permutation
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0)


def test_dequantize_rewrite_refuses_an_unknown_kind(tmp_path):
    _tiny_gguf(tmp_path / "q.gguf")
    with pytest.raises(ValueError, match="kind"):
        gguf_float.dequantize_gguf(tmp_path / "q.gguf", tmp_path / "x.gguf", "q8")


def test_cached_float_gguf_writes_once(tmp_path):
    _tiny_gguf(tmp_path / "q.gguf")
    first = gguf_float.cached_float_gguf(str(tmp_path / "q.gguf"), "f16", tmp_path / "cache")
    stamp = first.stat().st_mtime_ns
    again = gguf_float.cached_float_gguf(str(tmp_path / "q.gguf"), "f16", tmp_path / "cache")
    assert again == first and again.stat().st_mtime_ns == stamp
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_parse_args_defaults_quick_and_errors():
    a = peers.parse_args([])
    assert (a.prompts, a.new_tokens, a.repeats, a.threads, a.dtype) == (8, 128, 5, 1, "bfloat16")
    assert a.gguf_float == ["bf16"] and a.clock == "cpu" and a.draft == []
    q = peers.parse_args(["--quick", "--draft", "ngram:2:3", "--draft", "smollm2-135m-draft",
                          "--dtype", "float32", "--threads", "2", "--target-quantize", "q4_1"])
    assert (q.prompts, q.new_tokens, q.repeats) == (2, 32, 2)
    assert q.draft == ["ngram:2:3", "smollm2-135m-draft"] and q.gguf_float == ["f32"] and q.clock == "wall"
    assert q.target_quantize == "q4_1" and q.k == [None] and not q.quantized_only
    k = peers.parse_args(["--k", "1,3", "--target-quantize", "q4_1", "--quantized-only", "--gguf-float", "none"])
    assert k.k == [1, 3] and k.quantized_only and k.gguf_float == []
    for bad in (["--gguf-float", "q8"], ["--families", "vllm"], ["--families", "llama.cpp"],
                ["--new-tokens", "0"], ["--k", "0"], ["--k", "1,x"], ["--quantized-only"], ["--dtype", "float16"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_identity_says_where_outputs_differ():
    assert peers.identity([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == "yes"
    assert peers.identity([[1, 2], [3, 5]], [[1, 2], [3, 4]]) == "no (1/2 prompts; first diff at token 1)"


def test_builtin_prompts_render_with_a_chat_template():
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "<u>" + messages[0]["content"] + "<a>"

        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [len(text)]
    ids = peers.chat_prompts(Tok(), 10, from_training=False)
    assert len(ids) == 10 and ids[0] == [len(peers.CHAT_PROMPTS[0]) + 6] and ids[8] == ids[0]
    assert len(set(peers.CHAT_PROMPTS)) == len(peers.CHAT_PROMPTS) >= 8
