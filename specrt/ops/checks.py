"""Argument checks shared by the op wrappers: types, dtypes, devices, and when value checks run.

Errors name the argument: ``ValueError``, or ``TypeError`` for a wrong type or dtype.
"""
from __future__ import annotations

import operator
import os

import torch

from specrt.ops.library import _CUDA_BUILT

_debug_checks = os.environ.get("SPECRT_DEBUG_CHECKS", "0") not in ("", "0")


def set_debug_checks(enabled: bool) -> None:
    """Run value checks on CUDA tensors too (each costs a device->host sync)."""
    global _debug_checks
    _debug_checks = bool(enabled)


def _check_values(t: torch.Tensor, check_values: bool | None) -> bool:
    if check_values is not None:
        return bool(check_values)
    return t.device.type == "cpu" or _debug_checks


def _tensor(t, name: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(t: torch.Tensor, name: str, like: torch.Tensor) -> None:
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device} (like the other inputs), got {t.device}")


def _has_kernels(t: torch.Tensor, name: str) -> None:
    if t.device.type == "cpu" or (t.device.type == "cuda" and _CUDA_BUILT):
        return
    raise ValueError(f"{name} is on {t.device} but this build of specrt has no kernels for it")


def _as(t, name: str, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """Accept Python lists / other integer or float dtypes for small per-row vectors.

    Integers stay in their dtype when the op reads int32: the op range-checks them
    before narrowing (a silent int64 -> int32 wrap would change the value)."""
    if t is None:
        raise ValueError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"{name} must be a tensor or a list of numbers: {exc}") from None
    if dtype.is_floating_point and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor ({dtype}), got {t.dtype}")
    if not dtype.is_floating_point and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor ({dtype}), got {t.dtype}")
    _same_device(t, name, like)
    return (t if dtype == torch.int32 else t.to(dtype)).contiguous()


def _float_input(t, name: str) -> torch.Tensor:
    t = _tensor(t, name)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.float()  # no copy when already float32


def _bool(t, name: str, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t, dtype=torch.bool)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name} must be a tensor or a list of booleans: {exc}") from None
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {t.dtype}")
    _same_device(t, name, like)
    return t.contiguous()


def _index(x, name: str) -> int:
    """A Python integer (no silent truncation of floats)."""
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an integer, got bool {x!r}")
    try:
        value = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(x).__name__} {x!r}") from None
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} = {value} is out of range")
    return value


def _cpu_only(t, name: str) -> torch.Tensor:
    t = _tensor(t, name)
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on cpu (a CPU testing hook), got {t.device}")
    return t
