"""Where a benchmark ran: the machine record in every results file, its short tag, and its memory
bandwidth (the floors of bench/forward.py and bench/attention.py)."""
from __future__ import annotations

import os
import platform
import re
import socket
import time
from collections.abc import Callable

import torch


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def machine_info(device) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "device": str(dev), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            if m:
                info["cpu_model"] = m.group(1).strip()
    except OSError:
        pass
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    return info


def machine_tag(info: dict) -> str:
    """"h200", "cpu16": the machine part of a results folder's name."""
    tag = info["gpu"].replace("NVIDIA", "").strip() if "gpu" in info else f"cpu{info['cpu_count']}"
    return re.sub(r"[^A-Za-z0-9]+", "-", tag).strip("-").lower()


def _seconds(fn: Callable[[], object], reps: int, device: str, pick: Callable[[list[float]], float]) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return pick(times)


def read_bandwidth(mbytes: int = 256, reps: int = 9, device: str = "cpu",
                   pick: Callable[[list[float]], float] = min) -> float:
    """Bytes per second of an int32 max over `mbytes` MB, a pure read stream (an integer max reads at
    full speed; a float one checks NaNs), at the current thread count; `pick` of `reps` timings
    (min: the best). The memory floors of bench/forward.py and bench/attention.py use it."""
    ints = torch.ones(mbytes << 18, dtype=torch.int32, device=device)
    return ints.numel() * 4 / _seconds(lambda: torch.amax(ints), reps, device, pick)


def copy_read_rate(mbytes: int = 256, reps: int = 9, device: str = "cpu",
                   pick: Callable[[list[float]], float] = min) -> float:
    """Bytes read per second by a copy of `mbytes` MB (it writes as many): about half the read
    bandwidth, printed beside it to compare with results that used it as their floor."""
    src = torch.ones(mbytes << 18, device=device)
    dst = torch.empty_like(src)
    return src.numel() * 4 / _seconds(lambda: dst.copy_(src), reps, device, pick)
