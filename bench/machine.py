"""The machine a run was made on: the git commit measured, CPU model and vector flags, cores, memory, GPU, OS
and the versions that matter. Every results folder records it (``results.json`` / ``commands.json``)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["CPU_FLAGS", "git_commit", "machine_info"]

REPO = Path(__file__).resolve().parents[1]
# The vector extensions that change decode, resize and copy speeds: AVX2, AVX-512 (F, BW, VNNI, BF16), AMX.
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    """Which of :data:`CPU_FLAGS` the CPU reports (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return []
    return [f for f in CPU_FLAGS if f in flags]


def git_commit(repo: Path = REPO) -> dict[str, Any] | None:
    """The commit of the tree that ran (``dirty``: tracked files other than the results folders differed from
    it: a rerun rewrites its own results, which says nothing about the code measured), or None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/results"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "dirty": bool(dirty)}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _glibc_non_temporal_threshold() -> int | None:
    """The size from which this process's glibc memcpy uses non-temporal stores (None: not glibc x86, or
    unknown). glibc derives it from the last-level cache it sees; a VM shown a whole socket's L3 gets a large
    one, so every batch-sized copy goes through the cache (docs/performance.md: "Memory copies on virtual machines")."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            loader = next((line.split()[-1] for line in f if "/ld-linux" in line), None)
        if loader is None:
            return None
        out = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("glibc.cpu.x86_non_temporal_threshold:"):
            return int(line.split(":", 1)[1].split()[0], 16)
    return None


def machine_info() -> dict[str, Any]:
    import cv2
    import psutil
    import torch

    gpu = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = {"name": p.name, "memory_gb": round(p.total_memory / 2**30, 1), "count": torch.cuda.device_count(),
               "cuda": torch.version.cuda}
    return {
        "host": socket.gethostname(),
        "git": git_commit(),
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "torchvision": _version("torchvision"), "opencv": cv2.__version__,
                     "zarr": _version("zarr"), "numpy": _version("numpy"), "pillow": _version("pillow"),
                     "simplejpeg": _version("simplejpeg"), "joblib": _version("joblib"),
                     "cachebuild": _version("cachebuild")},
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "glibc_non_temporal_threshold": _glibc_non_temporal_threshold(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
