"""Shared helpers for the benchmarks: the environment a figure was taken in, and a timer.

Every performance claim names its script, its command and this record. Keep this module small and
stable: other benchmark scripts import it.

Scripts write to `LOCAL_RESULTS` (benchmarks/results/local/, ignored by git) unless `--out` names a
place, and write over a file git tracks only with `--force` (`check_out`): the commands RESULTS.md quotes
name the committed files, and run again they replaced the figures that page quotes. (profile_step.py,
batch_fill.py and batching.py write no files: they print.)
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from aiayn.config import MAX_THREADS

LOCAL_RESULTS = Path(__file__).resolve().parent / "results" / "local"  # the default output folder


# The matrix units that decide a CPU's bfloat16 speed: a VM may name an AMX Xeon and one without AMX
# alike ("Intel(R) Xeon(R) Processor"), and their bf16 matmuls differ by 5x.
MATRIX_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx2", "fma")


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux) with its `MATRIX_FLAGS`, else what `platform`
    knows."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if not name:
        return platform.processor() or platform.machine()
    has = [f for f in MATRIX_FLAGS if f in flags]
    return f"{name} ({' '.join(has) or 'none of ' + ', '.join(MATRIX_FLAGS)})" if flags else name


REPOSITORY = Path(__file__).resolve().parents[1]  # the checkout these scripts belong to


def git_commit() -> str:
    """The commit of the tree aiayn runs from, with `+dirty` if it has uncommitted changes outside
    benchmarks/results/, or new Python or shell files (an untracked module, benchmark or script changes
    what runs; results files, new or modified, do not). "unknown (not a git checkout; aiayn VERSION)" where
    aiayn's files are no checkout's: a copy in site-packages, or one in a folder git ignores inside a
    checkout, whose HEAD was said as the commit of code it never held."""
    import aiayn  # the tree of the code that runs, not of this script: a script run from another clone

    here = os.path.dirname(os.path.abspath(aiayn.__file__))
    try:
        tracked = ["git", "ls-files", "--error-unmatch", "--", os.path.basename(aiayn.__file__)]
        if subprocess.run(tracked, cwd=here, capture_output=True, check=False).returncode != 0:
            raise OSError("aiayn's files are not tracked by git")
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        changed = ["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                   ":(top,exclude)benchmarks/results/"]  # a results file rewritten there said "+dirty"
        dirty = subprocess.run(changed, cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        new = ["git", "ls-files", "--others", "--exclude-standard", "--", ":/*.py", ":/*.sh"]
        dirty += subprocess.run(new, cwd=here, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"unknown (not a git checkout; aiayn {aiayn.__version__})"
    return rev + ("+dirty" if dirty else "")


def aiayn_source() -> str:
    """aiayn's version and the folder it was imported from, saying so where that is not this script's
    repository's src/aiayn: the commit then is another tree's, or none (an installed copy)."""
    import aiayn

    here = Path(aiayn.__file__).resolve().parent
    ours = REPOSITORY / "src" / "aiayn"
    return f"{aiayn.__version__} from {here}" + ("" if here == ours else f" (not {ours}, beside this script)")


# Settings outside torch that RESULTS.md shows change the timings: recorded where they are set.
TIMING_VARIABLES = ("AIAYN_SYSTEM_MALLOC", "THP_MEM_ALLOC_ENABLE", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def total_ram_gb() -> float | None:
    """The machine's memory in GB (None where the OS does not say)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (AttributeError, ValueError, OSError):
        return None


def environment(device: torch.device | str = "cpu", keeps_freed_memory: bool | None = None) -> dict:
    """Hardware, library versions, commit and date: what a reader needs to compare a figure. "gpu" names
    `device` when it is a CUDA one (else the current CUDA device): a run on cuda:1 named device 0.
    `keeps_freed_memory`: what `aiayn.memory.keep_freed_memory()` returned, for a script that calls it
    (with glibc's defaults every large buffer is faulted in again: a bf16 `small` step took 1.67 s, not
    1.30 s, `aiayn.memory`), and those of `TIMING_VARIABLES` that are set."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "aiayn": aiayn_source(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gb": total_ram_gb(),
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
        env["gpu"] = torch.cuda.get_device_name(device if torch.device(device).type == "cuda" else None)
        env["cuda"], env["cudnn"] = torch.version.cuda, torch.backends.cudnn.version()
    env.update({name: os.environ[name] for name in TIMING_VARIABLES if name in os.environ})
    if keeps_freed_memory is not None:
        env["keeps_freed_memory"] = keeps_freed_memory
    env["load_average"] = load_average()
    return env


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): how shared the machine was."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def peer_available(module: str, peer: str) -> bool:
    """Whether the optional peer's package `module` imports; if not, one line on stderr says so."""
    try:
        importlib.import_module(module)
    except ImportError:
        print(f"skipping {peer}: {module} is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return False
    return True


def require_device(name: str) -> torch.device:
    """`name` as a torch.device; exits with one line when it is not one, is not a CPU or CUDA device (the
    benchmarks time and synchronise those two: a meta tensor "ran" in no time), or is a CUDA device not
    here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name}: not a device name torch knows") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: the benchmarks run on cpu or cuda")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"--device {name}: no such CUDA device here "
                         f"(torch.cuda.is_available() is {torch.cuda.is_available()})")
    return device


def at_least(minimum: float, kind: type = int, maximum: float = math.inf) -> Callable[[str], float]:
    """argparse type: a number of `kind` (int or float) no smaller than `minimum` (nor larger than
    `maximum`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not value >= minimum:  # `not >=`: also refuses nan
            raise argparse.ArgumentTypeError(f"must be at least {minimum}: {text!r}")
        if not math.isfinite(value):  # inf: a sleep or a loop that never ends, or an OverflowError later
            raise argparse.ArgumentTypeError(f"must be finite: {text!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}: {text!r}")
        return value

    return parse


# torch.set_num_threads: libgomp fails creating 20,000 threads and segfaults at 100,000; past 2^31 it is
# an OverflowError traceback (aiayn's own limit)
threads = at_least(1, maximum=MAX_THREADS)


def thread_counts(text: str) -> list[int]:
    """argparse type: "1" or "2,1,2" -> [1] or [1, 2], each a `threads` count."""
    try:
        return sorted({threads(t) for t in text.split(",")})
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"not a thread count or a comma list of them ({e}): "
                                         f"{text!r}") from None


def check_out(path: Path, also: list[Path] = (), force: bool = False, out: Path | None = None) -> None:
    """Exit with one line, before any measuring, if `path` (and the files `also` beside it) cannot be
    written: a directory in the way, or a parent that cannot be made or written to; or, unless `force`
    (--force), if one of `also` is a committed result (`refuse_committed`). Makes the parent directories.
    The line names `--out OUT`, the folder a script's --out names where `path` is a file stem in it, else
    `--out PATH`: what the user typed, not a stem they never did."""
    label = f"--out {path if out is None else out}"
    for target in [path, *also]:
        if target.is_dir():
            raise SystemExit(f"{label}: {target} is a directory")
    refuse_committed(label, also, force)
    existing = next(p for p in path.absolute().parents if p.exists())  # "/" does
    if not existing.is_dir():
        raise SystemExit(f"{label}: {existing} is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"{label}: cannot make {path.parent} ({e.strerror or e})") from None
    try:  # a file made and removed: os.access says yes to root everywhere (/sys, a read-only mount)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        raise SystemExit(f"{label}: {path.parent} is not writable ({e.strerror or e})") from None


def refuse_committed(label: str, files: list[Path], force: bool) -> None:
    """Exit with one line naming `label` (the option that chose `files`) and every one of `files` that is
    there and git tracks, unless `force`: a committed result is replaced only on purpose."""
    if force:
        return
    if tracked := [str(file) for file in files if file.is_file() and tracked_by_git(file)]:
        names = tracked[0] if len(tracked) == 1 else f"{', '.join(tracked[:-1])} and {tracked[-1]}"
        what = "a committed result" if len(tracked) == 1 else "committed results"
        raise SystemExit(f"{label}: would write over {names}, which git tracks ({what}): "
                         "--out another place, or --force to replace it")


def tracked_by_git(file: Path) -> bool:
    """Whether git tracks `file` (False outside a checkout, or without git)."""
    try:
        # literal: r[1].md was read as a glob (matching a tracked r1.md), a leading ":" as pathspec magic;
        # the option, not ":(literal)", which GIT_LITERAL_PATHSPECS=1 reads as part of the name
        command = ["git", "--literal-pathspecs", "ls-files", "--error-unmatch", "--", file.name]
        listed = subprocess.run(command, cwd=file.parent, capture_output=True, check=False)
    except OSError:
        return False
    return listed.returncode == 0


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that ran `script` (its `__file__`) with `argv` (None: sys.argv's), quoted as a shell
    takes it: joined with spaces, `--engines "CT2 float32,Linear floor"` could not be run again as
    recorded. Without arguments, no space after the script's name."""
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *(sys.argv[1:] if argv is None else argv)])


def with_suffix_added(path: Path, suffix: str) -> Path:
    """`path` + `suffix` (decode_v1.5 -> decode_v1.5.json, where Path.with_suffix made decode_v1.json)."""
    return path.with_name(path.name + suffix)


def comma_choices(choices: list[str], allow_empty: bool = False) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list, each item one of `choices` ("" an empty list if allowed)."""

    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(x for x in text.split(",") if x))  # once each: a repeat was timed twice
        if unknown := [x for x in items if x not in choices]:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}: choose from {', '.join(choices)}")
        if not items and not allow_empty:
            raise argparse.ArgumentTypeError(f"name at least one of {', '.join(choices)}")
        return items

    return parse


def status_kib(field: str) -> int:
    """A KiB field of this process' /proc/self/status (Linux): VmRSS resident now, VmHWM its peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def sync(device: torch.device | str = "cpu") -> None:
    """Wait for `device`'s queued GPU work so that a wall-clock time covers it (a no-op on CPU). The device
    named: torch.cuda.synchronize() waits for the current one, cuda:0, and a run on cuda:1 timed launches."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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
