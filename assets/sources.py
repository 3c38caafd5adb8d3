"""`workload_sources`: the observable source. Its data version per workload partition is the content
hash of the package files backing that workload, so observing it is how source changes are detected.
This observation function is the one place the observation is emitted (automation observes it on a
cron tick; `eagle3 run` runs the `observe_workload_sources` job)."""

import warnings

from dagster import BetaWarning, DataVersion, DataVersionsByPartition, observable_source_asset

from assets.partitions import workload_partitions
from assets.sensors import OBSERVE_SOURCES


def fingerprints(workloads=None) -> dict[str, str]:
    from eagle3_platform.data.sources import source_fingerprint

    return {w: source_fingerprint(w) for w in (workloads or workload_partitions.get_partition_keys())}


# Observable source assets are marked beta; this one is the documented way to version external data.
warnings.filterwarnings("ignore", category=BetaWarning, message=".*observable_source_asset.*")


@observable_source_asset(partitions_def=workload_partitions, group_name="sources",
                         automation_condition=OBSERVE_SOURCES,
                         tags={"dagster/kind/python": ""},
                         description="Workload prompt sources (PyPI data packages + EAGLE3_EXTRA_SOURCES).")
def workload_sources(context) -> DataVersionsByPartition:
    fps = fingerprints()
    context.log.info("source fingerprints: " + ", ".join(f"{w}={v[:12]}" for w, v in fps.items()))
    return DataVersionsByPartition({w: DataVersion(v) for w, v in fps.items()})
