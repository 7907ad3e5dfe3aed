"""What this machine offers: RAM, cgroup limit, CPUs and each CUDA device's memory."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import psutil

from rlbuffers.memory.cgroup import CGROUP_ROOT, PROC_SELF_CGROUP, cgroup_limit_bytes


def cuda_devices() -> list[dict[str, Any]]:
    """``[{"device": "cuda:0", "name": ..., "total_bytes": ..., "free_bytes": ...}, ...]``;
    empty when torch is not imported or has no CUDA device."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append({"device": f"cuda:{i}", "name": torch.cuda.get_device_name(i),
                    "total_bytes": int(total), "free_bytes": int(free)})
    return out


def capacity(proc_cgroup: Path = PROC_SELF_CGROUP,
             root: Path = CGROUP_ROOT) -> dict[str, Any]:
    """Plain-data description of the memory this process can use (sizes in bytes).

    Returns:
        ``{"ram_total_bytes", "ram_available_bytes", "cgroup_limit_bytes" (None if none),
        "cpu_count", "cuda": [per-device dicts, see :func:`cuda_devices`]}``.
    """
    vm = psutil.virtual_memory()
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity else os.cpu_count()
    return {"ram_total_bytes": int(vm.total), "ram_available_bytes": int(vm.available),
            "cgroup_limit_bytes": cgroup_limit_bytes(proc_cgroup, root), "cpu_count": cpus,
            "cuda": cuda_devices()}
