"""Turning a library step's JSON summary into rich Dagster metadata (one helper for every asset)."""

import json

from dagster import MetadataValue


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
