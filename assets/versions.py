"""Each asset's `code_version`: a hash of what determines its output, so the Dagster UI marks an asset
stale when its code or its settings change (and `eagle3 run` rebuilds exactly those).

What determines an asset's output: its own module, the library code its stages run, and the resolved
settings it reads (the preset's area configs, the compute overrides, the target). Code shared by every
stage (records, the stage seam, config composition) counts for every asset.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ("eagle3_platform/records.py", "eagle3_platform/stage.py", "eagle3_platform/config.py",
          "eagle3_platform/storage.py", "assets/partitions.py", "assets/versions.py")
MODEL = ("eagle3_platform/target.py", "eagle3_platform/compute.py", "eagle3_platform/attention.py",
         "eagle3_platform/kv_cache.py")

# asset -> (source files/dirs relative to the project, preset areas it reads)
INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "filtered_prompts": (("assets/prompts.py", "eagle3_platform/data"), ("sources", "pii", "filter", "regen")),
    "target_responses": (("assets/responses.py", "eagle3_platform/data", *MODEL), ("regen", "pii")),
    "feature_shards": (("assets/features.py", "eagle3_platform/features", *MODEL), ("features",)),
    "draft_vocab": (("assets/draft.py", "eagle3_platform/draft/vocab.py", "eagle3_platform/draft/stages.py",
                     "eagle3_platform/features/shards.py"), ("train",)),
    "draft_head": (("assets/draft.py", "eagle3_platform/draft", "eagle3_platform/features/shards.py",
                    "eagle3_platform/spec/answer_ngrams.py", *MODEL), ("train",)),
    "deployment": (("assets/deploy.py", "resources/serving.py", "eagle3_platform/serve", "eagle3_platform/spec",
                    *MODEL), ("spec", "serve")),
    "benchmark_report": (("assets/bench.py", "resources/serving.py", "eagle3_platform/bench",
                          "eagle3_platform/serve", "eagle3_platform/spec", *MODEL), ("spec", "serve", "bench")),
}
# where an asset reads only part of an area: the filter's prompt budget is max_length - max_new_tokens
# (a regeneration time budget or batch size does not change which prompts are kept)
AREA_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("filtered_prompts", "regen"): ("max_length", "max_new_tokens")}
# settings an output can be continued under: made under one value, it is where a run under another
# would have been had it stopped there (a larger time budget only answers what a smaller one deferred)
CONTINUABLE: dict[tuple[str, str], tuple[str, ...]] = {("target_responses", "regen"): ("time_budget_s",)}


def _files(rel: str) -> list[Path]:
    p = ROOT / rel
    return sorted(p.rglob("*.py")) if p.is_dir() else [p]


def source_hash(paths) -> str:
    h = hashlib.sha256()
    for f in sorted({f for rel in paths for f in _files(rel)}):
        name = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f  # the same hash in every checkout
        h.update(str(name).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def settings(asset: str, preset, target, continuable: bool = True) -> dict:
    """The resolved settings an asset's output depends on (preset and target resources); without the
    CONTINUABLE ones when continuable is False."""
    paths, area_names = INPUTS[asset]
    config = preset.config()
    areas = {a: dataclasses.asdict(getattr(config, a)) for a in area_names}
    for (name, area), fields in AREA_FIELDS.items():
        if name == asset:
            areas[area] = {k: areas[area][k] for k in fields}
    for (name, area), fields in CONTINUABLE.items():
        if name == asset and not continuable:
            areas[area] = {k: v for k, v in areas[area].items() if k not in fields}
    runs_model = "eagle3_platform/compute.py" in paths  # only then do the dtype/threads overrides count
    return {"preset": preset.name, "compute": preset.compute() if runs_model else {}, "areas": areas,
            "target": {"model": target.model, "max_length": target.max_length, "endpoint": target.endpoint}}


def settings_blob(asset: str, preset, target, continuable: bool = True) -> str:
    """settings() as one canonical JSON string (what code versions and staging keys hash)."""
    return json.dumps(settings(asset, preset, target, continuable), sort_keys=True, default=str)


def code_version(asset: str, preset, target, continuable: bool = True) -> str:
    """continuable=False: the version an earlier output must have been made at to be continued (the
    CONTINUABLE settings left out)."""
    paths, _ = INPUTS[asset]
    blob = settings_blob(asset, preset, target, continuable)
    return hashlib.sha256((source_hash((*SHARED, *paths)) + blob).encode()).hexdigest()[:16]


def with_code_versions(assets: list, preset, target) -> list:
    """The assets with the code version each gets under these resources (others unchanged)."""
    out = []
    for a in assets:
        names = {k.to_user_string() for k in getattr(a, "keys", ())}
        if names and names <= set(INPUTS) and hasattr(a, "map_asset_specs"):
            a = a.map_asset_specs(lambda s: s.replace_attributes(
                code_version=code_version(s.key.to_user_string(), preset, target)))
        out.append(a)
    return out
