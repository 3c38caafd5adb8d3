"""Automation.

Declarative, where a condition expresses it: `workload_sources` is observed on a cron tick (its data
version per partition is the content hash of that workload's source files), and a partitioned asset
re-materializes a partition when what it was built from changed (a new source data version, or a
rebuilt upstream partition): the changed partition and everything downstream of it, nothing else.
Partitions never built are not built by automation: observing a source is not a reason to build.

`draft_retrain_sensor` (a sensor, because a condition cannot wait for quiet): retrains the head when
feature shards changed, with a cooldown: it waits until no run or backfill touching the partitioned
assets is in flight and the newest feature materialization is at least `quiet_s` old, so a
five-partition backfill retrains once.
"""

import time
from dataclasses import dataclass

from dagster import (AssetKey, AutomationCondition, DagsterRunStatus, DefaultSensorStatus, RunRequest,
                     RunsFilter, SensorEvaluationContext, SensorResult, SkipReason, sensor)

from assets.jobs import PARTITIONED, draft_job

OBSERVE_SOURCES = AutomationCondition.cron_tick_passed("*/5 * * * *") & ~AutomationCondition.in_progress()
# eager(): upstream updated since last handled, none of it missing or in progress; minus never-built partitions.
REBUILD_WHEN_UPSTREAM_CHANGED = (AutomationCondition.eager() & ~AutomationCondition.missing()).with_label(
    "rebuild when upstream changed")


@dataclass(frozen=True)
class RetrainPolicy:
    interval_s: int = 60  # how often the sensor looks
    quiet_s: int = 120  # newest feature materialization must be this old (a backfill has settled)


RETRAIN = RetrainPolicy()
IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED]


def _partitioned_work_in_flight(instance) -> bool:
    keys = {AssetKey(k) for k in PARTITIONED}
    for run in instance.get_runs(filters=RunsFilter(statuses=IN_FLIGHT)):
        if run.asset_selection is None or keys & set(run.asset_selection):
            return True
    # a requested backfill may not have launched its runs yet (its status by value: no private import)
    return any(keys & set(b.asset_selection or ()) for b in instance.get_backfills()
               if b.status.value == "REQUESTED")


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
