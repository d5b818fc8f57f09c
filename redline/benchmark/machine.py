"""What a benchmark ran on: CPU model, cores, threads, library versions, date, and background load."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from redline.models.huge_pages import huge_page_zeros


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def busy_cores(seconds: float = 0.5) -> float:
    """Cores kept busy by other processes while this one sleeps, from /proc/stat (0.0 where unknown)."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return 0.0

    def sample() -> tuple[int, int]:
        user, nice, system, idle, iowait, *rest = map(int, stat.read_text().split()[1:9])
        return user + nice + system + sum(rest), idle + iowait

    busy0, idle0 = sample()
    time.sleep(seconds)
    busy1, idle1 = sample()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(1, busy1 - busy0 + idle1 - idle0)


def read_bandwidth_gbps(megabytes: int = 256, repeats: int = 10) -> float:
    """Memory read bandwidth as torch sees it: the best of `repeats` fp32 sums over a buffer far larger
    than the caches (what a weight-streaming decode can at most reach on this machine and thread count).
    The buffer is on the pages the CPU engine's weights are on (huge pages: models/huge_pages.py); on a
    2-core VM, ordinary pages read about 20% slower (BENCHMARKS.md "Weights and KV cache on huge pages")."""
    buffer = huge_page_zeros((megabytes * 2**20 // 4,), torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def describe(device: str = "cpu") -> dict:
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "device": device,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "busy_cores_at_start": round(busy_cores(), 2)}  # fmt: skip
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
