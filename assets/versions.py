"""Each asset's `code_version`: a hash of what determines its output, so Dagster marks an asset stale
when its code or its settings change (and `eagle3 run` rebuilds exactly those).

The code is derived from the source, not listed: the project's definitions the asset can run, from
its own function through every import, lazy ones included (assets/closure.py). The settings are the
resolved values it reads: the preset's area configs (AREAS), the target, and for an asset that runs
a model (eagle3_platform/model/compute.py among its code) the compute overrides and what `auto` resolves
to on this machine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from assets.closure import project

ROOT = Path(__file__).resolve().parents[1]
COMPUTE = "eagle3_platform/model/compute.py"  # among an asset's code: the asset runs a model

# asset -> the preset areas whose settings it reads
AREAS: dict[str, tuple[str, ...]] = {
    "filtered_prompts": ("sources", "pii", "filter", "regen"),
    "target_responses": ("regen", "pii"),
    "feature_shards": ("features",),
    "draft_vocab": ("train",),
    "draft_head": ("train",),
    "deployment": ("spec", "serve"),
    "benchmark_report": ("spec", "serve", "bench"),
}
# where an asset reads only part of an area: the filter's prompt budget is max_length - max_new_tokens
# (a regeneration time budget or batch size does not change which prompts are kept)
AREA_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("filtered_prompts", "regen"): ("max_length", "max_new_tokens")}
# settings an output can be continued under: made under one value, it is where a run under another
# would have been had it stopped there (a larger time budget only answers what a smaller one deferred)
CONTINUABLE: dict[tuple[str, str], tuple[str, ...]] = {("target_responses", "regen"): ("time_budget_s",)}


def closure(asset: str, root: Path = ROOT) -> frozenset[str]:
    """The files (relative to root) holding the code the asset can run."""
    return project(Path(root)).files(asset)


def source_hash(asset: str, root: Path = ROOT) -> str:
    """Hash of the code the asset can run (its syntax, not its comments or layout)."""
    return project(Path(root)).source_hash(asset)


def runs_model(asset: str, root: Path = ROOT) -> bool:
    return COMPUTE in closure(asset, root)


def machine_compute() -> dict:
    """What `auto` resolves to on this machine (eagle3_platform.model.compute's own resolvers): the device,
    and the dtype of each kind of work (decode: serving, regeneration; dense: extraction, training)."""
    from eagle3_platform.model import compute

    device = compute.resolve_device("auto")
    return {"device": device, **{work: compute.resolve_dtype("auto", device, work) for work in compute.WORK}}


def settings(asset: str, preset, target, continuable: bool = True, root: Path = ROOT) -> dict:
    """The resolved settings an asset's output depends on (preset and target resources); without the
    CONTINUABLE ones when continuable is False."""
    if asset not in AREAS:
        raise KeyError(f"assets/versions.py AREAS names no preset areas for asset {asset!r}")
    config = preset.config()
    areas = {a: dataclasses.asdict(getattr(config, a)) for a in AREAS[asset]}
    for (name, area), fields in AREA_FIELDS.items():
        if name == asset:
            areas[area] = {k: areas[area][k] for k in fields}
    for (name, area), fields in CONTINUABLE.items():
        if name == asset and not continuable:
            areas[area] = {k: v for k, v in areas[area].items() if k not in fields}
    model = runs_model(asset, root)  # only then do the dtype/threads overrides and the machine count
    compute = preset.compute() if model else {}
    machine = machine_compute() if model and compute.get("dtype", "auto") == "auto" else {}
    return {"preset": preset.name, "compute": compute, "machine": machine, "areas": areas,
            "target": {"model": target.model, "max_length": target.max_length, "endpoint": target.endpoint}}


def settings_blob(asset: str, preset, target, continuable: bool = True, root: Path = ROOT) -> str:
    """settings() as one canonical JSON string (what code versions and staging keys hash)."""
    return json.dumps(settings(asset, preset, target, continuable, root), sort_keys=True, default=str)


def code_version(asset: str, preset, target, continuable: bool = True, root: Path = ROOT) -> str:
    """continuable=False: the version an earlier output must have been made at to be continued (the
    CONTINUABLE settings left out)."""
    blob = settings_blob(asset, preset, target, continuable, root)
    return hashlib.sha256((source_hash(asset, root) + blob).encode()).hexdigest()[:16]


def with_code_versions(assets: list, preset, target, root: Path = ROOT) -> list:
    """The assets with the code version each materializable one gets under these resources."""
    out = []
    for a in assets:
        if getattr(a, "is_materializable", False) and hasattr(a, "map_asset_specs"):
            a = a.map_asset_specs(lambda s: s.replace_attributes(
                code_version=code_version(s.key.to_user_string(), preset, target, root=root)))
        out.append(a)
    return out
