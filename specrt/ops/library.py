"""Loads specrt's compiled extension (the only importer of ``specrt._C``) and reports what it can do.

Importing ``specrt._C`` registers every ``torch.ops.specrt`` op (schemas in csrc/*_ops.cpp).
The helpers below say what this build and CPU offer: the CUDA kernels, and the instruction
sets the CPU kernels may use (testing hooks: every ISA returns the same bits; ``SPECRT_CPU_ISA``
caps all of them), and the greedy threshold of the sampling kernels.
"""
from __future__ import annotations

import torch

try:
    from specrt import _C
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "specrt's compiled extension specrt._C is missing or was built against another torch "
        f"(torch here is {torch.__version__}). Reinstall with `pip install --no-build-isolation .` "
        f"from the specrt source tree. Original error: {exc}"
    ) from exc

_CUDA_BUILT = bool(_C.cuda_built())   # a constant, so torch.compile never calls into pybind


def cuda_built() -> bool:
    """True when this build of specrt contains the CUDA kernels."""
    return _CUDA_BUILT


def extension_path() -> str:
    """The file the extension was loaded from (bench/attention_ab.py checks it is the build under test)."""
    return _C.__file__


def layer_stack_class():
    """``specrt._C.LayerStack``: a CPU model's decode / verify layers in one call (specrt/models/layer_stack.py)."""
    return _C.LayerStack


def suffix_index_class():
    """``specrt._C.SuffixIndex``: the suffix index of suffix drafting (semantics: specrt/drafters/suffix_ref.py)."""
    return _C.SuffixIndex


def philox4x32_10_words(counter: list[int], key: list[int]) -> list[int]:
    """The extension's Philox4x32-10 on 32-bit words (ops.philox4x32_10 checks the arguments)."""
    return list(_C.philox4x32_10(counter, key))


def greedy_temperature() -> float:
    """The greedy threshold of csrc/include/specrt/sampling.h (kGreedyTemperature, a float32 value):
    temperatures below it sample one-hot at the argmax. ``ops.is_greedy`` is the rule in Python."""
    return float(torch.ops.specrt.greedy_temperature())


def attention_cpu_isa(level: int = -1) -> int:
    """Testing hook: cap the instruction set of the CPU attention kernel (0 portable scalar code,
    1 AVX2+FMA, 2 AVX-512 with every lane group 16 wide, 3 AVX-512 with narrow groups for few
    queries per kv head, 4 the same with the many-lane tile reading a bf16 cache's keys in place;
    -1 only asks) and return the level in use before the call. Without a cap the kernel takes the
    CPU's preferred level (4 on AMD, 3 on other AVX-512 CPUs) under the ``SPECRT_CPU_ISA`` ceiling
    (avx2: 1, scalar: 0). Every level returns the same bits; tests use this to check that."""
    return int(torch.ops.specrt._attention_cpu_isa(int(level)))


def attention_tile_keys() -> int:
    """Keys per online-softmax update of the paged-attention kernels (csrc/include/specrt/attention.h,
    kTileKeys): tiles sit at absolute key indices, so rows whose visible keys fall into the same
    tiles in the same order get the same bits (a token tree inside one tile verifies exactly as
    decoding its path would)."""
    return int(torch.ops.specrt.attention_tile_keys())


def linear_dynamic_isa() -> str:
    """The path quant_linear_dynamic runs on now: "avx512vnni", "avx2" or "scalar" (all the same bits)."""
    return str(torch.ops.specrt.linear_dynamic_isa())


def linear_isa_names() -> list[str]:
    """ISAs the linear kernel can use on this CPU under the ``SPECRT_CPU_ISA`` ceiling, best first
    (e.g. ["amx", "avx512bf16", "avx512", "avx2", "scalar"])."""
    return list(torch.ops.specrt.linear_isa_names())


def set_linear_isa(name: str) -> str:
    """Cap the linear kernel's ISA (all give identical bits; for tests and benchmarks); "" = best.
    On an AMX machine bf16 x bf16 keeps the AMX order under any cap or SPECRT_CPU_ISA (its portable
    twin runs below "amx"), so capping there measures the twin, not the vdpbf16ps kernels.

    Returns: the previous ISA name."""
    return torch.ops.specrt.set_linear_isa(str(name))
