"""`draft_vocab` (top-Vd response tokens → d2t/t2d) and `draft_head` (EAGLE-3 TTT training from the
feature shards of every available workload, scored on held-out features, then the SGLang export).

When the data grew since the published head (same code and settings, other inputs), a preset with
`warm_start_epochs` starts from that head and trains those epochs over all the data, instead of its
full recipe from scratch; `eagle3 run --force` trains from scratch."""
import hashlib
from pathlib import Path

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from assets.features import feature_shards, features_for
from assets.metadata import (OWNERS, REBUILD_TAG, dict_table, figure_png, last_metadata, location, png_markdown,
                             summary_metadata)
from assets.partitions import Keys
from assets.versions import code_version, settings_blob
from eagle3_platform.draft.stages import ExportRequest, TrainRequest, VocabRequest
from eagle3_platform.draft.model import DRAFT_CONFIG, DRAFT_WEIGHTS
from eagle3_platform.draft.warm_start import init_sha256
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


@asset(deps=[feature_shards], group_name="draft", kinds={"pytorch", "safetensors"}, owners=OWNERS)
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
        "workloads": ", ".join(features_for(storage, target, "train")), "vocab_uri": location(uri),
        "target_vocab_size": summary["vocab_size"], **target.lineage(),
        **summary_metadata({k: v for k, v in summary.items() if k not in ("vocab", "stats")})})


@asset(deps=[draft_vocab, feature_shards], group_name="draft", kinds={"pytorch", "safetensors"}, owners=OWNERS)
def draft_head(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
               preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """TTT-trained EAGLE-3 head, scored on held-out features, exported for SGLang."""
    dirs = fetch_features(storage, target, "train", context.log)
    eval_dirs = fetch_features(storage, target, "eval", context.log)
    vocab = storage.fetch(f"{Keys.VOCAB}/{VOCAB_FILE}")
    inputs, version = inputs_hash(vocab, *dirs, *eval_dirs), code_version("draft_head", preset, target)
    init, why = _warm_start_from(context, storage, preset, version, inputs)
    # Same inputs + preset and recipe (+ start) → same staging dir: a killed training resumes from its checkpoint.
    key = inputs + train_settings_hash(preset, target) + (init_sha256(init) if init else "")
    ckpt = storage.staging(Keys.DRAFT, preset.staging_key(key))
    summary = compute.run(context, TrainRequest(
        target=str(target.dir()), features=[str(d) for d in dirs], out=str(ckpt), preset=preset.name,
        eval_features=[str(d) for d in eval_dirs], vocab=str(vocab), resume=True,
        init_from=str(init) if init else None,
        epochs=preset.config().train.warm_start_epochs if init else None, **preset.compute()))
    exp = storage.staging(Keys.EXPORT, context.run.run_id)
    exported = compute.run(context, ExportRequest(draft=str(ckpt), out=str(exp)))
    head = head_sha256(exp)  # before publishing moves it
    export_uri = storage.publish_from(exp, Keys.EXPORT)
    ckpt_uri = storage.publish_from(ckpt, Keys.DRAFT)
    heldout = summary.get("eval_simulated_acceptance")  # absent when no eval split has features
    warm = summary.get("warm_start") or {}
    history, heldout_acc = summary.get("history") or [], (summary.get("eval") or {}).get("acc", [])
    return MaterializeResult(metadata={
        "warm_start": (f"from the published head ({warm['init_sha256'][:12]}): {warm['lm_head_rows_kept']} "
                       f"lm_head rows kept, {warm['lm_head_rows_new']} new") if warm else f"no: {why}",
        "warm_start_version": version, "inputs_sha256": inputs,
        **summary_metadata({**({"heldout_simulated_acceptance": float(heldout)} if heldout is not None else {}),
                            "train_simulated_acceptance": float(summary.get("train_simulated_acceptance", 0.0)),
                            **({"final_loss": float(history[-1]["loss"])} if history else {})}),
        "heldout_acc_k": dict_table({str(k): float(a) for k, a in enumerate(heldout_acc)}, "position k", "acceptance"),
        "training_curves": training_curves(history, heldout_acc),
        "workloads": ", ".join(features_for(storage, target, "train")),
        "eval_workloads": ", ".join(features_for(storage, target, "eval")), **target.lineage(),
        "export_uri": location(export_uri), "checkpoint_uri": location(ckpt_uri),
        "head_sha256": MetadataValue.text(head or "unknown"),  # the benchmark report's header names it
        "loss_curve": MetadataValue.md(loss_table(history)),
        **summary_metadata({k: v for k, v in summary.items()
                            if k in ("steps", "epochs", "samples", "samples_left_out", "train_tokens",
                                     "train_tokens_per_s", "resumed_from", "compute_dtype", "device", "world_size")}),
        **summary_metadata({k: v for k, v in exported.items() if k != "export_dir"}, prefix="export_")})


def head_sha256(export_dir: Path) -> str | None:
    """The exported head's identity: the sha256 of its weights file (what the embedded server reports
    on /server_info, and so the benchmark report's header); None where the export is not local."""
    from eagle3_platform.draft.export import WEIGHTS_FILE
    from eagle3_platform.store.records import sha256_file

    weights = Path(export_dir) / WEIGHTS_FILE
    return sha256_file(weights) if weights.is_file() else None


def _warm_start_from(context, storage: StorageResource, preset: PresetResource, version: str,
                     inputs: str) -> tuple[Path | None, str]:
    """-> (the published head's dir, "") if this build may start from it, else (None, why not). It
    may when the preset warm-starts (`warm_start_epochs`), the published head was made at this code
    and settings `version` on other inputs (the data grew: `eagle3 run --prompts-per-workload`), and
    the run is not a forced rebuild. On the same inputs a build trains from scratch, as the head was."""
    if not preset.config().train.warm_start_epochs:
        return None, f"the {preset.name} preset trains from scratch"
    if context.run.tags.get(REBUILD_TAG) == "true":
        return None, f"a forced rebuild ({REBUILD_TAG})"
    last = last_metadata(context)
    if not last:
        return None, "the first build"
    if last.get("warm_start_version") != version:
        return None, "code or settings changed since the last build"
    if last.get("inputs_sha256") == inputs:
        return None, "the published head was trained on these inputs"
    files = [f"{Keys.DRAFT}/{name}" for name in (DRAFT_WEIGHTS, DRAFT_CONFIG)]
    if not all(storage.exists(f) for f in files):
        return None, "the published head is gone"
    weights, _ = (storage.fetch(f) for f in files)  # both land in one local dir (a bucket's: a cache)
    return weights.parent, ""


def training_curves(history: list[dict], heldout_acc: list[float]) -> MetadataValue:
    """The training loss and acceptance curves (and the held-out acceptance per draft position) as
    PNG images inline in markdown, so the asset page shows them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return MetadataValue.md("(no training history)")
    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, [h["loss"] for h in history], marker=".", color="tab:blue")
    ax_loss.set(xlabel="training step", ylabel="TTT loss", title="training loss")
    ax_acc.plot(steps, [h["acc"][0] for h in history], marker=".", label="acc_0 (first draft token)")
    ax_acc.set(xlabel="training step", ylabel="acceptance rate", ylim=(0, 1), title="acceptance (train)")
    twin = ax_acc.twinx()
    twin.plot(steps, [h["simulated_acceptance"] for h in history], color="tab:orange", marker=".",
              label="simulated acceptance length")
    twin.set_ylabel("simulated acceptance length (tokens)")
    ax_acc.legend(loc="lower left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    for ax in (ax_loss, ax_acc):
        ax.grid(True, alpha=0.3)
    images = {"training loss and acceptance": figure_png(fig)}
    if heldout_acc:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar([str(k) for k in range(len(heldout_acc))], heldout_acc, color="tab:green")
        ax.set(xlabel="draft position k", ylabel="acceptance rate", ylim=(0, 1),
               title="held-out acceptance per draft position")
        images["held-out acceptance per position"] = figure_png(fig)
    return png_markdown(images)


def loss_table(history: list[dict], rows: int = 12) -> str:
    """A compact markdown table of the logged training curve (every n-th entry)."""
    if not history:
        return "(no history)"
    step = max(1, len(history) // rows)
    lines = ["| step | loss | acc_0 | sim. acceptance |", "|---|---|---|---|"]
    for h in history[::step] + ([history[-1]] if (len(history) - 1) % step else []):
        lines.append(f"| {h['step']} | {h['loss']:.3f} | {h['acc'][0]:.3f} | {h['simulated_acceptance']:.3f} |")
    return "\n".join(lines)
