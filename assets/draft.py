"""`draft_vocab` (top-Vd response tokens → d2t/t2d) and `draft_head` (EAGLE-3 TTT training from the
feature shards of every available workload, then the SGLang-format export)."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from assets.features import feature_shards
from assets.metadata import summary_metadata
from assets.partitions import Keys, workload_partitions
from resources import ComputeResource, PresetResource, StorageResource, TargetResource


def available_workloads(storage: StorageResource, split: str = "train") -> list[str]:
    """Workload partitions whose feature shards exist (a subset may have been materialized)."""
    return [w for w in workload_partitions.get_partition_keys()
            if storage.exists(f"{Keys.features(w, split)}/manifest.parquet")]


def fetch_features(storage: StorageResource, split: str) -> list:
    return [storage.fetch_dir(Keys.features(w, split)) for w in available_workloads(storage, split)]


@asset(deps=[feature_shards], group_name="draft", kinds={"pytorch", "safetensors"}, code_version="1")
def draft_vocab(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """The Vd most frequent loss-masked response tokens over all workloads (d2t/t2d)."""
    from eagle3_platform.draft.vocab import build_vocab_from_features

    dirs = fetch_features(storage, "train")
    if not dirs:
        raise FileNotFoundError("no feature shards in storage: materialize feature_shards first")
    out = storage.staging(Keys.VOCAB, context.run_id)
    cfg = preset.area("train")
    summary = compute.run(context, lambda: build_vocab_from_features(dirs, out, cfg),
                          ["vocab", "--features", ",".join(map(str, dirs)), "--out", str(out),
                           "--preset", preset.name])
    uri = storage.publish_from(out, Keys.VOCAB)
    return MaterializeResult(metadata={
        "workloads": ", ".join(available_workloads(storage)), "vocab_uri": MetadataValue.path(uri),
        **target.lineage(), **summary_metadata(summary)})


@asset(deps=[draft_vocab, feature_shards], group_name="draft", kinds={"pytorch", "safetensors"},
       code_version="1")
def draft_head(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
               preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """TTT-trained EAGLE-3 head, scored on held-out features, exported for SGLang."""
    from eagle3_platform.draft.export import export_draft
    from eagle3_platform.draft.train import train

    dirs, eval_dirs = fetch_features(storage, "train"), fetch_features(storage, "eval")
    vocab = storage.fetch_dir(Keys.VOCAB)
    tdir, cfg = target.dir(), preset.area("train")
    ckpt = storage.staging(Keys.DRAFT, context.run_id)
    summary = compute.run(
        context, lambda: train(tdir, dirs, ckpt, cfg, eval_dirs=eval_dirs, vocab_dir=vocab),
        ["train", "--target", str(tdir), "--features", ",".join(map(str, dirs)), "--out", str(ckpt),
         "--preset", preset.name, "--eval-features", ",".join(map(str, eval_dirs)),
         "--vocab", str(vocab)])
    exp = storage.staging(Keys.EXPORT, context.run_id)
    exported = compute.run(context, lambda: export_draft(ckpt, exp),
                           ["export", "--draft", str(ckpt), "--out", str(exp)])
    export_uri = storage.publish_from(exp, Keys.EXPORT)
    ckpt_uri = storage.publish_from(ckpt, Keys.DRAFT)
    return MaterializeResult(metadata={
        "heldout_simulated_acceptance": float(heldout_acceptance(summary)),
        "workloads": ", ".join(available_workloads(storage)), **target.lineage(),
        "export_uri": MetadataValue.path(export_uri), "checkpoint_uri": MetadataValue.path(ckpt_uri),
        **summary_metadata(summary), **summary_metadata(exported, prefix="export_")})


def heldout_acceptance(summary: dict) -> float:
    """Simulated acceptance on held-out features, from the training summary."""
    for k in ("eval_simulated_acceptance", "heldout_simulated_acceptance"):
        if k in summary:
            return summary[k]
    ev = summary.get("eval") or {}
    if "simulated_acceptance" in ev:
        return ev["simulated_acceptance"]
    raise KeyError(f"training summary has no held-out simulated acceptance: {sorted(summary)}")
