"""Where the engine's models come from ("builtin", a name, a folder or a .gguf file) and the loader hook.

A model loader is any ``loader(path, role, dtype, device) -> LlamaForCausalLM`` (role is
"target" or "draft"); the engine takes one as a constructor argument, so tensor parallelism
(shard the target, replicate the draft) and benchmarks (share loaded weights between engines)
plug in without subclassing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from specrt.models import load_model
from specrt.models.loader import load_config, resolve_dtype
from specrt.models.registry import BUILTIN_DIR, resolve_model

ModelLoader = Callable[[Path, str, torch.dtype, torch.device], object]


def resolve_model_path(path: str | Path, role: str) -> Path:
    """The local source of ``path``: "builtin" (the bundled model of this role), a known name
    (e.g. "smollm2-135m"), a model folder or a .gguf file; ValueError if missing."""
    return resolve_model(path, role)


def default_loader(path: Path, role: str, dtype: torch.dtype, device: torch.device):
    """Load the whole model onto ``device`` (the role makes no difference here)."""
    return load_model(path, dtype=dtype, device=device)


def resolve_engine_dtype(dtype, device: torch.device, target_path: Path) -> torch.dtype:
    """None: bfloat16 on CUDA, float32 elsewhere; "auto": the checkpoint's; a torch dtype or its name."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(dtype, load_config(target_path))
