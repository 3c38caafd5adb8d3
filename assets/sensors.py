"""Automation.

`workload_sources_sensor`: observes `workload_sources` (content hash per workload), records each new
data version as an observation, and re-materializes exactly the changed partitions downstream
(prompts → responses → features).

`draft_retrain_sensor`: retrains the head when feature shards changed, with a cooldown: it waits
until no run or backfill touching the partitioned assets is in flight and the newest feature
materialization is at least `quiet_s` old, so a five-partition backfill retrains once.
"""

import json
import time
from dataclasses import dataclass

from dagster import (AssetKey, AssetObservation, DagsterRunStatus, DefaultSensorStatus, RunRequest,
                     RunsFilter, SensorEvaluationContext, SensorResult, SkipReason, sensor)

from assets.jobs import PARTITIONED, draft_job, workload_job

DATA_VERSION_TAG = "dagster/data_version"


@dataclass(frozen=True)
class RetrainPolicy:
    interval_s: int = 60  # how often the sensor looks
    quiet_s: int = 120  # newest feature materialization must be this old (a backfill has settled)


RETRAIN = RetrainPolicy()
IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED]


def _materialized_fingerprint(instance, workload: str) -> str | None:
    """The source fingerprint the latest filtered_prompts materialization of a partition was built from."""
    from dagster import AssetRecordsFilter

    recs = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey("filtered_prompts"), asset_partitions=[workload]), limit=1)
    if not recs.records:
        return None
    meta = recs.records[0].asset_materialization.metadata
    v = meta.get("source_fingerprint")
    return getattr(v, "value", v)


@sensor(job=workload_job, minimum_interval_seconds=60, default_status=DefaultSensorStatus.STOPPED,
        description="Re-materialize a workload partition (and downstream) when its sources change.")
def workload_sources_sensor(context: SensorEvaluationContext) -> SensorResult:
    from assets.sources import fingerprints

    seen = json.loads(context.cursor) if context.cursor else {}
    current = fingerprints()
    requests, events = [], []
    for w, fp in current.items():
        before = seen.get(w) or _materialized_fingerprint(context.instance, w)
        if before != fp:
            events.append(AssetObservation("workload_sources", partition=w, tags={DATA_VERSION_TAG: fp}))
        if before is not None and before != fp:  # first sight of a never-built partition: no run
            requests.append(RunRequest(run_key=f"{w}:{fp[:16]}", partition_key=w,
                                       tags={"eagle3/trigger": "source_change"}))
            context.log.info(f"{w}: source fingerprint {before[:12]} → {fp[:12]}; re-materializing")
    return SensorResult(run_requests=requests, asset_events=events, cursor=json.dumps(current),
                        skip_reason=None if requests else SkipReason("no source changed"))


def _partitioned_work_in_flight(instance) -> bool:
    from dagster._core.execution.backfill import BulkActionStatus

    keys = {AssetKey(k) for k in PARTITIONED}
    for run in instance.get_runs(filters=RunsFilter(statuses=IN_FLIGHT)):
        if run.asset_selection is None or keys & set(run.asset_selection):
            return True
    return any(keys & set(b.asset_selection or ())
               for b in instance.get_backfills(status=BulkActionStatus.REQUESTED))


@sensor(job=draft_job, minimum_interval_seconds=RETRAIN.interval_s,
        default_status=DefaultSensorStatus.STOPPED,
        description="Retrain the draft head once feature shards changed and upstream work settled.")
def draft_retrain_sensor(context: SensorEvaluationContext) -> SensorResult:
    recs = context.instance.fetch_materializations(AssetKey("feature_shards"), limit=1).records
    if not recs:
        return SensorResult(skip_reason=SkipReason("no feature shards yet"))
    newest = recs[0]
    last = int(context.cursor) if context.cursor else 0
    if newest.storage_id <= last:
        return SensorResult(skip_reason=SkipReason("feature shards unchanged since the last retrain"))
    if _partitioned_work_in_flight(context.instance):
        return SensorResult(skip_reason=SkipReason("feature work still in flight; waiting (cooldown)"))
    age = time.time() - newest.timestamp
    if age < RETRAIN.quiet_s:
        return SensorResult(skip_reason=SkipReason(f"newest features {age:.0f}s old < {RETRAIN.quiet_s}s"))
    return SensorResult(run_requests=[RunRequest(run_key=f"retrain:{newest.storage_id}",
                                                 tags={"eagle3/trigger": "features_changed"})],
                        cursor=str(newest.storage_id))
