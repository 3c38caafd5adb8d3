"""`feature_shards`: offline hidden states of the target (capture layers + final post-norm state) as
safetensors shards + a parquet manifest per workload and split. A rebuild starts from the published
shards and keeps those whose records are unchanged (`shards_seeded`, `shards_skipped`)."""

import json
import os
import shutil
from pathlib import Path

from dagster import (AssetCheckResult, AssetCheckSpec, AssetExecutionContext, MaterializeResult,
                     MetadataValue, asset)

from assets.metadata import OWNERS, location, summary_metadata
from assets.partitions import SPLITS, Keys, workload_partitions
from assets.sensors import REBUILD_WHEN_UPSTREAM_CHANGED
from assets.responses import target_responses
from eagle3_platform.features.stages import ExtractRequest
from resources import ComputeResource, PresetResource, StorageResource, TargetResource

TARGET_SIDECAR = "target.json"
LOCAL_KEYS = ("uri", "out", "manifest", "header")  # staging paths / header reported separately


def _extract_split(context, w: str, split: str, storage, target, preset, compute) -> dict:
    from eagle3_platform.store.records import sha256_file

    conv = storage.fetch(Keys.conversations(w, split))
    out = storage.staging(Keys.features(w, split), preset.staging_key(sha256_file(conv)))  # resumable per input
    seeded = _seed_from_published(storage, Keys.features(w, split), out)
    summary = compute.run(context, ExtractRequest(target=str(target.dir()), in_path=str(conv), out=str(out),
                                                  preset=preset.name, max_length=target.max_length,
                                                  device_map=target.device_map, max_memory=target.max_memory,
                                                  from_engine=target.engine_dir,
                                                  **preset.compute()))
    # Sidecar naming the target these features belong to: consumers pick matching partitions cheaply.
    (out / TARGET_SIDECAR).write_text(json.dumps(expect_header(target)))
    summary["uri"] = storage.publish_from(out, Keys.features(w, split))
    summary["shards_seeded"] = seeded
    return summary


def _seed_from_published(storage: StorageResource, key: str, out: Path) -> int:
    """A new staging dir starts from the published shards (hard links where the filesystem allows,
    else copies; every write to them is tmp + rename, so the published files are never changed).
    Extraction keeps each shard whose records, tokens and masks are the ones it would write now and
    recomputes the rest (extract._reusable): conversations grown by new prompts, the published
    records first and unchanged, extract only what is new. -> shards seeded."""
    from eagle3_platform.features.shards import MANIFEST

    if (out / MANIFEST).exists() or not storage.exists(f"{key}/{MANIFEST}"):
        return 0  # resuming its own work, or nothing published
    src = storage.fetch_dir(key)
    shards = sorted(src.glob("shard-*.safetensors"))
    for f in [*shards, src / MANIFEST]:  # the manifest last: a kill before it seeds again
        link_or_copy(f, out / f.name)
    return len(shards)


def link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem (a cache), or no hard links
        shutil.copy2(src, dst)


def expect_header(target: TargetResource) -> dict:
    """The shard header fields that tie features to one target."""
    from eagle3_platform.model.target import identity

    return identity(target.dir())


def features_for(storage: StorageResource, target: TargetResource, split: str, log=None) -> list[str]:
    """Workloads whose stored features (split) were extracted from this target."""
    want, found = expect_header(target), []
    for w in workload_partitions.get_partition_keys():
        key = f"{Keys.features(w, split)}/{TARGET_SIDECAR}"
        if not storage.exists(key):
            continue
        if json.loads(storage.storage().get_bytes(key)) == want:
            found.append(w)
        elif log is not None:
            log.warning(f"{w}/{split}: stored features belong to another target; not used")
    return found


def verify_stored(storage: StorageResource, target: TargetResource, w: str) -> AssetCheckResult:
    """Re-read what was stored: every shard's sha256 vs the manifest, headers vs this target."""
    from eagle3_platform.features.shards import verify_shards

    expect = expect_header(target)
    reports = {s: verify_shards(storage.fetch_dir(Keys.features(w, s)), expect=expect) for s in SPLITS}
    bad = [f"{s}/{b['shard']}: {b['reason']}" for s, r in reports.items() for b in r["bad"]]
    bad += [f"{s}/{u}: not in manifest" for s, r in reports.items() for u in r["unlisted"]]
    return AssetCheckResult(check_name="shards_verify", passed=not bad, metadata={
        "shards_ok": sum(len(r["ok"]) for r in reports.values()), "problems": len(bad),
        "first_problems": MetadataValue.md("\n".join(f"- {b}" for b in bad[:20]) or "none")})


@asset(partitions_def=workload_partitions, automation_condition=REBUILD_WHEN_UPSTREAM_CHANGED,
       deps=[target_responses], group_name="features",
       kinds={"pytorch", "safetensors"}, owners=OWNERS,
       check_specs=[AssetCheckSpec("shards_verify", asset="feature_shards", blocking=True,
                                   description="stored shards match the manifest sha256 + this target")])
def feature_shards(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                   preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """The target's hidden states (its capture layers and final state) over one workload's
    conversations, as safetensors shards plus a parquet manifest per split (the eval split scores the
    head on held-out data); a blocking check re-reads every shard against the manifest and this target."""
    w = context.partition_key
    res = {s: _extract_split(context, w, s, storage, target, preset, compute) for s in SPLITS}
    header = res["train"].get("header") or {}
    meta = {"workload": w, "preset": preset.name, **target.lineage(),
            **{k: str(header[k]) for k in ("template_hash", "tokenizer_hash", "dtype", "compute_dtype", "max_length")
               if k in header},
            "features_uri": location(res["train"]["uri"]),
            "eval_features_uri": location(res["eval"]["uri"])}
    for s in SPLITS:
        meta.update(summary_metadata({k: v for k, v in res[s].items() if k not in LOCAL_KEYS},
                                     prefix="" if s == "train" else "eval_"))
    return MaterializeResult(metadata=meta, check_results=[verify_stored(storage, target, w)])
