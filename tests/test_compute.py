"""Compute dtype selection (auto -> bf16 only where the hardware has it) and thread counts."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3_platform.model import compute
from eagle3_platform.model.target import load_target


@pytest.fixture
def cpu_with(monkeypatch):
    def set_flags(*flags):
        monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"sse2", "avx2", *flags}))
    return set_flags


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(cpu_with, flag):
    cpu_with(flag)
    assert compute.resolve_dtype("auto") == "bfloat16"


def test_auto_is_fp32_on_a_cpu_without_bf16(cpu_with):
    cpu_with("avx512f")  # AVX-512 alone emulates bf16: slower than fp32
    assert compute.resolve_dtype("auto") == "float32"


@pytest.mark.parametrize("speedup,dense", [(0.55, "float32"), (1.05, "float32"), (2.0, "bfloat16")])
def test_dense_work_takes_bf16_only_where_the_probe_finds_it_faster(cpu_with, monkeypatch, speedup, dense):
    cpu_with("avx512_bf16")  # an Intel CPU without AMX has the flag and computes bf16 at fp32's rate
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: speedup)
    assert compute.resolve_dtype("auto", work="dense") == dense
    assert compute.resolve_dtype("auto") == compute.resolve_dtype("auto", work="decode") == "bfloat16"
    with compute.autocast("auto"):  # training's autocast is dense work
        assert torch.is_autocast_enabled("cpu") == (dense == "bfloat16")
    assert compute.resolve_dtype("bfloat16", work="dense") == "bfloat16"  # explicit wins
    with pytest.raises(ValueError, match="work"):
        compute.resolve_dtype("auto", work="prefill")


def test_dense_work_never_probes_without_native_bf16(cpu_with, monkeypatch):
    cpu_with("avx512f")
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: pytest.fail("probed"))
    assert compute.resolve_dtype("auto", work="dense") == "float32"


def test_dense_probe_runs_once_per_machine_and_is_kept_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(compute, "_measure_dense_bf16_speedup", lambda: calls.append(1) or 0.6)
    compute.dense_bf16_speedup.cache_clear()
    try:
        assert compute.dense_bf16_speedup() == 0.6 and len(calls) == 1
        compute.dense_bf16_speedup.cache_clear()  # a new process on the same machine: read, not measured
        assert compute.dense_bf16_speedup() == 0.6 and len(calls) == 1
        probe = json.loads((tmp_path / compute.PROBE_FILE).read_text())
        assert list(probe.values())[0]["dense_bf16_speedup"] == 0.6
        monkeypatch.setattr(compute, "_machine_key", lambda: "another-cpu")  # other CPU or torch
        compute.dense_bf16_speedup.cache_clear()
        assert compute.dense_bf16_speedup() == 0.6 and len(calls) == 2
        assert len(json.loads((tmp_path / compute.PROBE_FILE).read_text())) == 2
        (tmp_path / compute.PROBE_FILE).write_text("{not json")  # corrupt: measured again, rewritten
        compute.dense_bf16_speedup.cache_clear()
        assert compute.dense_bf16_speedup() == 0.6 and len(calls) == 3
        assert "another-cpu" in json.loads((tmp_path / compute.PROBE_FILE).read_text())
    finally:
        compute.dense_bf16_speedup.cache_clear()


def test_dense_probe_measures_a_ratio_of_matmul_times():
    r = compute._measure_dense_bf16_speedup(rows=16, reps=1)
    assert 0.02 < r < 50  # fp32 time / bf16 time: positive and finite whatever the CPU


def test_explicit_dtypes_win_over_the_probe(cpu_with):
    cpu_with()
    assert compute.resolve_dtype("bfloat16") == "bfloat16"
    cpu_with("avx512_bf16")
    assert compute.resolve_dtype("float32") == "float32"


def test_cuda_auto_follows_the_device_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert compute.resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert compute.resolve_dtype("auto", "cuda:0") == "float32"


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float16"):
        compute.resolve_dtype("float16")


def test_threads_zero_means_every_core_and_negative_is_refused():
    assert compute.resolve_threads(0) >= 1
    assert compute.resolve_threads(3) == 3
    with pytest.raises(ValueError):
        compute.resolve_threads(-1)


@pytest.mark.parametrize("speedup,want", [(0.55, "float32"), (2.0, "bfloat16")])
def test_kv_cache_is_fp32_where_dense_bf16_work_is_slow(cpu_with, monkeypatch, speedup, want):
    """A decode batch's cache (and its attention) is dense work in a bf16 model: fp32 where the probe
    finds bf16 matmuls slow, bf16 where they are fast; explicit dtypes and no-bf16 CPUs as ever."""
    cpu_with("avx512_bf16")
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: speedup)
    assert compute.resolve_dtype("auto") == "bfloat16"
    assert compute.kv_cache_dtype("auto") == want
    assert compute.kv_cache_dtype("bfloat16") == "bfloat16"
    assert compute.kv_cache_dtype("float32") == "float32"
    cpu_with("avx512f")
    assert compute.kv_cache_dtype("auto") == "float32"


@pytest.mark.parametrize("speedup,want", [(0.55, compute.WIDE_FP32_ROWS), (2.0, 0)])
def test_wide_bf16_matmuls_run_in_fp32_only_where_dense_bf16_work_is_slow(cpu_with, monkeypatch, speedup, want):
    cpu_with("avx512_bf16")
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: speedup)
    assert compute.wide_matmul_rows("auto") == want
    assert compute.wide_matmul_rows("bfloat16") == compute.wide_matmul_rows("float32") == 0
    assert compute.wide_matmul_rows("auto", "cuda") == 0
    cpu_with("avx512f")  # fp32 model: nothing to widen
    assert compute.wide_matmul_rows("auto") == 0


def test_narrow_matmuls_take_row_major_weights_under_auto_from_the_probe(cpu_with, monkeypatch):
    probed = []
    monkeypatch.setattr(compute, "rowmajor_matmul_rows", lambda dtype: probed.append(dtype) or 4)
    cpu_with("avx512f")
    assert compute.narrow_matmul_rows("auto") == 4 and probed == ["float32"]  # the decode dtype's
    cpu_with("avx512_bf16")
    assert compute.narrow_matmul_rows("auto") == 4 and probed[-1] == "bfloat16"
    assert compute.narrow_matmul_rows("float32") == compute.narrow_matmul_rows("bfloat16") == 0
    assert compute.narrow_matmul_rows("auto", "cuda") == 0 and len(probed) == 2


def test_probes_share_the_machine_entry_on_disk(monkeypatch, tmp_path):
    """Each probe is measured once per machine and dtype and kept beside the others."""
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(compute, "_measure_dense_bf16_speedup", lambda: calls.append("dense") or 0.6)
    monkeypatch.setattr(compute, "_measure_rowmajor_rows", lambda dt: calls.append(dt) or 3)
    for probe in (compute.dense_bf16_speedup, compute.rowmajor_matmul_rows):
        probe.cache_clear()
    try:
        assert compute.rowmajor_matmul_rows("float32") == 3 and compute.dense_bf16_speedup() == 0.6
        compute.rowmajor_matmul_rows.cache_clear()  # a new process: read, not measured
        assert compute.rowmajor_matmul_rows("float32") == 3 and calls == [torch.float32, "dense"]
        assert compute.rowmajor_matmul_rows("bfloat16") == 3 and calls[-1] is torch.bfloat16
        entry = list(json.loads((tmp_path / compute.PROBE_FILE).read_text()).values())[0]
        assert entry["rowmajor_rows_float32"] == entry["rowmajor_rows_bfloat16"] == 3
        assert entry["dense_bf16_speedup"] == 0.6
    finally:
        for probe in (compute.dense_bf16_speedup, compute.rowmajor_matmul_rows):
            probe.cache_clear()


def test_rowmajor_probe_answers_a_probed_row_count():
    assert compute._measure_rowmajor_rows(torch.float32, reps=1) in {0, *compute.ROWMAJOR_PROBE_ROWS[1:]}


def test_autocast_is_on_only_for_bf16(cpu_with):
    cpu_with()
    with compute.autocast("auto"):
        assert not torch.is_autocast_enabled("cpu")
    with compute.autocast("bfloat16"):
        assert torch.is_autocast_enabled("cpu")
        out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype is torch.bfloat16


@pytest.mark.parametrize("flags,want", [(("avx512_bf16",), torch.bfloat16), ((), torch.float32)])
def test_target_loads_in_the_resolved_dtype_and_records_it(cpu_with, tiny_target_dir, monkeypatch, flags, want):
    cpu_with(*flags)
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: 0.5)  # bf16 matmuls slow: fp32 cache
    monkeypatch.setattr(compute, "rowmajor_matmul_rows", lambda dtype: 3)
    monkeypatch.setattr(compute, "int4_probe_rows", lambda dtype: 9)  # unused: the tiny target is off the grid
    t = load_target(tiny_target_dir, dtype="auto")
    assert next(t.model.parameters()).dtype is want
    assert t.meta["dtype"] == str(want).removeprefix("torch.")
    assert t.meta["kv_cache_dtype"] == "float32"
    assert t.meta["wide_fp32_rows"] == (compute.WIDE_FP32_ROWS if want is torch.bfloat16 else 0)
    assert t.meta["rowmajor_rows"] == 3  # the probe's answer (mocked), kept beside the packed weights
    down = t.model.model.layers[0].mlp.down_proj.weight_packed
    assert down.narrow_rows == 3 and down.rowmajor.dtype is want
    from eagle3_platform.spec.config import PRESETS
    from eagle3_platform.spec.engine import SpecEngine
    assert SpecEngine(t, None, PRESETS["baseline"]).batch().cache.kv_dtype is torch.float32


def test_threads_block_runs_on_n_threads_and_restores_the_count():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with compute.threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with compute.threads(0):
            assert torch.get_num_threads() == compute.resolve_threads(0)
        with compute.threads(None):
            assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), compute.threads(2):
            raise RuntimeError("the count is restored on errors too")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)
