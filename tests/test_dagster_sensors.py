"""Automation: a source change re-materializes exactly the changed workload partition and what was built
downstream of it (declarative conditions); the retrain sensor waits for upstream work to settle and
retrains once per batch of feature changes."""
import json

import pytest
from dagster import (AssetKey, AssetMaterialization, DagsterInstance, build_sensor_context,
                     evaluate_automation_conditions)

from assets.sensors import RetrainPolicy, draft_retrain_sensor


@pytest.fixture()
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture()
def extra_dir(tmp_path, monkeypatch):
    d = tmp_path / "extra"
    d.mkdir()
    monkeypatch.setenv("EAGLE3_EXTRA_SOURCES", str(d))
    return d


@pytest.fixture(scope="module")
def defs():
    from definitions import build_definitions

    return build_definitions(preset="tiny", target="tiny-random")


def tick(sensor, instance, cursor=None):
    return sensor(build_sensor_context(instance=instance, cursor=cursor))


def observe(defs, instance) -> dict:
    assert defs.resolve_job_def("observe_workload_sources").execute_in_process(instance=instance).success
    recs = instance.fetch_observations(AssetKey("workload_sources"), limit=50).records
    latest = {}
    for r in reversed(recs):  # oldest first: the newest observation of each partition wins
        latest[r.partition_key] = r.asset_observation.tags["dagster/data_version"]
    return latest


def requested(result) -> dict:
    return {r.key.to_user_string(): sorted(result.get_requested_partitions(r.key))
            for r in result.results if result.get_num_requested(r.key)}


def test_source_change_rebuilds_only_that_partition_and_downstream(defs, instance, extra_dir):
    from eagle3_platform.data.sources import source_fingerprint

    seen = observe(defs, instance)
    assert seen == {w: source_fingerprint(w) for w in ("chat", "multi_turn", "code", "math", "long_context")}
    for w in ("code", "math"):  # built after that observation: prompts + responses, no features
        for name in ("filtered_prompts", "target_responses"):
            instance.report_runless_asset_event(AssetMaterialization(name, partition=w))
    first = evaluate_automation_conditions(defs, instance)
    assert requested(first) == {}  # nothing changed; never-built partitions are not built

    (extra_dir / "code").mkdir()
    (extra_dir / "code" / "team_prompts.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "Write a Python function that reverses a list."}]}) + "\n")
    after = observe(defs, instance)
    assert after["code"] != seen["code"] and {w: v for w, v in after.items() if w != "code"} == \
        {w: v for w, v in seen.items() if w != "code"}
    second = evaluate_automation_conditions(defs, instance, cursor=first.cursor)
    assert requested(second) == {"filtered_prompts": ["code"], "target_responses": ["code"]}

    third = evaluate_automation_conditions(defs, instance, cursor=second.cursor)
    assert requested(third) == {}  # handled: not requested again


def test_sources_are_observed_on_a_cron_tick(defs):
    graph = defs.resolve_asset_graph()
    cond = graph.get(AssetKey("workload_sources")).automation_condition
    assert cond is not None and "cron" in str(cond).lower()
    for name in ("filtered_prompts", "target_responses", "feature_shards"):
        assert graph.get(AssetKey(name)).automation_condition is not None
    assert {s.name for s in defs.sensors} == {"draft_retrain_sensor"}  # the one thing a condition cannot do


def _features_materialized(instance, workloads):
    for w in workloads:
        instance.report_runless_asset_event(AssetMaterialization("feature_shards", partition=w))


def test_retrain_waits_for_backfill_then_runs_once(instance, monkeypatch):
    from dagster import DagsterRun, DagsterRunStatus

    monkeypatch.setattr("assets.sensors.RETRAIN", RetrainPolicy(interval_s=1, quiet_s=0))
    assert tick(draft_retrain_sensor, instance).run_requests == []  # no features at all

    _features_materialized(instance, ["chat", "code"])
    # a backfill run of the remaining partitions is still in flight → wait
    instance.add_run(DagsterRun(job_name="workload_refresh", run_id="r-inflight",
                                status=DagsterRunStatus.STARTED,
                                asset_selection=frozenset({AssetKey("feature_shards")})))
    waiting = tick(draft_retrain_sensor, instance)
    assert not waiting.run_requests and "in flight" in str(waiting.skip_reason)

    instance.report_run_canceled(instance.get_run_by_id("r-inflight"))
    _features_materialized(instance, ["math", "multi_turn", "long_context"])
    go = tick(draft_retrain_sensor, instance)
    assert len(go.run_requests) == 1  # five partitions changed, one retrain
    again = tick(draft_retrain_sensor, instance, go.cursor)
    assert not again.run_requests

    _features_materialized(instance, ["code"])
    assert len(tick(draft_retrain_sensor, instance, go.cursor).run_requests) == 1


def test_retrain_cooldown_after_latest_features(instance, monkeypatch):
    monkeypatch.setattr("assets.sensors.RETRAIN", RetrainPolicy(interval_s=1, quiet_s=3600))
    _features_materialized(instance, ["chat"])
    res = tick(draft_retrain_sensor, instance)
    assert not res.run_requests and "old" in str(res.skip_reason)
