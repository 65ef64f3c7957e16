"""Keep freed memory in the process instead of giving it back to the kernel after every step, cap
oneDNN's per-shape kernel caches (`cap_kernel_caches`), and put weights that are streamed from memory
on huge pages (`on_huge_pages`).

glibc's malloc serves each block over 32 MiB (and often smaller ones) with its own mmap and unmaps it
on free. A training step frees and re-allocates the same large activations (logits, their gradient,
float copies) every time, so each one is page-faulted in and zeroed by the kernel again: about 40 ms
per 113 MB on this project's 2-core machine, a fifth of a `small` model's step. With mmap turned off
and trimming raised, freed blocks stay in the heap and the next step reuses them: a bf16 `small` step
on 2 threads here went from 1.67 s to 1.30 s (1.29 s to 0.87 s with the other speed-ups of the step).
The price is memory: freed blocks stay resident, and batches of varying shapes can fragment the heap.
`release_freed_memory`, which training calls after each validation, hands the heap's whole free pages
back (glibc's malloc_trim) at the cost of one re-fault of what the next step uses. (The 12 GB that two
82-minute Multi30k trainings reached on an AMX CPU was not this but oneDNN's kernel caches, which
`cap_kernel_caches` bounds.) Set AIAYN_SYSTEM_MALLOC=1 to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Iterable

import torch
from torch import Tensor

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
_done = False
_libc: ctypes.CDLL | None = None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse; True if it now does (glibc on Linux only)."""
    global _done, _libc
    if _done:
        return True
    if sys.platform != "linux" or os.environ.get("AIAYN_SYSTEM_MALLOC") == "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc's mallopt has these parameters
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if _done:
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        _libc = libc
    return _done


def release_freed_memory() -> bool:
    """Return the heap's whole free pages to the kernel (malloc_trim(0)); True if it ran.

    Only after `keep_freed_memory`: glibc's defaults already return large blocks as they are freed.
    """
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True


# PyTorch's oneDNN layer (ideep, LRU_CACHE_CAPACITY) and oneDNN itself (ONEDNN_PRIMITIVE_CACHE_CAPACITY)
# each keep up to 1,024 compiled kernels, one per shape. Token batches make thousands of shapes, and on a
# CPU with AMX the bfloat16 kernels hold megabytes each: two Multi30k trainings outgrew a 24 GB machine in
# 48 minutes. With 64 entries each a member stayed at 2.3 GB and trained as fast (75 updates in 100 s
# either way). Both libraries read the variables when they first build a kernel, so setting them after
# `import torch` still works: bfloat16 Linear forward+backward over 1,500 row counts on one thread of an
# AMX Xeon reached 2.9 GB resident with the defaults and 0.46 GB with the caps set either before or after
# the import.
KERNEL_CACHE_CAPACITY = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def cap_kernel_caches() -> dict[str, str]:
    """Cap oneDNN's kernel caches at `KERNEL_CACHE_CAPACITY` unless the environment already sets them;
    return the values in force. Effective only before this process builds its first oneDNN kernel."""
    return {name: os.environ.setdefault(name, value) for name, value in KERNEL_CACHE_CAPACITY.items()}


HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 (and on arm64 with 4 KiB base pages)
_ALIGN = 64  # bytes: a cache line, what MKL and oneDNN align their own buffers to


def on_huge_pages(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Copies of the CPU `tensors`, side by side in one private anonymous mapping that Linux is asked to
    back with transparent huge pages (madvise MADV_HUGEPAGE, which the usual THP setting "madvise"
    requires); the tensors themselves where that cannot be asked (not Linux, or a kernel without THP).

    A one-row product (greedy decoding of one sentence) reads its whole weight from memory at every
    step, 154 MB for the 37 products of a `base` decoder step: 37,600 pages of 4 KiB, each a TLB miss and
    a page-table walk, against 74 huge ones. Those 37 products, two threads of this project's AMD EPYC,
    the same weights on both kinds of pages, interleaved: 5.63 against 6.37 ms a step (median of 60;
    `benchmarks/one_row.py` measures it). The copies share the mapping, which lives as long as any of
    them (`torch.frombuffer` holds it); a huge page backs only a whole aligned 2 MiB, so small weights
    gain only side by side in one mapping, not each in its own.
    """
    tensors, advice = list(tensors), getattr(mmap, "MADV_HUGEPAGE", None)  # a generator is read once
    if not tensors or sys.platform != "linux" or advice is None:
        return tensors
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    # One huge page more than needed, to start on a huge page's boundary. Private: a shared anonymous
    # mapping is shmem, whose huge pages follow another setting (shmem_enabled, "never" by default).
    mapping = mmap.mmap(-1, end + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)  # before the copies touch the pages: they are faulted in huge
    except OSError:
        mapping.close()
        return tensors
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # (end + HUGE_PAGE,) bytes
    start = -arena.data_ptr() % HUGE_PAGE
    copies = []
    for t, offset in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        copy = arena[start + offset : start + offset + nbytes].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t.detach()))  # detached: a copy, not a view of a parameter in a graph
    return copies
