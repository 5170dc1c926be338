"""Where a benchmark ran: the machine record in every results file, and its short tag."""
from __future__ import annotations

import os
import platform
import re
import socket

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
