"""Shared helpers for the benchmarks: the environment a figure was taken in, and a timer.

Every performance claim names its script, its command and this record (STYLE.md habit 15). Keep this
module small and stable: other benchmark scripts import it.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import torch


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """The commit of the working tree, with `+dirty` if it has uncommitted changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def environment() -> dict:
    """Hardware, library versions, commit and date: what a reader needs to compare a figure."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    env["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return env


def status_kib(field: str) -> int:
    """A KiB field of this process' /proc/self/status (Linux): VmRSS resident now, VmHWM its peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def sync(device: torch.device | str = "cpu") -> None:
    """Wait for queued GPU work so that a wall-clock time covers it (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timeit(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device: str = "cpu") -> float:
    """Median wall-clock seconds of `fn()` over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
