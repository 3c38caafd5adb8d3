"""Automation: the source sensor requests exactly the changed workload partition; the retrain sensor
waits for upstream work to settle and retrains once per batch of feature changes."""
import json

import pytest
from dagster import AssetKey, AssetMaterialization, DagsterInstance, build_sensor_context

from assets.sensors import RetrainPolicy, draft_retrain_sensor, workload_sources_sensor


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


def tick(sensor, instance, cursor=None):
    return sensor(build_sensor_context(instance=instance, cursor=cursor))


def test_source_change_requests_only_that_partition(instance, extra_dir):
    first = tick(workload_sources_sensor, instance)
    assert not first.run_requests  # never built: observing is not a reason to build
    seen = json.loads(first.cursor)
    assert sorted(seen) == ["chat", "code", "long_context", "math", "multi_turn"]
    assert {e.partition for e in first.asset_events} == set(seen)  # initial data versions recorded

    (extra_dir / "code").mkdir()
    (extra_dir / "code" / "team_prompts.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "Write a Python function that reverses a list."}]}) + "\n")
    second = tick(workload_sources_sensor, instance, first.cursor)
    assert [r.partition_key for r in second.run_requests] == ["code"]
    assert second.run_requests[0].tags["eagle3/trigger"] == "source_change"
    assert [(e.asset_key, e.partition) for e in second.asset_events] == [(AssetKey("workload_sources"), "code")]
    new_fp = json.loads(second.cursor)["code"]
    assert new_fp != seen["code"] and second.asset_events[0].tags["dagster/data_version"] == new_fp
    assert {w: v for w, v in json.loads(second.cursor).items() if w != "code"} == \
        {w: v for w, v in seen.items() if w != "code"}

    third = tick(workload_sources_sensor, instance, second.cursor)
    assert not third.run_requests  # nothing changed since


def test_fresh_sensor_compares_with_what_was_built(instance, extra_dir):
    """No cursor yet (new deployment): a partition built from other source data is rebuilt."""
    instance.report_runless_asset_event(AssetMaterialization(
        "filtered_prompts", partition="math", metadata={"source_fingerprint": "0" * 64}))
    res = tick(workload_sources_sensor, instance)
    assert [r.partition_key for r in res.run_requests] == ["math"]


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


def test_observing_the_source_asset_records_a_data_version_per_partition(instance, extra_dir):
    from dagster._core.definitions.observe import observe

    from assets.sources import workload_sources
    from eagle3_platform.data.sources import source_fingerprint

    assert observe([workload_sources], instance=instance).success
    recs = instance.fetch_observations(AssetKey("workload_sources"), limit=10).records
    got = {r.partition_key: r.asset_observation.tags["dagster/data_version"] for r in recs}
    assert got == {w: source_fingerprint(w) for w in ("chat", "multi_turn", "code", "math", "long_context")}
