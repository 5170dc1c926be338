"""Linear layers of the decoder: float projections on specrt's linear kernel, and weight-only
quantized layers (int8, Q8_0, Q4_0, Q4_1) that stay quantized at run time.

Float weights (``nn.Linear``) are called through :func:`prepare_linear`, which runs
``specrt.ops.linear`` (the batch-invariant CPU kernel: one pass over the weights for a block
of rows, the same reduction order for any row count) when x has at most ``KernelPolicy.max_rows``
rows (default: any), and torch's GEMM otherwise and on GPUs.

:class:`QuantLinear` keeps its weight quantized and runs ``specrt.ops.quant_linear``
(dequantized in registers, fp32 accumulation) for any row count on the CPU; on other
devices it dequantizes per call. Its result equals, bit for bit, the float kernel on the
dequantized weight, and the dequantized values are exactly llama.cpp's, so a GGUF tensor
loads without changing a number::

    QuantLinear.from_blocks("q4_1", d, m, q)      # d, m [N, K/32] fp16; q [N, K/32, 32] 0..15
    QuantLinear.from_gguf("q8_0", raw, (N, K))    # raw GGUF block bytes of one tensor
    QuantLinear.from_float(w, "q4_0")             # quantize a float weight (gguf-py's rounding)

State-dict names: ``weight`` (int8 [N, K], or uint8 [N, K/2] packed nibbles for q4_*),
``weight_scale`` (int8: float32 [N]; else float16 [N, K/32]), ``weight_min`` (q4_1 only)
and ``bias``. With int8 activations on (``KernelPolicy.int8_activations``) a prepared model holds
its weights permuted in place into the int8 kernel's order (``QuantLinear.set_interleaved``); the
state dict, ``dequantize`` and ``rows`` still see the GGUF order. :class:`QuantEmbedding` looks token rows up in a quantized matrix (tied
embeddings share the LM head's).
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specrt import ops
from specrt.ops import reference
from specrt.models.qformats import GROUP, KINDS, pack_q4, quantize
from specrt.models.qformats import as_half as _as_half
from specrt.models.qformats import check_kind as _check_kind

__all__ = ["KINDS", "ALL_ROWS", "KernelPolicy", "FloatLinear", "QuantLinear", "QuantEmbedding", "quantize",
           "prepare_linear", "fuse_linears", "hugepage_copy"]

ALL_ROWS = 1 << 62  # KernelPolicy.max_rows default: every row count on the kernel, one reduction order per row
_GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # fp16 d [, fp16 m], quants
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_LINEAR = torch.ops.specrt.linear.default
_QUANT_LINEAR = torch.ops.specrt.quant_linear.default
_QUANT_LINEAR_DYNAMIC = torch.ops.specrt.quant_linear_dynamic.default


_HUGEPAGES = os.environ.get("SPECRT_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def hugepage_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory backed by 2 MB transparent huge pages
    (``madvise``), so streaming a weight takes no TLB miss every 4 KB (the hardware prefetchers
    also stop at page ends). ``t`` itself on other devices, below 2 MB, or with
    ``SPECRT_HUGEPAGES=0``; the same values either way."""
    nbytes = t.numel() * t.element_size()
    if not _HUGEPAGES or t.device.type != "cpu" or nbytes < (2 << 20):
        return t
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=t.dtype).view(t.shape)  # the tensor keeps the mapping alive
    out.copy_(t)
    return out


def pack_weights(tensors: list[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` laid out back to back, in the given order, in ONE buffer
    (2 MB aligned, transparent huge pages unless ``SPECRT_HUGEPAGES=0``; each tensor ``align``-byte
    aligned). A forward that reads its weights in this order then streams one sequential region:
    each projection's software prefetch runs on into the next one's first lines, and small matrices
    (< 2 MB) get huge pages too — separately allocated they stream at ~2/3 of the speed (bench/README.md)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // align) * align
    huge = 2 << 20
    buf = mmap.mmap(-1, total + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGEPAGES:
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # the views keep the mapping alive
    base = (-raw.data_ptr()) % huge
    out = []
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        v = raw[base + off: base + off + n].view(t.dtype).view(t.shape)
        v.copy_(t)
        out.append(v)
    return out


def _weight_tensors(fn) -> list[tuple[object, str]]:
    """(holder, attribute) of the streamed tensors of a prepared projection (FloatLinear or a QuantLinear's
    forward), in the order its kernel reads them; [] for anything else (e.g. tensor-parallel modules)."""
    if isinstance(fn, FloatLinear):
        return [(fn, "weight")] if fn.kernel else []
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, QuantLinear) and owner.weight.device.type == "cpu":
        names = ("weight_scale", "weight_min", "weight") if owner.weight_min is not None else ("weight_scale", "weight")
        return [(owner, n) for n in names]
    return []


def pack_projections(projections: list, model: nn.Module) -> bool:
    """Move the weights of prepared ``projections`` (in the order a forward calls them) into one
    :func:`pack_weights` arena, unless they already lie there in that order; every parameter and
    buffer of ``model`` that views a moved tensor (fused q/k/v parts, a tied embedding) is rebound
    to the new storage, so no stale copy stays alive. Returns whether anything moved."""
    slots = [hs for fn in projections for hs in _weight_tensors(fn)]
    olds = [getattr(h, a) for h, a in slots]
    if not olds or not all(t.is_contiguous() for t in olds):
        return False
    ptrs = [t.data_ptr() for t in olds]
    if all(b >= a + t.numel() * t.element_size() and b - a - t.numel() * t.element_size() < 64
           for a, b, t in zip(ptrs, ptrs[1:], olds)):
        return False  # already packed in this order
    news = pack_weights(olds)
    moved = {}  # storage pointer -> [(old, new)]
    for (h, a), old, new in zip(slots, olds, news):
        moved.setdefault(old.untyped_storage().data_ptr(), []).append((old, new))
        if isinstance(h, nn.Module):
            h._buffers[a] = new
        else:
            setattr(h, a, new)

    def remap(t: torch.Tensor) -> torch.Tensor | None:
        for old, new in moved.get(t.untyped_storage().data_ptr(), ()):
            off = t.storage_offset() - old.storage_offset()
            span = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
            if t.dtype == old.dtype and 0 <= off and off + span <= old.numel():
                return new.as_strided(t.shape, t.stride(), new.storage_offset() + off)
        return None

    for p in model.parameters():
        r = remap(p.data)
        if r is not None:
            p.data = r
    for mod in model.modules():
        for name, b in mod._buffers.items():
            r = None if b is None else remap(b)
            if r is not None:
                mod._buffers[name] = r
    for fn in projections:
        if isinstance(fn, QuantCall):
            fn.refresh()  # it holds the tensors themselves
    return True


@dataclass
class KernelPolicy:
    """Shared by a model's prepared projections.

    max_rows: x rows up to which float projections use specrt's kernel (default: all, so a row's
    bits never depend on how many rows share its step; 0: torch's F.linear everywhere, and
    quantized layers take torch's path too — for comparisons).
    int8_activations: quantized layers quantize x to int8 on the fly (``ops.quant_linear_dynamic``;
    opt-in, changes the numerics; CPU, K % 32 == 0, else the float path)."""
    max_rows: int = ALL_ROWS
    int8_activations: bool = False


# ----------------------------------------------------------------------------- layers
class QuantLinear(nn.Module):
    """y = x W^T + b with W weight-only quantized (``kind`` in KINDS); see the module docstring."""

    def __init__(self, in_features: int, out_features: int, kind: str, bias: bool = False, device=None):
        super().__init__()
        _check_kind(kind)
        if kind != "int8" and in_features % GROUP:
            raise ValueError(f"{kind} needs in_features divisible by {GROUP}, got {in_features}")
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        q4 = kind in ("q4_0", "q4_1")
        g = in_features // GROUP
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2 if q4 else in_features,
                                                   dtype=torch.uint8 if q4 else torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, device=device) if kind == "int8"
                             else torch.ones(out_features, g, dtype=torch.float16, device=device))
        self.register_buffer("weight_min", torch.zeros(out_features, g, dtype=torch.float16, device=device)
                             if kind == "q4_1" else None)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        self.policy: KernelPolicy | None = None  # None: the kernel on the CPU
        self.interleaved = False  # weight bytes in ops.interleave_quant_weight's order (set_interleaved)

    @classmethod
    def from_parts(cls, kind: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> "QuantLinear":
        """Wrap tensors already in ``kind``'s layout (ops.quant_linear's Shape); validated by one call."""
        return cls._assemble(kind, hugepage_copy(qweight.contiguous()), hugepage_copy(scales.contiguous()),
                             None if mins is None else hugepage_copy(mins.contiguous()), bias)

    @classmethod
    def _assemble(cls, kind: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                  bias: torch.Tensor | None) -> "QuantLinear":
        """from_parts without copying the (contiguous) quantized tensors."""
        _check_kind(kind)
        k = qweight.shape[1] * (2 if kind in ("q4_0", "q4_1") else 1)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features, m.kind, m.policy, m.interleaved = k, qweight.shape[0], kind, None, False
        m.register_buffer("weight", qweight)
        m.register_buffer("weight_scale", scales)
        m.register_buffer("weight_min", mins)
        m.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        if qweight.device.type == "cpu":  # shapes / dtypes checked by the kernel itself
            ops.quant_linear(torch.zeros(1, k), m.weight, m.weight_scale, m.weight_min, m.bias, kind)
        return m

    @classmethod
    def from_blocks(cls, kind: str, d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor,
                    bias: torch.Tensor | None = None) -> "QuantLinear":
        """A GGUF-style tensor of N rows x G groups of 32 (keeps llama.cpp's dequantized values exactly).

        kind: "q8_0" | "q4_0" | "q4_1". d: scales [N, G] float16 (float32 accepted when exactly
        fp16); m: mins [N, G] float16 for q4_1, else None; q: q8_0 int8 [N, G, 32]; q4_*: uint8
        [N, G, 32] values 0..15 (feature order) or [N, G, 16] GGUF-packed bytes (byte j = feature
        j low nibble, j + 16 high). bias [N] or None. W[n, 32 g + j] = d * q (q8_0),
        d * (q - 8) (q4_0), d * q + m (q4_1)."""
        if kind not in _GGUF_BLOCK_BYTES:
            raise ValueError(f"kind must be one of {tuple(_GGUF_BLOCK_BYTES)}, got {kind!r}")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError(f"q must be a 3-D tensor [N, G, 32] (or [N, G, 16] packed for q4), got {q!r:.60}")
        n, g = q.shape[:2]
        if kind == "q8_0":
            if q.dtype not in (torch.int8, torch.uint8) or q.shape[2] != GROUP:
                raise ValueError(f"q for q8_0 must be int8 [N, G, 32], got {q.dtype} {tuple(q.shape)}")
            qweight = q.contiguous().view(torch.int8).reshape(n, g * GROUP)
        else:
            if q.dtype != torch.uint8 or q.shape[2] not in (GROUP, GROUP // 2):
                raise ValueError(f"q for {kind} must be uint8 [N, G, 32] (0..15) or [N, G, 16] packed, "
                                 f"got {q.dtype} {tuple(q.shape)}")
            if q.shape[2] == GROUP:
                if q.numel() and int(q.max()) > 15:
                    raise ValueError(f"q for {kind} holds values above 15 (expected 4-bit 0..15)")
                qweight = pack_q4(q.reshape(n, g * GROUP))
            else:
                qweight = q.contiguous().reshape(n, g * GROUP // 2)
        d = _as_half(d, "d")
        if tuple(d.shape) != (n, g):
            raise ValueError(f"d must have shape [N={n}, G={g}], got {tuple(d.shape)}")
        if (m is not None) != (kind == "q4_1"):
            raise ValueError(f"m must be {'given' if kind == 'q4_1' else 'None'} for kind {kind}")
        if m is not None:
            m = _as_half(m, "m")
            if tuple(m.shape) != (n, g):
                raise ValueError(f"m must have shape [N={n}, G={g}], got {tuple(m.shape)}")
        return cls.from_parts(kind, qweight, d, m, bias)

    @classmethod
    def from_gguf(cls, kind: str, raw: torch.Tensor, shape: tuple[int, int],
                  bias: torch.Tensor | None = None) -> "QuantLinear":
        """One GGUF tensor's raw bytes (uint8, N * G * block bytes, any shape) of logical ``shape``
        (N, K) (GGUF lists it as [K, N]). Blocks: q8_0 = fp16 d + 32 int8; q4_0 = fp16 d + 16
        bytes; q4_1 = fp16 d + fp16 m + 16 bytes."""
        if kind not in _GGUF_BLOCK_BYTES:
            raise ValueError(f"kind must be one of {tuple(_GGUF_BLOCK_BYTES)}, got {kind!r}")
        n, k = shape
        bb = _GGUF_BLOCK_BYTES[kind]
        if k % GROUP or raw.dtype != torch.uint8 or raw.numel() != n * (k // GROUP) * bb:
            raise ValueError(f"raw must be uint8 with N*K/32*{bb} = {n * (k // GROUP) * bb} bytes for shape {shape} "
                             f"(K a multiple of 32), got {raw.dtype} with {raw.numel()}")
        blocks = raw.contiguous().reshape(n, k // GROUP, bb)
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if kind == "q4_1" else None
        q = blocks[..., bb - (GROUP if kind == "q8_0" else GROUP // 2):]
        return cls.from_blocks(kind, d, m, q.view(torch.int8) if kind == "q8_0" else q, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> "QuantLinear":
        """Quantize a float weight [N, K] (see quantize())."""
        q, s, m = quantize(weight, kind)
        return cls.from_parts(kind, q.to(weight.device), s.to(weight.device),
                              None if m is None else m.to(weight.device), bias)

    @classmethod
    def from_linear(cls, lin: nn.Linear, kind: str) -> "QuantLinear":
        return cls.from_float(lin.weight, kind, lin.bias)

    @property
    def dynamic_capable(self) -> bool:
        """Whether int8 activations can run on this layer (CPU weights, K a multiple of 32)."""
        return self.weight.device.type == "cpu" and self.in_features % GROUP == 0

    def set_interleaved(self, interleaved: bool) -> None:
        """Permute the weight's bytes in place into (True) or out of (False) the order the int8-activation
        kernel reads (``ops.interleave_quant_weight``): done once when int8 activations are switched on, so
        the kernel streams each weight row as is. Views of the weight (fused projections, the arena) see
        the new order; the state dict does not. ValueError if not ``dynamic_capable``."""
        interleaved = bool(interleaved)
        if interleaved == self.interleaved:
            return
        if interleaved and not self.dynamic_capable:
            raise ValueError(f"interleaved weights need a CPU layer with in_features divisible by {GROUP}, got "
                             f"{self.weight.device.type} in_features={self.in_features}")
        with torch.no_grad():
            self.weight.copy_(ops.interleave_quant_weight(self.weight, self.kind, inverse=not interleaved))
        self.interleaved = interleaved

    def canonical_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` (default: all rows of this layer's) in the GGUF order, whatever the layout."""
        w = self.weight if weight is None else weight
        return ops.interleave_quant_weight(w, self.kind, inverse=True) if self.interleaved else w

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this layer computes with (llama.cpp's values)."""
        return reference.dequantize_weight(self.canonical_weight(), self.weight_scale, self.weight_min, self.kind)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``W[ids]`` [..., K] float32 (embedding lookup)."""
        flat = ids.reshape(-1)
        mins = None if self.weight_min is None else self.weight_min.index_select(0, flat)
        w = reference.dequantize_weight(self.canonical_weight(self.weight.index_select(0, flat)),
                                        self.weight_scale.index_select(0, flat), mins, self.kind)
        return w.reshape(*ids.shape, self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.interleaved:  # checkpoints keep the GGUF order
            destination[prefix + "weight"] = self.canonical_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "weight" in state_dict and len(error_msgs) == errors:
            self.interleaved = False  # it now holds the checkpoint's GGUF-order bytes (a model's prepare() permutes)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale, self.weight_min, self.bias)
                   if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _quant_call(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def _quant_call(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.device.type == "cpu" and (m.policy is None or m.policy.max_rows > 0):
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        xk = x2 if x2.dtype in _KERNEL_DTYPES else x2.float()
        dynamic = m.policy is not None and m.policy.int8_activations and m.dynamic_capable
        if dynamic == m.interleaved:  # the prepared layout: the weight as it lies
            op = _QUANT_LINEAR_DYNAMIC if dynamic else _QUANT_LINEAR
            y = op(xk, m.weight, m.weight_scale, m.weight_min, m.bias, m.kind)
        elif dynamic:  # not prepared for it yet: a permuted copy per call
            y = ops.quant_linear_dynamic(xk, m.weight, m.weight_scale, m.weight_min, m.bias, m.kind)
        else:
            y = _QUANT_LINEAR(xk, m.canonical_weight(), m.weight_scale, m.weight_min, m.bias, m.kind)
        y = y.to(x.dtype)
    elif m.kind == "int8" and x2.dtype in _KERNEL_DTYPES:  # torch's weight-only int8 (gpt-fast's path)
        y = torch._weight_int8pack_mm(x2.contiguous(), m.canonical_weight(), m.weight_scale.to(x2.dtype))
        if m.bias is not None:
            y = y + m.bias.to(y.dtype)
    else:  # dequantize per call (GPUs; comparisons)
        y = reference.quant_linear(x2, m.canonical_weight(), m.weight_scale, m.weight_min, m.bias, m.kind)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class QuantEmbedding(nn.Module):
    """Token embeddings read from a quantized [V, hidden] matrix (dequantized rows, in ``dtype``).

    ``source`` is either owned (registered as ``quant``) or, for tied embeddings, the LM
    head's QuantLinear (not registered again: one copy of the weights)."""

    def __init__(self, source: QuantLinear, dtype: torch.dtype, owned: bool):
        super().__init__()
        if owned:
            self.quant = source
        self.__dict__["source"] = source
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = source.out_features, source.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(input_ids).to(self.dtype)


# ----------------------------------------------------------------------------- prepared projections
class FloatLinear:
    """A float projection's fast call: specrt's kernel up to ``policy.max_rows`` rows (default: all), else F.linear."""

    __slots__ = ("weight", "bias", "policy", "kernel")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, policy: KernelPolicy):
        self.weight, self.bias, self.policy = weight, bias, policy
        self.kernel = weight.device.type == "cpu" and weight.dtype in _KERNEL_DTYPES and weight.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, K] -> [T, N]
        if self.kernel and x.shape[0] <= self.policy.max_rows and x.dim() == 2 and x.dtype in _KERNEL_DTYPES:
            return _LINEAR(x if x.stride(-1) == 1 else x.contiguous(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class QuantCall:
    """A quantized projection's fast call: the kernel op straight on the layer's tensors in the layout
    they were prepared in (``policy.int8_activations``: the int8-activation op on interleaved weights),
    else (other inputs, a changed policy, other devices) the QuantLinear's forward. ``__self__`` is the
    layer, as for a bound method (``refresh()`` after its tensors moved: ``pack_projections``)."""

    __slots__ = ("__self__", "policy", "op", "args", "fast", "dynamic")

    def __init__(self, m: QuantLinear, policy: KernelPolicy):
        m.policy = policy
        self.__self__, self.policy = m, policy
        self.refresh()

    def refresh(self) -> None:
        m, policy = self.__self__, self.policy
        self.dynamic = policy.int8_activations and m.dynamic_capable
        self.fast = m.weight.device.type == "cpu" and self.dynamic == m.interleaved
        self.op = _QUANT_LINEAR_DYNAMIC if self.dynamic else _QUANT_LINEAR
        self.args = (m.weight, m.weight_scale, m.weight_min, m.bias, m.kind)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, K] -> [T, N]
        if self.fast and x.dim() == 2 and x.dtype in _KERNEL_DTYPES and x.stride(-1) == 1 \
                and self.policy.max_rows > 0 and self.dynamic == self.policy.int8_activations:
            return self.op(x, *self.args)
        return _quant_call(self.__self__, x)


def prepare_linear(m: nn.Module, policy: KernelPolicy):
    """The callable a prepared model uses for projection ``m``: FloatLinear for a plain nn.Linear,
    QuantCall for a QuantLinear (sharing ``policy``), else the module itself (e.g. tensor-parallel)."""
    if type(m) is nn.Linear:
        return FloatLinear(m.weight, m.bias, policy)
    if isinstance(m, QuantLinear):
        return QuantCall(m, policy)
    return m


def fuse_linears(*mods: nn.Module, policy: KernelPolicy):
    """One projection for several with the same input (q/k/v, gate/up), concatenated along the
    output dim. The originals are rebound as views of the fused tensors: no extra memory,
    state_dict names unchanged, in-place loads still land in the fused tensor. None when the
    modules cannot be fused (mixed types or formats, or not plain nn.Linear / QuantLinear)."""
    if all(type(m) is nn.Linear for m in mods) and len({m.weight.dtype for m in mods}) == 1:
        w = _adjacent(m.weight for m in mods)
        if w is None:
            w = torch.cat([m.weight.detach() for m in mods])
        b = None
        if w.data_ptr() == mods[0].weight.data_ptr() and all(m.bias is None for m in mods):
            return FloatLinear(w, None, policy)  # fused before (prepare() again): nothing to rebind
        if any(m.bias is not None for m in mods):
            b = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                           for m in mods])
        start = 0
        for m in mods:
            n = m.out_features
            m.weight = nn.Parameter(w[start:start + n], requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(b[start:start + n], requires_grad=False)
            start += n
        return FloatLinear(w, b, policy)
    if all(type(m) is QuantLinear for m in mods) and len({(m.kind, m.in_features, m.interleaved) for m in mods}) == 1:
        bias = None if all(m.bias is None for m in mods) else torch.cat(
            [m.bias.detach() if m.bias is not None else m.weight_scale.new_zeros(m.out_features, dtype=torch.float)
             for m in mods])
        names = ("weight", "weight_scale") + (("weight_min",) if mods[0].weight_min is not None else ())
        shared = [_adjacent(getattr(m, a) for m in mods) for a in names]
        if all(t is not None for t in shared):  # fused before (prepare() again): the same memory
            fused = QuantLinear._assemble(mods[0].kind, shared[0], shared[1], shared[2] if len(shared) > 2 else None,
                                          bias)
        else:
            fused = QuantLinear.from_parts(mods[0].kind, *[torch.cat([getattr(m, a) for m in mods]) for a in names[:2]],
                                           torch.cat([m.weight_min for m in mods]) if len(names) > 2 else None, bias)
        fused.interleaved = mods[0].interleaved  # a row-wise permutation: concatenating rows keeps it
        start = 0
        for m in mods:
            n = m.out_features
            m.weight = fused.weight[start:start + n]
            m.weight_scale = fused.weight_scale[start:start + n]
            if m.weight_min is not None:
                m.weight_min = fused.weight_min[start:start + n]
            if m.bias is not None:
                m.bias = nn.Parameter(fused.bias[start:start + n], requires_grad=False)
            start += n
        return prepare_linear(fused, policy)
    return None


def _adjacent(tensors) -> torch.Tensor | None:
    """One view over contiguous tensors (equal trailing dims) that already follow each other in one storage (a fused
    projection's parts after an earlier fuse), else None."""
    ts = [t.detach() for t in tensors]
    if not all(t.is_contiguous() and t.dim() >= 1 and t.shape[1:] == ts[0].shape[1:] for t in ts):
        return None
    st = ts[0].untyped_storage().data_ptr()
    for a, b in zip(ts, ts[1:]):
        if b.untyped_storage().data_ptr() != st or b.storage_offset() != a.storage_offset() + a.numel():
            return None
    shape = (sum(t.shape[0] for t in ts), *ts[0].shape[1:])
    return ts[0].as_strided(shape, torch.empty(shape, device="meta").stride())
