"""A float GGUF of a quantized one (for llama.cpp at the same weights as specrt's float target):
every quantized / half tensor dequantized with llama.cpp's `gguf` package, layout and metadata kept."""
from __future__ import annotations

import os
import time
from pathlib import Path

GGUF_FLOATS = ("bf16", "f16", "f32")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specrt" / "peers"


def _float_type(kind: str):
    import gguf

    return {"bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
            "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
            "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32)}[kind]


def dequantize_gguf(src: str | Path, dst: str | Path, kind: str = "bf16") -> Path:
    """Write ``src`` with every quantized / half tensor dequantized to ``kind`` (bf16, f16, f32):
    same tensor names, order and llama.cpp layout (no permutation), F32 tensors copied as they are,
    every metadata field copied (general.file_type set to the new type)."""
    import gguf
    from gguf.quants import dequantize, quantize

    if kind not in GGUF_FLOATS:
        raise ValueError(f"kind must be one of {GGUF_FLOATS}, got {kind!r}")
    qtype, file_type = _float_type(kind)
    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(dst, reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = int(file_type) if f.name == gguf.Keys.General.FILE_TYPE else f.contents()
        writer.add_key_value(f.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, t.data)
            continue
        w = dequantize(t.data, t.tensor_type)        # float32, numpy order (rows, ne0)
        if kind == "bf16":
            writer.add_tensor(t.name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, w.astype("float16" if kind == "f16" else "float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def cached_float_gguf(src: str, kind: str, cache_dir: Path) -> Path:
    """The ``kind`` rewrite of ``src`` in ``cache_dir`` (written once, atomically)."""
    dst = cache_dir / f"{Path(src).stem}.{kind}.gguf"
    if not dst.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".tmp")
        t = time.perf_counter()
        dequantize_gguf(src, tmp, kind)
        tmp.replace(dst)
        print(f"wrote {dst} ({kind}) in {time.perf_counter() - t:.1f} s")
    return dst
