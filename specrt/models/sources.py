"""Where the engine's models come from ("builtin", a name, a folder or a .gguf file) and the loader hook.

A model loader is any ``loader(path, role, dtype, device) -> LlamaForCausalLM`` (role is
"target" or "draft"); the engine takes one as a constructor argument, so tensor parallelism
(shard the target, replicate the draft) and benchmarks (share loaded weights between engines)
plug in without subclassing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specrt.models import load_model
from specrt.models.linear import KINDS as QUANT_KINDS
from specrt.models.linear import QuantLinear
from specrt.models.loader import load_config, resolve_dtype
from specrt.models.quant import quantize_model_
from specrt.models.registry import BUILTIN_DIR, resolve_model

ModelLoader = Callable[[Path, str, torch.dtype, torch.device], object]


def resolve_model_path(path: str | Path, role: str) -> Path:
    """The local source of ``path``: "builtin" (the bundled model of this role), a known name
    (e.g. "smollm2-135m"), a model folder or a .gguf file; ValueError if missing."""
    return resolve_model(path, role)


def default_loader(path: Path, role: str, dtype: torch.dtype, device: torch.device):
    """Load the whole model onto ``device`` (the role makes no difference here)."""
    return load_model(path, dtype=dtype, device=device)


AUTO = "auto"
AUTO_DRAFT_QUANTIZE = "q8_0"   # what draft_quantize="auto" picks where the int8-activation kernel has VNNI


def resolve_draft_quantize(draft_quantize, model_draft: bool, device: torch.device) -> tuple[str | None, bool]:
    """(the draft model's quantization or None, whether its quantized layers take int8 activations).

    "auto" (the engine's default) picks Q8_0 weights with int8 activations for a draft model on a
    CPU whose int8 kernel runs on AVX-512-VNNI: the draft's acceptance stays the same and its steps
    get cheaper (docs/benchmarks.md, "Token trees and the default engine"); full precision elsewhere (GPUs, CPUs without VNNI, drafters without a model). None / a kind:
    as given. ``model_draft``: whether the draft loads a model (DraftSpec.loads_model)."""
    if draft_quantize != AUTO:
        return check_quantize(draft_quantize, "draft_quantize"), False
    from specrt import ops

    if model_draft and device.type == "cpu" and ops.linear_dynamic_isa() == "avx512vnni":
        return AUTO_DRAFT_QUANTIZE, True
    return None, False


def check_quantize(quantize, name: str) -> str | None:
    """``quantize`` (None or one of QUANT_KINDS) or a ValueError naming the argument."""
    if quantize is not None and quantize not in QUANT_KINDS:
        raise ValueError(f"{name} must be None or one of {QUANT_KINDS}, got {quantize!r}")
    return quantize


def quantized_loader(loader: ModelLoader, quantize: str | None, dtype=None, keep_quantized: bool = False) -> ModelLoader:
    """``loader`` whose models come back weight-only quantized to ``quantize`` (layers that stay
    quantized: specrt.models.quant) and, when ``dtype`` is given (a torch dtype, its name or "auto"),
    in that activation dtype instead of the one asked for. The default loader quantizes while
    loading (``load_model(quantize=)``); any other loader's model is quantized in place after.
    ``keep_quantized`` (draft_quantize="auto"): a model that already has quantized layers (an int8
    checkpoint, a loader that shares quantized models) is used as it is."""
    if quantize is None and dtype is None:
        return loader
    if dtype is not None and dtype != "auto":
        try:
            resolve_dtype(dtype, None)  # a bad name fails here, before any model loads
        except ValueError as e:
            raise ValueError(f"draft_dtype: {e}") from None

    def load(path: Path, role: str, engine_dtype: torch.dtype, device: torch.device):
        dt = engine_dtype if dtype is None else resolve_dtype(dtype, load_config(path))
        if loader is default_loader and not keep_quantized:
            return load_model(path, dtype=dt, device=device, quantize=quantize)
        model = loader(path, role, dt, device)
        if quantize is None or (keep_quantized and any(isinstance(m, QuantLinear) for m in model.modules())):
            return model
        return quantize_model_(model, quantize)
    return load


def resolve_engine_dtype(dtype, device: torch.device, target_path: Path) -> torch.dtype:
    """None: bfloat16 on CUDA, float32 elsewhere; "auto": the checkpoint's; a torch dtype or its name."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(dtype, load_config(target_path))


@dataclass(frozen=True)
class DraftLoader:
    """How the draft model loads: the loader, and the settings it applies, which a draft loaded
    another way (a reduced-vocabulary DraftModel folder) must honour too."""
    load: ModelLoader                   # (path, "draft", dtype, device) -> model, draft_quantize / draft_dtype applied
    quantize: str | None = None         # its weight-only quantization (one of QUANT_KINDS; None: full precision)
    dtype: object = None                # its activation dtype as asked (a torch dtype, a name, "auto"; None: the engine's)


@dataclass
class LoadedTarget:
    """The engine's target, loaded, and how its draft model (if any) is to be loaded."""
    path: Path
    model: object                       # LlamaForCausalLM (or a tensor-parallel shard)
    dtype: torch.dtype                  # the engine's activation dtype
    draft_loader: DraftLoader           # the loader with draft_quantize / draft_dtype applied
    draft_int8_activations: bool = False  # the quantized draft's layers take int8 activations


def check_int8_activations(int8_activations, device: torch.device) -> bool:
    """``int8_activations`` as a bool, or a TypeError / ValueError naming the argument (a CPU mode)."""
    if not isinstance(int8_activations, bool):
        raise TypeError(f"int8_activations must be a bool, got {type(int8_activations).__name__}")
    if int8_activations and device.type != "cpu":
        raise ValueError(f"int8_activations=True is a CPU mode (AVX-512-VNNI or portable C++), got device {device}")
    return int8_activations


def use_int8_activations(model) -> bool:
    """Switch a model's quantized layers to int8 activations (``set_int8_activations``); False, and
    nothing changed, when it has no quantized layer (or is not a specrt decoder)."""
    if not hasattr(model, "set_int8_activations") or not any(isinstance(m, QuantLinear) for m in model.modules()):
        return False
    model.set_int8_activations(True)
    return True


def load_target(target, draft, model_draft: bool, device: torch.device, dtype, loader: ModelLoader | None,
                target_quantize=None, draft_quantize=None, draft_dtype=None,
                int8_activations: bool = False) -> LoadedTarget:
    """Resolve and load the target (weight-only quantized if asked; quantized layers stay
    quantized; with ``int8_activations`` they quantize their inputs to int8, and the target must have
    some: ``target_quantize``, a quantized checkpoint or GGUF, or a loader that quantizes); ValueError
    when draft_quantize / draft_dtype are given without a draft model. ``draft``: the engine's
    ``draft=`` (for messages); ``model_draft``: whether it loads a model (DraftSpec.loads_model)."""
    int8_activations = check_int8_activations(int8_activations, device)
    load = loader or default_loader
    path = resolve_model_path(target, "target")
    dtype = resolve_engine_dtype(dtype, device, path)
    draft_kind, draft_int8 = resolve_draft_quantize(draft_quantize, model_draft, device)
    draft_load = quantized_loader(load, draft_kind, draft_dtype, keep_quantized=draft_quantize == AUTO)
    if draft_load is not load and not model_draft:
        raise ValueError(f"draft_quantize / draft_dtype apply to a draft model, got draft={draft!r}")
    model = quantized_loader(load, check_quantize(target_quantize, "target_quantize"))(path, "target", dtype, device)
    if int8_activations and not use_int8_activations(model):
        raise ValueError(f"int8_activations=True needs a quantized target (target_quantize one of {QUANT_KINDS}, a "
                         f"quantized checkpoint or GGUF file); {path.name} loaded with no quantized layer")
    return LoadedTarget(path, model, dtype, DraftLoader(draft_load, draft_kind, draft_dtype),
                        draft_int8 or int8_activations)
