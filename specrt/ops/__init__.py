"""specrt's kernel ops (``from specrt import ops``); ``ops.library`` is the only module that imports
the compiled ``specrt._C``.

Every op is a real torch op (``torch.ops.specrt.<name>``, schemas in
csrc/*_ops.cpp) with CPU and CUDA implementations and a fake kernel (``ops.fakes``),
so it traces under ``torch.compile(fullgraph=True)`` and passes
``torch.library.opcheck``. The functions re-exported here (from ops.sampling,
ops.tree, ops.kv, ops.matmul, ops.fused, ops.library) are its documented Python front:
they accept Python lists for the small per-row vectors, check what can be
checked without reading data, and call the op.

Shapes: B requests, K = max draft tokens this step, V vocabulary, N rows.
Token outputs are int32, padded with -1. Every op checks its arguments and
raises ``ValueError`` (or ``TypeError`` for a wrong type or dtype) naming the
argument. Integer arguments may have any integer dtype: values are
range-checked before the kernels narrow them to int32.

Value checks (NaN or negative probabilities, all-zero probability rows,
out-of-range token ids, block and slot ranges) read the data. On CPU tensors
they always run unless ``check_values=False``; on CUDA tensors they would cost
a device->host sync on the hot path, so they run only in debug mode
(``set_debug_checks(True)`` or ``SPECRT_DEBUG_CHECKS=1``). Without them the
kernels still never read or write out of bounds: bad ids are treated as
rejected, bad slots skipped, and integers outside int32 saturate.

Randomness (docs/architecture.md section 3): every random number is a pure function of
``(seed, absolute position, purpose, index)`` through Philox4x32-10, so
results do not depend on batch composition, slot or device.
"""
from __future__ import annotations

from specrt.ops import fakes  # noqa: F401  (registers the fake kernels)
from specrt.ops.checks import _check_values, set_debug_checks  # noqa: F401  (_check_values: models' fast path)
from specrt.ops.fused import FUSED_DTYPES, rms_norm, rotary_write_kv, silu_mul
from specrt.ops.kv import copy_blocks, copy_slots, paged_attention, write_kv
from specrt.ops.library import attention_cpu_isa, attention_tile_keys, cuda_built, linear_dynamic_isa, linear_isa_names, set_linear_isa
from specrt.ops.matmul import QUANT_KINDS, interleave_quant_weight, linear, quant_linear, quant_linear_dynamic
from specrt.ops.sampling import (METHODS, PURPOSES, TEMPERATURE_EPS, apply_penalties, apply_token_bitmask,
                                 is_greedy, log_det, philox4x32_10, probs_from_logits, rejection_sample,
                                 sample_tokens, uniform_noise, verify_greedy)
from specrt.ops.tree import rejection_sample_tree, verify_tree_greedy

__all__ = [
    "FUSED_DTYPES", "METHODS", "PURPOSES", "QUANT_KINDS", "TEMPERATURE_EPS", "apply_penalties",
    "apply_token_bitmask", "attention_cpu_isa", "attention_tile_keys", "copy_blocks", "copy_slots", "cuda_built",
    "interleave_quant_weight",
    "is_greedy", "linear",
    "linear_dynamic_isa", "linear_isa_names", "log_det", "paged_attention", "philox4x32_10", "probs_from_logits",
    "quant_linear", "quant_linear_dynamic", "rejection_sample", "rejection_sample_tree", "rms_norm",
    "rotary_write_kv", "sample_tokens", "set_debug_checks", "set_linear_isa", "silu_mul", "uniform_noise",
    "verify_greedy", "verify_tree_greedy", "write_kv",
]
