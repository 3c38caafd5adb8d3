"""`draft_head` through Dagster with `compute.train_procs = 2`: the training stage runs as
`torchrun --nproc_per_node 2` (gloo ranks on the CPU) in a Pipes worker, gives the head the in-process
run gives (within float tolerance), and resumes after SIGKILL from its checkpoint.

Each materialization runs in its own process (the one that is killed must be, with torchrun's agent;
the ranks, in sessions of their own, must die with the agent); a sitecustomize on
their PYTHONPATH stretches the tiny preset's training (more epochs, a checkpoint every 2 steps) in
every process, torchrun's ranks included, so there is a checkpoint to kill after."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from dagster import DagsterInstance
from safetensors.torch import load_file

from dagster_helpers import meta, run, tiny_resources
from resources import StorageResource

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = "code"
SITECUSTOMIZE = textwrap.dedent("""
    import dataclasses, os
    if os.environ.get("EAGLE3_TEST_LONG_TINY_TRAIN"):
        import eagle3_platform.draft.train as t
        t.PRESETS["tiny"] = dataclasses.replace(t.PRESETS["tiny"], epochs=10, ckpt_every=2, log_every=5)
""")
DRIVER = textwrap.dedent("""
    import json, sys
    from dagster import DagsterInstance
    sys.path.insert(0, "tests")
    from dagster_helpers import meta, run, tiny_resources
    from resources import ComputeResource, StorageResource
    root, target, procs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    res = tiny_resources(StorageResource(root=root), target)
    res["compute"] = ComputeResource(train_procs=procs)
    with DagsterInstance.ephemeral() as inst:
        m = meta(run(["draft_head"], res, inst), "draft_head")
    print("RESULT " + json.dumps({k: m[k] for k in ("resumed_from", "world_size", "steps") if k in m}))
""")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def upstream(tiny_target_dir, tmp_path_factory):
    """Features and the vocab of one partition, built once in process."""
    root = tmp_path_factory.mktemp("torchrun") / "upstream"
    res = tiny_resources(StorageResource(root=str(root)), tiny_target_dir)
    with DagsterInstance.ephemeral() as inst:
        run(["filtered_prompts", "target_responses", "feature_shards"], res, inst, WORKLOAD)
        run(["draft_vocab"], res, inst)
    return root


def driver_env(tmp_path: Path) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp_path / "driver.py").write_text(DRIVER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "OMP_NUM_THREADS": "1",
            "EAGLE3_TEST_LONG_TINY_TRAIN": "1"}


def materialize_in_child(tmp_path, root, target, procs, wait=True):
    cmd = [sys.executable, str(tmp_path / "driver.py"), str(root), str(target), str(procs)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=driver_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)  # its own group: torchrun and the ranks die with it
    if not wait:
        return p
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def head(root: Path) -> dict:
    return load_file(str(root / "draft" / "checkpoint" / "draft.safetensors"))


def test_torchrun_head_equals_in_process_and_resumes_after_sigkill(upstream, tiny_target_dir, tmp_path):
    ref_root, ddp_root = tmp_path / "ref", tmp_path / "ddp"
    shutil.copytree(upstream, ref_root)
    shutil.copytree(upstream, ddp_root)
    ref = materialize_in_child(tmp_path, ref_root, tiny_target_dir, 1)
    assert ref["world_size"] == 1 and ref["steps"] > 8  # the stretched preset: a run long enough to kill

    p = materialize_in_child(tmp_path, ddp_root, tiny_target_dir, 2, wait=False)
    deadline, state = time.time() + 300, None
    try:
        while time.time() < deadline and p.poll() is None:
            found = list((ddp_root / ".staging").glob("**/checkpoint/state.json"))
            try:
                if found and json.loads(found[0].read_text())["step"] >= 4:
                    state = found[0]
                    break
            except (json.JSONDecodeError, KeyError, FileNotFoundError):
                pass
            time.sleep(0.02)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the driver's group: Dagster and torchrun's agent
        try:  # the ranks run in sessions of their own (torchrun's) and hold the pipes until they die
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("torchrun's ranks outlived the killed run (they must die with their agent)")
    assert p.returncode == -signal.SIGKILL, f"the run ended before it could be killed:\n{err[-2000:]}"
    assert state is not None
    step_at_kill = json.loads(state.read_text())["step"]
    assert 0 < step_at_kill < ref["steps"]
    assert not (ddp_root / "draft" / "checkpoint").exists()  # nothing published by the killed run

    resumed = materialize_in_child(tmp_path, ddp_root, tiny_target_dir, 2)
    assert resumed["world_size"] == 2 and resumed["steps"] == ref["steps"]
    assert resumed["resumed_from"] == step_at_kill
    a, b = head(ref_root), head(ddp_root)
    assert set(a) == set(b)
    # 2 ranks compute the 1-process gradient of each global batch (loss normalised by the global count);
    # reductions in another order differ by rounding, a wrong split or a lost step by ~lr
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)
