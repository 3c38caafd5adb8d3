"""Compute settings shared by every stage: the dtype models run in and the torch thread count.

`auto` picks bfloat16 where the hardware computes it natively (CPU flags avx512_bf16 or AMX, or CUDA)
and float32 elsewhere: on this project's CPUs a 5-token bf16 forward costs what a 1-token one does,
while in fp32 it costs 1.74x (DESIGN.md §5), which decides whether speculation pays.
Exact greedy losslessness needs exact arithmetic: tests that assert it pin float32.
"""
from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch

DTYPES = ("auto", "bfloat16", "float32")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags known, so no native bf16 claimed
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16(device: str = "cpu") -> bool:
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return any(f in cpu_flags() for f in CPU_BF16_FLAGS)


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """'auto' | 'bfloat16' | 'float32' -> the concrete dtype name the models run in."""
    if name not in DTYPES:
        raise ValueError(f"compute dtype {name!r}: expected one of {DTYPES}")
    if name != "auto":
        return name
    return "bfloat16" if has_native_bf16(device) else "float32"


def torch_dtype(name: str, device: str = "cpu") -> torch.dtype:
    return getattr(torch, resolve_dtype(name, device))


def autocast(dtype: str, device: str = "cpu"):
    """bf16 autocast when `dtype` resolves to bfloat16 (parameters stay fp32: mixed precision), else a
    no-op context."""
    on = resolve_dtype(dtype, device) == "bfloat16"
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=on)


def resolve_threads(threads: int) -> int:
    """0 = every core this process may use (the step runs alone); >0 = pinned (servers share cores)."""
    if threads < 0:
        raise ValueError(f"torch threads must be >= 0, got {threads}")
    if threads:
        return threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_threads(threads: int) -> int:
    n = resolve_threads(threads)
    torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def threads(n: int | None):
    """Run the block on n torch threads (0 = every core; None = as it is), then restore the count.
    The count is process-wide: switch it only where one thread runs torch (a server's engine thread)."""
    if n is None:
        yield
        return
    prev = torch.get_num_threads()
    set_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
