"""The whole graph on the tiny target through Dagster, started the way users start it: `eagle3 run`
(which runs `python -m assets.launch` in a child process). Its runs are runs of the named jobs, in the
instance the UI reads. Then a second run skips every step Dagster reports up to date, and a third
rebuilds only the step whose stored output went missing."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _eagle3_run(tmp_path, target_dir, *extra):
    env = {**os.environ, "EAGLE3_CACHE": str(tmp_path / "cache"), "EAGLE3_WORK_DIR": str(tmp_path / "work"),
           "EAGLE3_ENV": "local", "EAGLE3_SERVING": "embedded",
           "EAGLE3_BENCH_DURATION_S": "20"}  # the tiny preset's 4 s cells finish no request on a loaded CPU
    env.pop("DAGSTER_HOME", None)
    cmd = [sys.executable, "-m", "eagle3_platform.cli", "run", "--preset", "tiny", "--target", str(target_dir),
           "--workloads", "code", "--data-dir", str(tmp_path / "data"),
           "--dagster-home", str(tmp_path / "dagster_home"), *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.integration
def test_whole_graph_on_tiny_target_through_dagster(tmp_path, tiny_target_dir):
    summary, log = _eagle3_run(tmp_path, tiny_target_dir)
    assert summary["ok"] and summary["through"] == "benchmark_report"
    steps = [s["step"] for s in summary["steps"]]
    assert steps == ["partition:code", "draft_vocab", "draft_head", "deployment", "benchmark_report"]
    data = tmp_path / "data"
    for rel in ("code/filtered_prompts/train/kept.jsonl", "code/target_responses/train/conversations.jsonl",
                "code/features/train/manifest.parquet", "draft/vocab/vocab.safetensors",
                "draft/export/config.json", "draft/export/model.safetensors", "deployment/deployment.json",
                "bench/report/report.md", "bench/report/results.json"):
        assert (data / rel).exists(), rel
    assert json.loads((data / "draft/export/config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert any(k.startswith("benchmark_report") and v.endswith("report.md") for k, v in summary["outputs"].items())
    assert "done in" in log and (tmp_path / "dagster_home" / "dagster.yaml").exists()
    assert summary["headline"] and summary["wall_s"] > 0  # the benchmark's figures, from Dagster's records
    assert not list((tmp_path / "dagster_home").glob("*state*.json"))  # Dagster's records decide, no own file

    # The runs are in the persistent instance the UI reads, as runs of the named jobs of its code location.
    os.environ["DAGSTER_HOME"] = str(tmp_path / "dagster_home")
    try:
        from dagster import AssetKey, DagsterInstance

        with DagsterInstance.get() as inst:
            for name in ("filtered_prompts", "feature_shards", "draft_head", "benchmark_report"):
                assert inst.fetch_materializations(AssetKey(name), limit=1).records, name
            runs = inst.get_runs()
            assert {r.job_name for r in runs} == {"observe_workload_sources", "workload_refresh", "draft_retrain",
                                                  "deploy_and_benchmark"}
            assert all(r.remote_job_origin.location_name == "definitions" for r in runs)
            assert all(r.tags["eagle3/preset"] == "tiny" and r.tags["eagle3/target"] == summary["target"]
                       for r in runs)
            assert {r.tags.get("dagster/partition") for r in runs if r.job_name == "workload_refresh"} == {"code"}
    finally:
        os.environ.pop("DAGSTER_HOME", None)

    again, _ = _eagle3_run(tmp_path, tiny_target_dir, "--through", "draft_head")
    assert all(s.get("skipped") for s in again["steps"]), again["steps"]
    shutil.rmtree(data / "draft/vocab")  # an output Dagster recorded (vocab_uri) is gone: rebuilt alone
    third, _ = _eagle3_run(tmp_path, tiny_target_dir, "--through", "draft_vocab")
    assert [s.get("materialized") for s in third["steps"]] == [None, ["draft_vocab"]]
