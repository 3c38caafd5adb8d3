"""Turning a library step's JSON summary into readable, typed Dagster metadata (one helper for every
asset), plots as images the UI shows, and reading back what the last materialization recorded (what
a step may continue from)."""

import base64
import io
import json
from urllib.parse import unquote, urlparse

from dagster import AssetRecordsFilter, MetadataValue, TableColumn, TableRecord, TableSchema

REBUILD_TAG = "eagle3/rebuild"  # a run tag: "true" rebuilds from scratch, continuing nothing
OWNERS = ["team:ml-platform"]  # every asset's owner, shown on its page and filterable in the catalog
FLOAT_DIGITS = 4  # significant digits a float keeps in metadata: readable, still exact enough to plot


def rounded(v: float) -> float:
    return float(f"{v:.{FLOAT_DIGITS}g}") if abs(v) < 10 ** FLOAT_DIGITS else round(v, 1)


def key_order(k):
    """Numeric keys ("1", "2", "16") in numeric order, before any text key."""
    try:
        return (0, float(k), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(k))


def dict_table(rows: dict, key: str = "name", value: str = "value") -> MetadataValue:
    """{k: v} as a two-column table with a schema, keys in numeric order where numeric."""
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rows.values())
    vtype = "float" if numeric and any(isinstance(v, float) for v in rows.values()) else (
        "int" if numeric else "string")
    schema = TableSchema(columns=[TableColumn(key, "string"), TableColumn(value, vtype)])
    cell = (lambda v: rounded(v) if isinstance(v, float) else v) if numeric else str
    return MetadataValue.table([TableRecord({key: str(k), value: cell(v)})
                                for k, v in sorted(rows.items(), key=lambda kv: key_order(kv[0]))],
                               schema=schema)


def location(uri: str) -> MetadataValue:
    """Where an artifact lies, as the UI can use it: a local file as a plain path and a bucket object
    as its gs:// URI (both copyable; a browser will not open file:// from the UI), http(s) as a link."""
    if uri.startswith("file://"):
        return MetadataValue.path(unquote(urlparse(uri).path))
    if uri.startswith(("http://", "https://")):
        return MetadataValue.url(uri)
    return MetadataValue.path(uri)


def summary_metadata(summary: dict, prefix: str = "") -> dict:
    """Ints and (rounded) floats stay numbers, so the UI plots them across materializations; dicts
    become tables; locations become paths or links."""
    out: dict = {}
    for k, v in (summary or {}).items():
        name = f"{prefix}{k}"
        if isinstance(v, bool) or v is None:
            out[name] = MetadataValue.text(str(v))
        elif isinstance(v, int):
            out[name] = MetadataValue.int(v)
        elif isinstance(v, float):
            out[name] = MetadataValue.float(rounded(v))
        elif isinstance(v, str):
            out[name] = location(v) if v.startswith(("gs://", "http://", "https://", "file://", "/")) \
                else MetadataValue.text(v)
        elif isinstance(v, dict) and v and all(isinstance(x, (int, float, str)) for x in v.values()):
            out[name] = dict_table(v)
        else:
            out[name] = MetadataValue.json(json.loads(json.dumps(v, default=str)))
    return out


def png_markdown(images: dict[str, bytes], intro: str = "") -> MetadataValue:
    """PNG images inline in markdown as data: URIs (the UI's markdown renderer allows data: image
    sources; a relative or file:// link would show as a broken image)."""
    parts = [intro] if intro else []
    parts += [f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})" for alt, png in images.items()]
    return MetadataValue.md("\n\n".join(parts))


def figure_png(fig, dpi: int = 90) -> bytes:
    """A matplotlib figure as PNG bytes (closed after)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


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
