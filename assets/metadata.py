"""Turning a library step's JSON summary into rich Dagster metadata (one helper for every asset), and
reading back what the last materialization recorded (what a step may continue from)."""

import json

from dagster import AssetRecordsFilter, MetadataValue

REBUILD_TAG = "eagle3/rebuild"  # a run tag: "true" rebuilds from scratch, continuing nothing


def md_table(rows: dict, key: str = "key", value: str = "value") -> MetadataValue:
    lines = [f"| {key} | {value} |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sorted(rows.items())]
    return MetadataValue.md("\n".join(lines))


def summary_metadata(summary: dict, prefix: str = "") -> dict:
    """Scalars stay scalars (so they plot in the UI); dicts become a markdown table + JSON."""
    out: dict = {}
    for k, v in (summary or {}).items():
        name = f"{prefix}{k}"
        if isinstance(v, bool) or v is None:
            out[name] = MetadataValue.text(str(v))
        elif isinstance(v, (int, float)):
            out[name] = v
        elif isinstance(v, str):
            out[name] = MetadataValue.url(v) if v.startswith(("gs://", "http://", "https://")) else (
                MetadataValue.path(v) if v.startswith(("file://", "/")) else MetadataValue.text(v))
        elif isinstance(v, dict) and v and all(isinstance(x, (int, float, str)) for x in v.values()):
            out[name] = md_table(v)
        else:
            out[name] = MetadataValue.json(json.loads(json.dumps(v, default=str)))
    return out


def check_accounting(summary: dict, kept: str, where: str) -> dict:
    """A stage's books must balance (kept or written + rejected == read) before anything is published."""
    if summary[kept] + summary["rejected"] != summary["read"]:
        raise RuntimeError(f"{where}: {kept} + rejected != read: {summary}")
    return summary


def last_metadata(context) -> dict:
    """Plain values of the asset's (partition's) latest materialization's metadata ({} if none)."""
    partitions = [context.partition_key] if context.has_partition_key else None
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=context.asset_key, asset_partitions=partitions), limit=1).records
    if not records:
        return {}
    return {k: getattr(v, "value", v) for k, v in records[0].asset_materialization.metadata.items()}
