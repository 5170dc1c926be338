"""GGUF files (llama.cpp's format) as specrt models: config, tensors, tokenizer, generation config.

Reads with the ``gguf`` package (llama.cpp's own reader and dequantizer); nothing is
downloaded and no repository code runs. A tensor comes either dequantized to float
(``GGUFModel.tensor``, the default loading path) or as its raw quantization blocks
(``GGUFModel.blocks``: Q8_0 / Q4_0 / Q4_1, for layers that compute on them directly).
llama.cpp stores Llama q/k projection rows interleaved for its RoPE kernel; both paths
undo that permutation, so every tensor comes back in Hugging Face layout and name.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specrt.models.gguf_tokenizer import build_tokenizer

GGUF_MAGIC = b"GGUF"
BLOCK_SIZE = 32                                  # values per block in Q8_0 / Q4_0 / Q4_1
BLOCK_KINDS = ("Q8_0", "Q4_0", "Q4_1")
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _gguf_package():
    try:
        import gguf
    except ImportError:
        raise ValueError("reading GGUF files needs the `gguf` package (llama.cpp's reader): "
                         "pip install gguf") from None
    return gguf


def is_gguf(path) -> bool:
    """True for an existing file that starts with the GGUF magic bytes."""
    try:
        p = Path(os.fspath(path))
    except TypeError:
        return False
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@dataclass(frozen=True)
class QuantBlocks:
    """One weight matrix [N, K] as llama.cpp's 32-value blocks, unpacked (no repacking needed).

    Q4_1: w = d * q + m;  Q4_0: w = d * (q - 8);  Q8_0: w = d * q  (per block, in float32).
    """
    kind: str                   # "Q8_0" | "Q4_0" | "Q4_1"
    d: torch.Tensor             # [N, K/32] float16 block scales
    m: torch.Tensor | None      # [N, K/32] float16 block minimums (Q4_1), else None
    q: torch.Tensor             # [N, K/32, 32] uint8 in 0..15 (Q4_0 / Q4_1) or int8 (Q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        n, nb, _ = self.q.shape
        return n, nb * BLOCK_SIZE

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] weights; float32 math in the same order as gguf's dequantizer (bit-identical)."""
        d = self.d.float()[..., None]                        # [N, K/32, 1]
        if self.kind == "Q4_1":
            w = d * self.q.float() + self.m.float()[..., None]
        elif self.kind == "Q4_0":
            w = d * (self.q.float() - 8.0)
        else:
            w = d * self.q.float()
        return w.reshape(self.shape).to(dtype)

    def permute_rows(self, index: torch.Tensor) -> "QuantBlocks":
        """The same blocks with output rows reordered (``index`` [N] int64)."""
        return QuantBlocks(self.kind, self.d[index], None if self.m is None else self.m[index], self.q[index])


def _unpack_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> QuantBlocks:
    """raw [N, K/32 * type_size] uint8 (ggml block structs, little-endian) -> QuantBlocks."""
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK_SIZE, -1)     # [N, K/32, type_size]
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0])        # [N, K/32]
    if kind == "Q8_0":                                       # {f16 d; i8 qs[32]}
        return QuantBlocks(kind, d, None, torch.from_numpy(b[..., 2:34].copy().view(np.int8)))
    if kind == "Q4_1":                                       # {f16 d; f16 m; u8 qs[16]}
        m, qs = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0]), b[..., 4:20]
    else:                                                    # Q4_0: {f16 d; u8 qs[16]}
        m, qs = None, b[..., 2:18]
    # byte j holds value j (low nibble) and value j + 16 (high nibble)
    return QuantBlocks(kind, d, m, torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1)))


def _rope_unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: it interleaves each head's two halves
    (HF rotates half-split pairs, llama.cpp adjacent pairs); [rows] int64."""
    idx = torch.arange(rows).view(n_head, rows // n_head // 2, 2)   # file row at (head, i, half)
    return idx.transpose(1, 2).reshape(rows)                         # HF row (head, half, i)


class _TensorSlice:
    """The part of safetensors' lazy-slice interface the tensor-parallel selector uses."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.t[idx]


class GGUFModel:
    """One parsed GGUF file: metadata, tensors by Hugging Face name, tokenizer, configs."""

    def __init__(self, path):
        gguf = _gguf_package()
        self.path = Path(os.fspath(path))
        if not is_gguf(self.path):
            raise ValueError(f"not a GGUF file (missing or no GGUF magic bytes): {self.path}")
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:  # noqa: BLE001 - the reader raises ValueError/struct.error/IndexError on corrupt files
            raise ValueError(f"corrupt or unreadable GGUF file {self.path}: {type(e).__name__}: {e}") from None
        self.arch = str(self.field("general.architecture", ""))
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"{self.path}: unsupported GGUF architecture {self.arch!r}; "
                             f"supported: {', '.join(_ARCHITECTURES)}")
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.hf_names = {self._hf_name(name): name for name in self._tensors}   # hf name -> gguf name

    # ------------------------------------------------------------------ metadata
    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalars as Python values, arrays as lists), or ``default``."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        if name == "rope_freqs.weight":
            raise ValueError(f"{self.path}: RoPE frequencies stored as a rope_freqs tensor (Llama 3 style "
                             "scaling) cannot be mapped back to a rope_scaling config; load the original "
                             "Hugging Face checkpoint instead")
        raise ValueError(f"{self.path}: GGUF tensor {name!r} has no counterpart in a {self.arch} model")

    def hf_config(self) -> dict:
        """The model's Hugging Face ``config.json`` (as a dict) from the GGUF metadata."""
        arch, model_type = _ARCHITECTURES[self.arch]
        need = {k: self._arch_field(k) for k in ("block_count", "embedding_length", "feed_forward_length",
                                                 "attention.head_count")}
        missing = [k for k, v in need.items() if v is None]
        if missing:
            raise ValueError(f"{self.path}: GGUF metadata lacks {[f'{self.arch}.{k}' for k in missing]}")
        if any(isinstance(v, list) for v in (*need.values(), self._arch_field("attention.head_count_kv"))):
            raise ValueError(f"{self.path}: per-layer head counts / ffn widths are not supported")
        hidden, n_head = int(need["embedding_length"]), int(need["attention.head_count"])
        head_dim = int(self._arch_field("attention.key_length", hidden // n_head))
        rope_dim = int(self._arch_field("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ValueError(f"{self.path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        embed = self._tensors.get("token_embd.weight")
        vocab = self._arch_field("vocab_size") or (len(tokens.data) if tokens is not None else None) \
            or (int(embed.shape[-1]) if embed is not None else None)
        cfg = {
            "architectures": [arch], "model_type": model_type, "vocab_size": int(vocab),
            "hidden_size": hidden, "intermediate_size": int(need["feed_forward_length"]),
            "num_hidden_layers": int(need["block_count"]), "num_attention_heads": n_head,
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv", n_head)),
            "head_dim": head_dim, "hidden_act": "silu",
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_field("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors, "mlp_bias": False,
            "torch_dtype": self._float_dtype(),
        }
        cfg["rope_scaling"] = self._rope_scaling()
        if model_type == "qwen2":
            cfg["use_sliding_window"] = False
        for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
            value = self.field(f"tokenizer.ggml.{name}_token_id")
            if value is not None:
                cfg[key] = int(value)
        return cfg

    def _rope_scaling(self) -> dict | None:
        kind = self._arch_field("rope.scaling.type", "none")
        factor = self._arch_field("rope.scaling.factor")
        if kind in ("none", None) or (kind == "linear" and factor in (None, 1.0)):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        raise ValueError(f"{self.path}: RoPE scaling type {kind!r} is not supported (only linear)")

    def _float_dtype(self) -> str:
        """The file's half type if its big tensors are F16/BF16; float32 otherwise (F32, quantized)."""
        kinds = {t.tensor_type.name for t in self._tensors.values() if len(t.shape) == 2}
        return _FLOAT_DTYPES[kinds.pop()] if len(kinds) == 1 and kinds <= {"F16", "BF16"} else "float32"

    def generation_config(self) -> dict:
        """bos / eos / pad ids; eos lists every end-of-generation token (eos, end-of-turn, end-of-message)."""
        out: dict = {}
        bos, pad = self.field("tokenizer.ggml.bos_token_id"), self.field("tokenizer.ggml.padding_token_id")
        if bos is not None:
            out["bos_token_id"] = int(bos)
        eos: list[int] = []
        for name in ("eos", "eot", "eom"):
            value = self.field(f"tokenizer.ggml.{name}_token_id")
            if value is not None and int(value) not in eos:
                eos.append(int(value))
        if eos:
            out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        if pad is not None:
            out["pad_token_id"] = int(pad)
        return out

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self.reader.fields

    def tokenizer(self):
        """(tokenizers.Tokenizer, tokenizer_config dict with the chat template and special tokens)."""
        return build_tokenizer(self)

    # ------------------------------------------------------------------ tensors
    def _entry(self, hf_name: str):
        if hf_name not in self.hf_names:
            raise ValueError(f"{self.path}: no tensor {hf_name!r} in this GGUF")
        t = self._tensors[self.hf_names[hf_name]]
        return t, tuple(int(s) for s in reversed(t.shape.tolist()))   # ggml lists dims fastest first

    def _rope_heads(self, hf_name: str) -> int | None:
        """Head count whose q/k rows llama.cpp permuted for this tensor (None: not permuted)."""
        if self.arch != "llama":
            return None
        cfg_heads = int(self._arch_field("attention.head_count"))
        if ".self_attn.q_proj." in hf_name:
            return cfg_heads
        if ".self_attn.k_proj." in hf_name:
            return int(self._arch_field("attention.head_count_kv", cfg_heads))
        return None

    def tensor_kind(self, hf_name: str) -> str:
        """ggml storage type of a tensor: "F32", "F16", "BF16", "Q8_0", "Q4_1", "Q6_K", ..."""
        return self._entry(hf_name)[0].tensor_type.name

    def tensor(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor in HF layout, dequantized by gguf's own dequantizer (float32), then cast."""
        gguf = _gguf_package()
        t, shape = self._entry(hf_name)
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{self.path}: {t.name} is stored as {t.tensor_type.name}, which the gguf "
                             f"package cannot dequantize") from None
        w = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape)
        heads = self._rope_heads(hf_name)
        if heads is not None:
            w = w[_rope_unpermute_index(shape[0], heads)]
        return w.to(dtype)

    def blocks(self, hf_name: str) -> QuantBlocks:
        """A Q8_0 / Q4_0 / Q4_1 matrix's raw blocks, rows in HF order; ValueError for other types."""
        t, shape = self._entry(hf_name)
        kind = t.tensor_type.name
        if kind not in BLOCK_KINDS or len(shape) != 2:
            raise ValueError(f"{self.path}: {hf_name} is a {kind} tensor of shape {shape}, "
                             f"not a {'/'.join(BLOCK_KINDS)} matrix")
        if self.reader.byte_order != "I":
            raise ValueError(f"{self.path}: big-endian GGUF blocks are not supported")
        b = _unpack_blocks(kind, t.data, *shape)
        heads = self._rope_heads(hf_name)
        return b if heads is None else b.permute_rows(_rope_unpermute_index(shape[0], heads))

    def state_dict(self, dtype: torch.dtype = torch.float32, keep_blocks: bool = False,
                   select=None) -> dict[str, Any]:
        """Every tensor by HF name, float ``dtype``; ``keep_blocks`` keeps Q8_0/Q4_0/Q4_1 matrices as
        QuantBlocks (the embedding stays float for its row lookup: a tied lm_head can take
        ``blocks("model.embed_tokens.weight")``). ``select(name, lazy_slice)`` (tensor parallelism)
        picks this rank's part of each float tensor."""
        if keep_blocks and select is not None:
            raise ValueError("keep_blocks and select (tensor-parallel shards) cannot be combined")
        out: dict[str, Any] = {}
        for name in self.hf_names:
            if keep_blocks and self.tensor_kind(name) in BLOCK_KINDS and name != "model.embed_tokens.weight":
                out[name] = self.blocks(name)
                continue
            w = self.tensor(name, dtype)
            out[name] = w if select is None else select(name, _TensorSlice(w)).contiguous()
        return out


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFModel:
    return GGUFModel(path)


def open_gguf(path) -> GGUFModel:
    """A parsed GGUF file, cached per (path, modification time, size): parsing the tokenizer
    arrays takes seconds, and loading a model reads config, weights and tokenizer from it."""
    p = Path(os.fspath(path)).resolve()
    if not p.is_file():
        raise ValueError(f"GGUF file not found: {p}")
    st = p.stat()
    return _open_cached(str(p), st.st_mtime_ns, st.st_size)


def convert_gguf(src, out_dir, dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Write a GGUF file as a Hugging Face folder that specrt and transformers both load:
    config.json, model.safetensors (``dtype``), tokenizer.json, tokenizer_config.json (with the
    chat template; both only if the file has a tokenizer), generation_config.json. Returns the folder."""
    import json

    from safetensors.torch import save_file

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    model = open_gguf(src)
    out = Path(os.fspath(out_dir))
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a folder")
    if (out / "config.json").exists() and not overwrite:
        raise ValueError(f"output folder {out} already holds a model (config.json); choose another or overwrite")
    config = model.hf_config()
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    tok, tok_config = model.tokenizer() if model.has_tokenizer else (None, None)
    state = model.state_dict(dtype)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt", "source": model.path.name})
    if tok is not None:
        tok.save(str(out / "tokenizer.json"))
    for name, data in (("config.json", config), ("tokenizer_config.json", tok_config),
                       ("generation_config.json", model.generation_config())):
        if data is not None:
            (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
