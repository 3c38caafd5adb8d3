"""scripts/gpu_check.sh: its shell part parses, and its dry run (`--device cpu`: every step with the
CPU on both sides) runs the whole check on the tiny target and reports each step as the GPU run would."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_script_parses():
    assert subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=ROOT).returncode == 0


@pytest.mark.integration
def test_dry_run_on_the_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EAGLE3_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--work", str(tmp_path / "w")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["device"] == "cpu"
    steps = summary["steps"]
    assert list(steps) == ["regenerate", "extract", "train", "decode"]
    assert all(s["cpu_s"] > 0 and s["device_s"] > 0 and s["ratio_cpu_over_device"] > 0 for s in steps.values())
    assert steps["extract"]["max_abs_diff"] == 0.0  # the same device twice: the same numbers
    assert steps["decode"]["lossless_on_device"] is True
    same, total = map(int, steps["regenerate"]["tokens_agreeing"].split("/"))
    assert same == total > 0


def test_refuses_cuda_where_torch_sees_none():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "sees no CUDA device" in r.stdout
