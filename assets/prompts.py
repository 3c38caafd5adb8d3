"""`filtered_prompts`: user/system turns of one workload, PII/DLP-filtered, validated, deduplicated and
decontaminated against the eval table. Both splits are produced: `train` (decontaminated) and `eval`
(the held-out table, filtered for PII but never trained on)."""

import hashlib

from dagster import AssetExecutionContext, DataVersion, MaterializeResult, MetadataValue, asset

from assets.metadata import OWNERS, check_accounting, dict_table, location
from assets.partitions import SPLITS, Keys, workload_partitions
from assets.sensors import REBUILD_WHEN_UPSTREAM_CHANGED
from assets.sources import workload_sources
from eagle3_platform.data.stages import FilterRequest, SourcesRequest
from resources import ComputeResource, PresetResource, StorageResource, TargetResource

POLICY = "drop"  # PII policy for training data: drop the record (redact keeps a [REDACTED] prompt)


def _filter_split(context, w: str, split: str, storage, target, preset, compute) -> dict:
    stage = storage.staging(Keys.kept(w, split), context.run.run_id)
    raw, kept, rej = stage / "raw.jsonl", stage / "kept.jsonl", stage / "rejected.jsonl"
    limit = preset.area("sources").train_limit(w) if split == "train" else None  # None: the preset's
    compute.run(context, SourcesRequest(workload=w, split=split, out=str(raw), preset=preset.name, limit=limit))
    # The eval table is filtered for PII too, but never decontaminated against itself. Prompts must leave
    # room for the answer in the regeneration budget (the target resource may override max_length).
    summary = compute.run(context, FilterRequest(
        in_path=str(raw), out=str(kept), rejected=str(rej), policy=POLICY, target=str(target.dir()),
        max_length=target.max_length, decontaminate=split == "train", preset=preset.name))
    raw.unlink(missing_ok=True)  # raw source text may hold PII: never stored
    check_accounting(summary, "kept", f"{w}/{split}")
    summary["kept_sha256"] = hashlib.sha256(kept.read_bytes()).hexdigest()
    summary["kept_uri"] = storage.publish_from(kept, Keys.kept(w, split))
    summary["rejected_uri"] = storage.publish_from(rej, Keys.rejected(w, split))
    return summary


@asset(partitions_def=workload_partitions, automation_condition=REBUILD_WHEN_UPSTREAM_CHANGED,
       deps=[workload_sources], group_name="data",
       kinds={"python", "jsonl"}, owners=OWNERS)
def filtered_prompts(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                     preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """One workload's prompts, system and user turns only (source answers dropped), PII/DLP-filtered,
    validated, deduplicated and (train split) decontaminated against the eval table: kept prompt
    records plus rejection records with reasons, for the train and eval splits; kept + rejected == read."""
    from assets.sources import fingerprints

    w = context.partition_key
    res = {s: _filter_split(context, w, s, storage, target, preset, compute) for s in SPLITS}
    tr, ev = res["train"], res["eval"]
    by_reason = {f"{s}:{r}": n for s in SPLITS for r, n in (res[s].get("by_reason") or {}).items()}
    # Dagster leaves a partitioned source's observed version out of the data version it derives, so the
    # prompts name their own (a hash of what was kept): a source change that changes them reaches every
    # asset downstream through the data versions Dagster derives from this one.
    version = hashlib.sha256((tr["kept_sha256"] + ev["kept_sha256"]).encode()).hexdigest()
    return MaterializeResult(data_version=DataVersion(version), metadata={
        "workload": w, "preset": preset.name,
        "source_fingerprint": fingerprints([w])[w],
        "read": tr["read"], "kept": tr["kept"], "rejected": tr["rejected"],
        "accounting": MetadataValue.text(f"{tr['kept']} + {tr['rejected']} == {tr['read']}"),
        "eval_read": ev["read"], "eval_kept": ev["kept"], "eval_rejected": ev["rejected"],
        "rejections_by_reason": dict_table(by_reason, "split:reason", "records"),
        "kept_uri": location(tr["kept_uri"]),
        "rejected_uri": location(tr["rejected_uri"]),
        "eval_kept_uri": location(ev["kept_uri"]),
    })
