"""`draft_vocab` (top-Vd response tokens → d2t/t2d) and `draft_head` (EAGLE-3 TTT training from the
feature shards of every available workload, scored on held-out features, then the SGLang export)."""
import hashlib

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from assets.features import feature_shards, features_for
from assets.metadata import summary_metadata
from assets.partitions import Keys
from assets.versions import settings_blob
from eagle3_platform.draft.stages import ExportRequest, TrainRequest, VocabRequest
from resources import ComputeResource, PresetResource, StorageResource, TargetResource

VOCAB_FILE = "vocab.safetensors"


def fetch_features(storage: StorageResource, target: TargetResource, split: str, log=None) -> list:
    """Local dirs of every workload's features for this target (a subset may be materialized)."""
    return [storage.fetch_dir(Keys.features(w, split)) for w in features_for(storage, target, split, log)]


def inputs_hash(*paths) -> str:
    """Identity of a training input set: the manifests (they hold every shard's sha256) + the vocab."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes() if p.is_file() else (p / "manifest.parquet").read_bytes())
    return h.hexdigest()


def train_settings_hash(preset: PresetResource, target: TargetResource) -> str:
    """The head's resolved settings (versions.settings: the training recipe, compute overrides,
    target). Part of its staging key: after an upgrade that changes the recipe (more epochs, feature
    noise), a killed training starts afresh in a new dir instead of resuming a checkpoint written for
    other settings, which training refuses."""
    return hashlib.sha256(settings_blob("draft_head", preset, target).encode()).hexdigest()


@asset(deps=[feature_shards], group_name="draft", kinds={"pytorch", "safetensors"})
def draft_vocab(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """The Vd most frequent loss-masked response tokens over all workloads (d2t/t2d)."""
    dirs = fetch_features(storage, target, "train", context.log)
    if not dirs:
        raise FileNotFoundError("no feature shards in storage: materialize feature_shards first")
    out = storage.staging(Keys.VOCAB, context.run.run_id) / VOCAB_FILE
    summary = compute.run(context, VocabRequest(features=[str(d) for d in dirs], target=str(target.dir()),
                                                out=str(out), preset=preset.name))
    uri = storage.publish_from(out.parent, Keys.VOCAB)
    return MaterializeResult(metadata={
        "workloads": ", ".join(features_for(storage, target, "train")), "vocab_uri": MetadataValue.path(uri),
        "target_vocab_size": summary["vocab_size"], **target.lineage(),
        **summary_metadata({k: v for k, v in summary.items() if k not in ("vocab", "stats")})})


@asset(deps=[draft_vocab, feature_shards], group_name="draft", kinds={"pytorch", "safetensors"})
def draft_head(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
               preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """TTT-trained EAGLE-3 head, scored on held-out features, exported for SGLang."""
    dirs = fetch_features(storage, target, "train", context.log)
    eval_dirs = fetch_features(storage, target, "eval", context.log)
    vocab = storage.fetch(f"{Keys.VOCAB}/{VOCAB_FILE}")
    # Same inputs + preset and recipe → same staging dir, so a killed training resumes from its checkpoint.
    key = inputs_hash(vocab, *dirs, *eval_dirs) + train_settings_hash(preset, target)
    ckpt = storage.staging(Keys.DRAFT, preset.staging_key(key))
    summary = compute.run(context, TrainRequest(
        target=str(target.dir()), features=[str(d) for d in dirs], out=str(ckpt), preset=preset.name,
        eval_features=[str(d) for d in eval_dirs], vocab=str(vocab), resume=True, **preset.compute()))
    exp = storage.staging(Keys.EXPORT, context.run.run_id)
    exported = compute.run(context, ExportRequest(draft=str(ckpt), out=str(exp)))
    export_uri = storage.publish_from(exp, Keys.EXPORT)
    ckpt_uri = storage.publish_from(ckpt, Keys.DRAFT)
    heldout = summary.get("eval_simulated_acceptance")  # absent when no eval split has features
    return MaterializeResult(metadata={
        **({"heldout_simulated_acceptance": float(heldout)} if heldout is not None else {}),
        "train_simulated_acceptance": float(summary.get("train_simulated_acceptance", 0.0)),
        "heldout_acc_k": MetadataValue.json((summary.get("eval") or {}).get("acc", [])),
        "workloads": ", ".join(features_for(storage, target, "train")),
        "eval_workloads": ", ".join(features_for(storage, target, "eval")), **target.lineage(),
        "export_uri": MetadataValue.path(export_uri), "checkpoint_uri": MetadataValue.path(ckpt_uri),
        "loss_curve": MetadataValue.md(loss_table(summary.get("history") or [])),
        **summary_metadata({k: v for k, v in summary.items()
                            if k in ("steps", "train_tokens", "train_tokens_per_s", "resumed_from", "compute_dtype",
                                     "device")}),
        **summary_metadata({k: v for k, v in exported.items() if k != "export_dir"}, prefix="export_")})


def loss_table(history: list[dict], rows: int = 12) -> str:
    """A compact markdown table of the logged training curve (every n-th entry)."""
    if not history:
        return "(no history)"
    step = max(1, len(history) // rows)
    lines = ["| step | loss | acc_0 | sim. acceptance |", "|---|---|---|---|"]
    for h in history[::step] + ([history[-1]] if (len(history) - 1) % step else []):
        lines.append(f"| {h['step']} | {h['loss']:.3f} | {h['acc'][0]:.3f} | {h['simulated_acceptance']:.3f} |")
    return "\n".join(lines)
