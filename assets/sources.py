"""`workload_sources`: the observable source. Its data version per workload partition is the content
hash of the package files backing that workload, so observing it is how source changes are detected.
This observation function is the one place the observation is emitted (automation observes it on a
cron tick; `eagle3 run` runs the `observe_workload_sources` job)."""

import warnings

from dagster import (AssetObservation, BetaWarning, DataVersion, DataVersionsByPartition, MetadataValue,
                     observable_source_asset)
from dagster._core.definitions.external_asset import create_external_asset_from_source_asset

from assets.metadata import OWNERS
from assets.partitions import workload_partitions
from assets.sensors import OBSERVE_SOURCES

DATA_VERSION_TAG = "dagster/data_version"  # the tag Dagster reads an observed data version from


def fingerprints(workloads=None) -> dict[str, str]:
    from eagle3_platform.data.sources import source_fingerprint

    return {w: source_fingerprint(w) for w in (workloads or workload_partitions.get_partition_keys())}


# Observable source assets are marked beta; this one is the documented way to version external data.
warnings.filterwarnings("ignore", category=BetaWarning, message=".*observable_source_asset.*")


@observable_source_asset(name="workload_sources", partitions_def=workload_partitions, group_name="sources",
                         automation_condition=OBSERVE_SOURCES,
                         tags={"dagster/kind/python": ""},
                         description="Workload prompt sources, one partition per workload: the PyPI data "
                                     "packages that ship them, plus any JSONL under "
                                     "`$EAGLE3_EXTRA_SOURCES/<workload>/`. Each observation records the files backing a "
                                     "workload, their bytes and content hash (its data version).")
def observe_sources(context) -> DataVersionsByPartition:
    fps = fingerprints()
    context.log.info("source fingerprints: " + ", ".join(f"{w}={v[:12]}" for w, v in fps.items()))
    # Each partition's observation is logged here rather than returned: a returned
    # DataVersionsByPartition carries no metadata, and the page should say what was observed. The
    # event is the one Dagster would log (same data-version tag), plus that metadata.
    for w, v in fps.items():
        context.log_event(AssetObservation(asset_key=context.asset_key, partition=w, tags={DATA_VERSION_TAG: v},
                                           metadata=observed(w, v)))
    return DataVersionsByPartition({})


# A SourceAsset cannot carry owners. Dagster turns it into this observation-only asset definition
# anyway when it loads the definitions; done here, the spec takes the owners every asset has.
workload_sources = create_external_asset_from_source_asset(observe_sources).map_asset_specs(
    lambda spec: spec.replace_attributes(owners=OWNERS))


def observed(workload: str, fingerprint: str) -> dict:
    """What backs one workload now: its files, their total size, and the fingerprint."""
    from eagle3_platform.data.sources.workload import source_files

    files = [p for p in source_files(workload) if p.exists()]
    return {"files": MetadataValue.int(len(files)), "bytes": MetadataValue.int(sum(p.stat().st_size for p in files)),
            "file_names": MetadataValue.md("\n".join(f"- `{p.name}`" for p in files) or "(none)"),
            "fingerprint": MetadataValue.text(fingerprint)}
