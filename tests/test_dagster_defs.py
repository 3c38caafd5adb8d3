"""The Dagster definitions load: as the code location `dagster dev -w workspace.yaml` loads, and
in-process (graph, partitions, jobs, checks, sensors, resources, environment selection)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = {"workload_sources", "filtered_prompts", "target_responses", "feature_shards", "draft_vocab",
          "draft_head", "deployment", "benchmark_report"}


def test_definitions_resolve_in_process():
    from dagster import AssetKey

    from definitions import defs

    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == ASSETS
    part = graph.get(AssetKey("filtered_prompts")).partitions_def
    assert part.get_partition_keys() == ["chat", "multi_turn", "code", "math", "long_context"]
    for name in ("target_responses", "feature_shards"):
        assert graph.get(AssetKey(name)).partitions_def == part
    for name in ("draft_vocab", "draft_head", "deployment", "benchmark_report"):
        assert graph.get(AssetKey(name)).partitions_def is None
    # lineage: prompts → responses → features → vocab → head
    assert AssetKey("workload_sources") in graph.get(AssetKey("filtered_prompts")).parent_keys
    assert AssetKey("feature_shards") in graph.get(AssetKey("draft_vocab")).parent_keys
    assert {AssetKey("draft_vocab"), AssetKey("feature_shards")} <= graph.get(AssetKey("draft_head")).parent_keys
    checks = {(c.asset_key.to_user_string(), c.name) for c in graph.asset_check_keys}
    assert ("draft_head", "draft_head_acceptance") in checks
    assert ("feature_shards", "shards_verify") in checks
    for job in ("observe_workload_sources", "workload_refresh", "draft_retrain", "deploy_and_benchmark"):
        assert defs.resolve_job_def(job) is not None
    # every asset `eagle3 run` builds has the named job it launches for it
    from assets.jobs import JOB_OF

    assert set(JOB_OF) == {k.to_user_string() for k in graph.materializable_asset_keys}
    for name, job in JOB_OF.items():
        assert AssetKey(name) in defs.resolve_job_def(job).asset_layer.selected_asset_keys, (name, job)
    assert {s.name for s in defs.sensors} == {"draft_retrain_sensor"}
    assert set(defs.resources) >= {"storage", "target", "preset", "compute", "serving"}


def test_code_versions_follow_code_and_settings():
    """code_version = hash(the asset's code + the settings it resolves), so the UI shows what is stale
    (how the code is derived: tests/test_versions.py)."""
    from assets.versions import AREAS, code_version
    from definitions import build_definitions
    from resources import PresetResource, TargetResource

    graph = build_definitions(preset="tiny", target="tiny-random").resolve_asset_graph()
    versions = {k.to_user_string(): graph.get(k).code_version for k in graph.materializable_asset_keys}
    assert set(versions) == set(AREAS) and all(v and v != "1" for v in versions.values())
    t = TargetResource(model="tiny-random")
    tiny, bf16 = PresetResource(name="tiny"), PresetResource(name="tiny", dtype="bfloat16")
    assert versions["draft_head"] == code_version("draft_head", tiny, t)  # deterministic
    assert code_version("draft_head", PresetResource(name="demo"), t) != versions["draft_head"]
    assert code_version("target_responses", bf16, t) != code_version("target_responses", tiny, t)
    assert code_version("filtered_prompts", bf16, t) == code_version("filtered_prompts", tiny, t)  # no model
    assert code_version("feature_shards", tiny, TargetResource(model="other")) != code_version("feature_shards", tiny, t)
    # a raised regeneration budget makes the responses stale but resumes their staging output
    budget = PresetResource(name="tiny", regen_time_budget_s=600)
    assert code_version("target_responses", budget, t) != code_version("target_responses", tiny, t)
    assert code_version("feature_shards", budget, t) == code_version("feature_shards", tiny, t)
    assert code_version("filtered_prompts", budget, t) == code_version("filtered_prompts", tiny, t)
    assert budget.staging_key("abc") == tiny.staging_key("abc")
    # ...and an output made under one budget may be continued under another, under no other change
    assert (code_version("target_responses", budget, t, continuable=False)
            == code_version("target_responses", tiny, t, continuable=False))
    assert (code_version("target_responses", bf16, t, continuable=False)
            != code_version("target_responses", tiny, t, continuable=False))
    assert PresetResource(name="cpu", regen_time_budget_s=0).config().regen.time_budget_s is None


def test_environment_selection(monkeypatch):
    from resources import build_resources

    monkeypatch.delenv("EAGLE3_ENV", raising=False)
    assert not build_resources()["storage"].root.startswith("gs://")
    monkeypatch.setenv("EAGLE3_ENV", "gcp")
    monkeypatch.setenv("EAGLE3_GCS_BUCKET", "b")
    res = build_resources(preset="tiny", target="tiny-random")
    assert res["storage"].root == "gs://b/eagle3"
    assert res["preset"].name == "tiny" and res["target"].model == "tiny-random"
    monkeypatch.delenv("EAGLE3_GCS_BUCKET")
    with pytest.raises(ValueError, match="EAGLE3_GCS_BUCKET"):
        build_resources()
    monkeypatch.setenv("EAGLE3_ENV", "moon")
    with pytest.raises(ValueError, match="EAGLE3_ENV"):
        build_resources()


def test_preset_resource_reads_area_configs():
    from eagle3_platform.config import preset
    from resources import PresetResource

    tiny = PresetResource(name="tiny")
    assert tiny.area("sources") is preset("tiny").sources and tiny.area("sources").limit is not None
    assert tiny.area("train").draft_vocab_size > 0
    assert tiny.compute() == {} and tiny.identity() == "tiny"
    bf16 = PresetResource(name="tiny", dtype="bfloat16", torch_threads=1)
    assert bf16.compute() == {"dtype": "bfloat16", "torch_threads": 1}
    assert bf16.staging_key("abc") != tiny.staging_key("abc")  # other settings: a fresh staging dir
    with pytest.raises(ValueError, match="unknown preset"):
        PresetResource(name="huge").area("train")


def test_head_staging_follows_the_training_recipe(monkeypatch):
    """A preset whose training recipe changed (an upgrade while a training was killed) trains in a
    fresh staging dir: its old checkpoint was written for other settings and would be refused."""
    from dataclasses import replace

    from assets.draft import train_settings_hash
    from eagle3_platform.draft import train
    from resources import PresetResource, TargetResource

    cpu, t = PresetResource(name="cpu"), TargetResource(model="tiny-random")
    before = train_settings_hash(cpu, t)
    assert train_settings_hash(PresetResource(name="cpu"), t) == before  # deterministic: resumes
    monkeypatch.setitem(train.PRESETS, "cpu", replace(train.PRESETS["cpu"], epochs=7))
    assert train_settings_hash(cpu, t) != before


def test_every_preset_has_an_acceptance_gate():
    from assets.checks import GATES
    from eagle3_platform.config import PRESET_NAMES

    assert set(GATES) == set(PRESET_NAMES)  # a preset without one fails its blocking check (KeyError)


@pytest.mark.integration
def test_dagster_definitions_validate_cli(tmp_path):
    from resources.instance import ensure_dagster_home

    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "dh")}
    old = os.environ.get("DAGSTER_HOME")
    try:
        home = ensure_dagster_home(tmp_path / "dh")
    finally:
        os.environ.pop("DAGSTER_HOME") if old is None else os.environ.__setitem__("DAGSTER_HOME", old)
    assert "enabled: false" in (home / "dagster.yaml").read_text()
    r = subprocess.run([sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Validation successful" in r.stderr + r.stdout


def test_serving_resource_passes_a_thread_override_to_the_embedded_server():
    from resources.serving import _thread_flags

    assert _thread_flags(None) == []  # the serve preset's own (demo/cpu: target and head every core)
    assert _thread_flags(0) == ["--threads", "0"]  # serve: target and head every core
    assert _thread_flags(1) == ["--threads", "1"]  # serve: every role on one thread


def test_serving_resource_sglang_settings():
    """GPU path: the EAGLE-3 endpoint gets all three speculative ints (preset or resource), the
    baseline none; auto picks the embedded server on a CPU machine."""
    from resources import ServingResource

    s = ServingResource(mode="sglang", port=31000)
    cmd = s.sglang_config("/t", "/export", "demo").build_command("python")
    assert cmd[cmd.index("--speculative-draft-model-path") + 1] == "/export"
    assert {"--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"} <= set(cmd)
    assert cmd[cmd.index("--port") + 1] == "31000"
    base = s.sglang_config("/t", None, "demo").build_command("python")
    assert not any(a.startswith("--speculative") for a in base)
    tree = ServingResource(mode="sglang", num_steps=5, eagle_topk=4, num_draft_tokens=16)
    cmd = tree.sglang_config("/t", "/export", "demo").build_command("python")
    assert cmd[cmd.index("--speculative-eagle-topk") + 1] == "4"
    import torch

    if not torch.cuda.is_available():
        assert ServingResource().resolved_mode() == "embedded"


def test_an_older_dagster_home_gains_the_templates_missing_settings(tmp_path, monkeypatch):
    import yaml

    from resources.instance import ensure_dagster_home

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # ensure_dagster_home exports it; monkeypatch restores
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\nrun_queue:\n  max_concurrent_runs: 3\n")
    ensure_dagster_home(tmp_path)
    ensure_dagster_home(tmp_path)  # idempotent: nothing appended twice
    text = (tmp_path / "dagster.yaml").read_text()
    cfg = yaml.safe_load(text)
    assert cfg["run_queue"]["max_concurrent_runs"] == 3  # the user's own setting is kept
    assert cfg["python_logs"]["managed_python_loggers"] == ["eagle3_platform.progress"]
    assert cfg["run_monitoring"]["enabled"] is True and text.count("python_logs") == 1
