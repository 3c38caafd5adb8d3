"""Compute settings shared by every stage: the dtype models run in and the torch thread count.

`auto` picks bfloat16 where the hardware computes it natively (CPU flags avx512_bf16 or AMX, or CUDA)
and float32 elsewhere: where bf16 is native a 5-token forward costs about what a 1-token one does,
while in fp32 it costs ~1.7x (docs/ARCHITECTURE.md §5), which decides whether speculation pays.
Exact greedy losslessness needs exact arithmetic: tests that assert it pin float32.

Two kinds of work read that differently. A decode or verify step multiplies a few rows by every
weight: memory-bound, so half the bytes win wherever bf16 is native. Dense work (feature extraction,
training: thousands of rows per weight) is compute-bound, and there the flag does not say enough: an
Intel CPU with avx512_bf16 but no AMX (a VM that hides AMX) multiplies bf16 no faster than fp32
(oneDNN runs its avx512_core_bf16 kernels), so there bf16 only saves memory traffic and loses on dense
work (head training and extraction ~1.5x slower than fp32), while CPUs with AMX or Zen 4 run it ~2x
faster. So for dense work `auto` measures: one matmul in both dtypes, once per machine (the result is
cached on disk, so a stage's dtype does not flip between runs), and bf16 only where it is clearly
faster.

Kernels differ by machine too: oneDNN's packed weights (packed_linear.py) beat torch's row-major
ones at every decode width in bf16 where it is native, but in fp32 on an Intel CPU whose VM hides
avx512_bf16 the row-major kernel is faster below 4 rows. Under `auto` a second probe finds that row
count per dtype (narrow_matmul_rows), kept in the same file.

A target whose weights lie on a 4-bit grid (the embedded SmolLM2 is a GGUF Q4_1) can multiply a few
rows on its codes (int4_weights.py): where decode runs in fp32 for want of native bf16, at bf16's
rounding and 1/8 of the fp32 bytes (a whole decode step ~1.6x faster); where it runs in bf16, at a
quarter of bf16's bytes (~1.4x faster at one row on AMX, where bf16's own kernels win from 5 rows).
Under `auto` a third probe, per decode dtype, finds below how many rows that wins (int4_matmul_rows);
those matmuls round like bf16 ones, which bench_decode's token agreement reports. Explicit dtypes keep
their arithmetic.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from eagle3_platform.store.paths import cache_root
from eagle3_platform.store.records import write_json_atomic

DTYPES = ("auto", "bfloat16", "float32")
WORK = ("decode", "dense")  # few rows per weight read (memory-bound) | many (compute-bound)
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DENSE_BF16_MIN_SPEEDUP = 1.1  # bf16 must beat fp32 by this much on dense work to be worth its rounding
PROBE_FILE = "compute_probe.json"
# Rows from which a bf16 linear multiplies in fp32 where bf16 arithmetic is slow (avx512_bf16 without
# AMX): from fewer rows fp32 slows plain steps; from 32 it costs no step and saves ~10-15% of batch
# 8-16 verifies and ~25% of a prefill.
WIDE_FP32_ROWS = 32
# Row counts the row-major probe tries. With avx512_bf16 hidden (fp32 decode) torch's row-major
# kernels beat oneDNN's packed ones at 1-3 rows; packed wins from 4 rows.
ROWMAJOR_PROBE_ROWS = (1, 2, 3, 4, 6, 8)
# Row counts the int4 probe tries: the kernel tiles rows by 4, so its cost steps at 5, 9, 13, ...
# On SmolLM2's MLP shapes without avx512_bf16 the codes are ~3x faster than fp32 at 1-4 rows and
# ~0.5x at 256.
INT4_PROBE_ROWS = (4, 8, 12, 16, 24, 32)
INT4_PROBE_COPIES = 6  # of the MLP's two weights: with hot weights fp32 looks 1.5-2x better than in a model


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first CPU's /proc/cpuinfo fields ({} where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """No flags known (not Linux): no native bf16 claimed."""
    return frozenset(_cpuinfo().get("flags", "").split())


def has_native_bf16(device: str = "cpu") -> bool:
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return any(f in cpu_flags() for f in CPU_BF16_FLAGS)


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' where torch sees a GPU, else 'cpu'; any other name as given."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, device: str = "cpu", work: str = "decode") -> str:
    """'auto' | 'bfloat16' | 'float32' -> the concrete dtype name the models run in, for `work`
    ('decode': serving, regeneration; 'dense': extraction, training)."""
    if name not in DTYPES:
        raise ValueError(f"compute dtype {name!r}: expected one of {DTYPES}")
    if work not in WORK:
        raise ValueError(f"work {work!r}: expected one of {WORK}")
    if name != "auto":
        return name
    if not has_native_bf16(device):
        return "float32"
    if work == "dense" and not device.startswith("cuda"):
        return "bfloat16" if dense_bf16_speedup() >= DENSE_BF16_MIN_SPEEDUP else "float32"
    return "bfloat16"


def kv_cache_dtype(name: str, device: str = "cpu") -> str:
    """The dtype of a decode batch's KV cache, in which its attention runs: the decode dtype, except
    fp32 where dense work resolves to fp32. Attention's matmuls (a few thousand multiply-adds per
    cached token) are dense work: where bf16 arithmetic is slow, fp32 attention over the same bf16
    keys and values is faster (Intel avx512_bf16 without AMX, SmolLM2 engine steps, 2 threads: batch 1
    6% faster, batch 4 5-10%, batch 8-16 0-3%, plain and 4-token verify steps alike), at twice the
    cache's bytes."""
    decode = resolve_dtype(name, device)
    return "float32" if "float32" in (decode, resolve_dtype(name, device, "dense")) else decode


def wide_matmul_rows(name: str, device: str = "cpu") -> int:
    """Rows from which a bf16 model's CPU linear layers multiply on an fp32 copy of their weights
    (packed_linear.PackedWeight); 0 = never. Under `auto` where decode runs in bf16 but dense work
    resolves to fp32: a matmul of many rows is dense work. Explicit dtypes keep their arithmetic."""
    if name != "auto" or not device.startswith("cpu"):
        return 0
    wide = resolve_dtype(name, device) == "bfloat16" and resolve_dtype(name, device, "dense") == "float32"
    return WIDE_FP32_ROWS if wide else 0


def narrow_matmul_rows(name: str, device: str = "cpu") -> int:
    """Rows below which a model's CPU linear layers multiply on their row-major weight instead of
    oneDNN's packed copy (packed_linear.PackedWeight); 0 = never. Under `auto` only, from the
    machine's probe (rowmajor_matmul_rows) in the decode dtype: a decode step's one row per sequence
    is where the kernels differ most. Explicit dtypes keep the packed kernels."""
    if name != "auto" or not device.startswith("cpu"):
        return 0
    return rowmajor_matmul_rows(resolve_dtype(name, device))


def int4_matmul_rows(name: str, device: str = "cpu") -> int:
    """Rows below which a CPU linear whose weights lie on a 4-bit grid multiplies on its codes
    (packed_linear.PackedWeight, int4_weights.py); 0 = never. Under `auto` only, from the machine's
    probe in the decode dtype (int4_probe_rows). Where decode runs in fp32 (no native bf16) the codes
    give bf16's speed at bf16's rounding; where it runs in bf16 they read a quarter of its bytes (a
    decode step 1.5x faster on an Intel Xeon with AMX; load_target takes the codes from the fp32
    weights, before they are rounded to bf16 and off the grid). Explicit dtypes keep their kernels."""
    if name != "auto" or not device.startswith("cpu"):
        return 0
    return int4_probe_rows(resolve_dtype(name, device))


def autocast(dtype: str, device: str = "cpu"):
    """bf16 autocast when `dtype` resolves to bfloat16 for dense work (training: parameters stay fp32,
    mixed precision), else a no-op context."""
    on = resolve_dtype(dtype, device, "dense") == "bfloat16"
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=on)


@functools.lru_cache(maxsize=1)
def dense_bf16_speedup() -> float:
    """fp32 time / bf16 time of a dense matmul on this CPU: read from the machine's probe file, or
    measured once (~0.2 s) and written there. Keyed by CPU model, flags and torch version."""
    return float(_probed("dense_bf16_speedup", lambda: round(_measure_dense_bf16_speedup(), 3)))


@functools.lru_cache(maxsize=4)
def rowmajor_matmul_rows(dtype: str) -> int:
    """Rows below which torch's row-major linear beats oneDNN's packed one for `dtype` on this CPU
    (0 = never): read from the machine's probe file, or measured once (~0.3 s) and written there."""
    return int(_probed(f"rowmajor_rows_{dtype}", lambda: _measure_rowmajor_rows(getattr(torch, dtype))))


@functools.lru_cache(maxsize=2)
def int4_probe_rows(dtype: str = "float32") -> int:
    """Rows below which torch's int4 kernel beats the faster `dtype` kernel (row-major or packed) on
    this CPU (0 = never): read from the machine's probe file, or measured once (~1 s) and written."""
    return int(_probed(f"int4_rows_{dtype}", lambda: _measure_int4_rows(getattr(torch, dtype))))


def _probed(name: str, measure):
    """The machine's probe entry `name`, measured and written on first use. Best effort: an
    unreadable or unwritable cache only means measuring again next time."""
    path = cache_root() / PROBE_FILE
    key = _machine_key()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    entry = known.get(key) if isinstance(known.get(key), dict) else {}
    if isinstance(entry.get(name), (int, float)):
        return entry[name]
    value = measure()
    known[key] = {**entry, name: value, "torch_threads": torch.get_num_threads()}
    try:
        write_json_atomic(path, known, indent=2)
    except OSError:
        pass
    return value


def _machine_key() -> str:
    text = "|".join([_cpuinfo().get("model name", ""), " ".join(sorted(cpu_flags())), torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _best_times(calls: dict, reps: int) -> dict:
    """Best time per call over `reps` rounds that interleave the calls (two warm-up rounds first)."""
    best = {k: float("inf") for k in calls}
    for rep in range(reps + 2):
        for k, call in calls.items():
            t0 = time.perf_counter()
            call()
            if rep >= 2:
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


@torch.inference_mode()
def _measure_dense_bf16_speedup(rows: int = 512, reps: int = 5) -> float:
    """Best of `reps` interleaved [rows,576]x[576,1536] matmuls per dtype (SmolLM2's MLP shape)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=gen)
    w = torch.randn(1536, 576, generator=gen)
    pairs = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    best = _best_times({dt: lambda a=a, b=b: [torch.nn.functional.linear(a, b) for _ in range(4)]
                        for dt, (a, b) in pairs.items()}, reps)
    return best[torch.float32] / best[torch.bfloat16]


@torch.inference_mode()
def _measure_rowmajor_rows(dtype: torch.dtype, reps: int = 5) -> int:
    """The fewest rows (of ROWMAJOR_PROBE_ROWS) at which SmolLM2's MLP matmuls ([M,576]x[576,3072],
    [M,1536]x[1536,576]) run no slower packed than row-major, best of `reps` interleaved; 0 where
    packed wins from one row (rows below the answer take the row-major kernel)."""
    from eagle3_platform.model.packed_linear import pack_weight, packed_matmul, packing_available

    if not packing_available():
        return 0
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype) for o, i in ((3072, 576), (576, 1536))]
    packed = [pack_weight(w) for w in weights]
    for rows in ROWMAJOR_PROBE_ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights]
        best = _best_times({
            "packed": lambda: [packed_matmul(x, p, None) for _ in range(4) for x, p in zip(xs, packed)],
            "rowmajor": lambda: [torch.nn.functional.linear(x, w) for _ in range(4) for x, w in zip(xs, weights)],
        }, reps)
        if best["packed"] <= best["rowmajor"]:
            return 0 if rows == ROWMAJOR_PROBE_ROWS[0] else rows
    return ROWMAJOR_PROBE_ROWS[-1]


@torch.inference_mode()
def _measure_int4_rows(dtype: torch.dtype = torch.float32, reps: int = 5) -> int:
    """One more than the most rows (of INT4_PROBE_ROWS, in order) at which SmolLM2's MLP matmuls
    ([M,576]x[576,3072], [M,1536]x[1536,576], weights on a random 4-bit grid) run faster on their
    codes than in `dtype` (the faster of row-major and packed), best of `reps` interleaved; 0 where
    `dtype` wins at the first. (The kernel's cost steps every 4 rows: winning at 12 means winning at 9-12.)"""
    from eagle3_platform.model.int4_weights import GROUP, LEVELS, grid_codes, int4_available, int4_matmul
    from eagle3_platform.model.packed_linear import pack_weight, packed_matmul, packing_available

    if not int4_available():
        return 0
    gen = torch.Generator().manual_seed(0)
    weights = []  # copies enough to leave the caches, as a model's 30 layers do (fp32: 64 MB)
    for o, i in ((3072, 576), (576, 1536)) * INT4_PROBE_COPIES:
        q = torch.randint(0, LEVELS + 1, (o, i // GROUP, GROUP), generator=gen).float()
        q[..., 0], q[..., 1] = 0, LEVELS  # each group spans the grid, as Q4_1's do
        d = (1 + torch.rand(o, i // GROUP, 1, generator=gen)) / 100  # [o, in/G, 1] steps
        lo = -8 * d * (1 + torch.rand(o, i // GROUP, 1, generator=gen) / 10)  # groups about 0
        weights.append((q * d + lo).reshape(o, i))
    codes = [grid_codes(w) for w in weights]
    if None in codes:
        raise AssertionError("the int4 probe's weights are off the grid")
    weights = [w.to(dtype) for w in weights]
    packed = [pack_weight(w) for w in weights] if packing_available() else None
    won = 0
    for rows in INT4_PROBE_ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights]
        calls = {
            "int4": lambda: [int4_matmul(x, c) for x, c in zip(xs, codes)],
            "rowmajor": lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)],
        }
        if packed:
            calls["packed"] = lambda: [packed_matmul(x, p, None) for x, p in zip(xs, packed)]
        best = _best_times(calls, reps)
        if min(t for k, t in best.items() if k != "int4") <= best["int4"]:
            break
        won = rows
    return won + 1 if won else 0


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
