"""`filtered_prompts`: user/system turns of one workload, PII/DLP-filtered, validated, deduplicated and
decontaminated against the eval table. Both splits are produced: `train` (decontaminated) and `eval`
(the held-out table, filtered for PII but never trained on)."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from assets.metadata import md_table
from assets.partitions import SPLITS, Keys, workload_partitions
from assets.sources import workload_sources
from resources import ComputeResource, PresetResource, StorageResource, TargetResource
from assets.responses_config import regen_config

POLICY = "drop"  # PII policy for training data: drop the record (redact keeps a [REDACTED] prompt)


def _filter_split(context, w: str, split: str, storage, target, preset, compute) -> dict:
    from eagle3_platform.data.filter import filter_file
    from eagle3_platform.data.regenerate import load_tokenizer
    from eagle3_platform.data.sources import eval_keys, write_workload

    src_cfg, flt_cfg, regen = preset.area("sources"), preset.area("filter"), regen_config(preset, target)
    limit = src_cfg.limit if split == "train" else src_cfg.eval_limit
    max_tokens = regen.max_length - regen.max_new_tokens  # room left for the answer (as `eagle3 filter`)
    stage = storage.staging(Keys.kept(w, split), context.run_id)
    raw, kept, rej = stage / "raw.jsonl", stage / "kept.jsonl", stage / "rejected.jsonl"
    tdir = target.dir()
    compute.run(context, lambda: write_workload(w, raw, split=split, limit=limit, cfg=src_cfg),
                ["sources", "--workload", w, "--split", split, "--out", str(raw), "--preset", preset.name]
                + (["--limit", str(limit)] if limit is not None else []))
    # The eval table is filtered for PII too, but never decontaminated against itself.
    keys = eval_keys() if split == "train" else None
    summary = compute.run(
        context,
        lambda: filter_file(raw, kept, rej, policy=POLICY, max_tokens=max_tokens,
                            tokenizer=load_tokenizer(tdir), eval_keys=keys, cfg=flt_cfg),
        ["filter", "--in", str(raw), "--out", str(kept), "--rejected", str(rej), "--policy", POLICY,
         "--target", str(tdir), "--max-tokens", str(max_tokens)]
        + (["--no-decontaminate"] if keys is None else []))
    raw.unlink(missing_ok=True)  # raw source text may hold PII: never stored
    if summary["kept"] + summary["rejected"] != summary["read"]:
        raise RuntimeError(f"{w}/{split}: kept + rejected != read: {summary}")
    summary["kept_uri"] = storage.publish_from(kept, Keys.kept(w, split))
    summary["rejected_uri"] = storage.publish_from(rej, Keys.rejected(w, split))
    return summary


@asset(partitions_def=workload_partitions, deps=[workload_sources], group_name="data",
       kinds={"python", "jsonl"}, code_version="1")
def filtered_prompts(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                     preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """Prompt records (kept) + rejection records with reasons; kept + rejected == read."""
    from assets.sources import fingerprints

    w = context.partition_key
    res = {s: _filter_split(context, w, s, storage, target, preset, compute) for s in SPLITS}
    tr, ev = res["train"], res["eval"]
    by_reason = {f"{s}:{r}": n for s in SPLITS for r, n in (res[s].get("by_reason") or {}).items()}
    return MaterializeResult(metadata={
        "workload": w, "preset": preset.name,
        "source_fingerprint": fingerprints([w])[w],
        "read": tr["read"], "kept": tr["kept"], "rejected": tr["rejected"],
        "accounting": MetadataValue.text(f"{tr['kept']} + {tr['rejected']} == {tr['read']}"),
        "eval_read": ev["read"], "eval_kept": ev["kept"], "eval_rejected": ev["rejected"],
        "rejections_by_reason": md_table(by_reason, "split:reason", "records"),
        "kept_uri": MetadataValue.path(tr["kept_uri"]),
        "rejected_uri": MetadataValue.path(tr["rejected_uri"]),
        "eval_kept_uri": MetadataValue.path(ev["kept_uri"]),
    })
