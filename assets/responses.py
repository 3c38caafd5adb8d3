"""`target_responses`: the target regenerates every assistant turn under its own chat template;
records carry input_ids + loss_mask (response tokens only), template hash and target id.

A new regeneration time budget or a grown prompt set makes the responses stale, yet what was answered
stays right: when code and every other setting are the last materialization's (`continue_version`),
the step continues the published output instead of regenerating it all. A larger budget asks what the
smaller one deferred or cut short; a smaller one keeps what is there. New prompts (`eagle3 run
--prompts-per-workload`) are asked; the answers of prompts the input no longer holds are dropped (the
library checks each record's prompt, and starts afresh if one changed under its id). Any other change,
or a run tagged `eagle3/rebuild` (`eagle3 run --force`), starts afresh.
"""

import shutil

from dagster import AssetExecutionContext, MaterializeResult, asset

from assets.metadata import OWNERS, REBUILD_TAG, check_accounting, last_metadata, location, summary_metadata
from assets.partitions import SPLITS, Keys, workload_partitions
from assets.sensors import REBUILD_WHEN_UPSTREAM_CHANGED
from assets.prompts import filtered_prompts
from assets.versions import code_version
from eagle3_platform.data.stages import PublishedResponses, RegenerateRequest
from resources import ComputeResource, PresetResource, StorageResource, TargetResource

LOCAL_PATHS = ("uri", "out", "rejected_path")  # staging paths: gone after publishing, URIs reported instead


def _regen_split(context, w: str, split: str, storage, target, preset, compute, last: dict) -> dict:
    from eagle3_platform.store.records import sha256_file

    kept = storage.fetch(Keys.kept(w, split))
    kept_hash = sha256_file(kept)
    # Staging is keyed by the input's hash: a killed run resumes from its appended output; a changed
    # input starts fresh, and so does output made with another target or settings (an upgrade, a
    # re-prepared target: it cannot be resumed, and nothing but this step writes there).
    stage = storage.staging(Keys.conversations(w, split), preset.staging_key(kept_hash))
    out, rej = stage / "conversations.jsonl", stage / "rejected.jsonl"
    version = code_version('target_responses', preset, target, continuable=False)
    published, why = _continuable(context, storage, w, split, version, last,
                                  prefix="" if split == "train" else "eval_")
    summary = compute.run(context, RegenerateRequest(
        target=str(target.dir()), in_path=str(kept), out=str(out), rejected=str(rej), preset=preset.name,
        max_length=target.max_length, endpoint=target.endpoint, time_budget_s=preset.regen_time_budget_s,
        device=preset.regen_device,
        continue_from=published, replace_stale=True, **preset.compute()))
    check_accounting(summary, "written", f"{w}/{split}")
    summary.setdefault("continued_published", f"no: {why}")
    summary["continue_version"] = version
    summary["prompts_sha256"] = kept_hash
    summary["uri"] = storage.publish_from(out, Keys.conversations(w, split))
    summary["rejected_uri"] = storage.publish_from(rej, Keys.responses_rejected(w, split))
    shutil.rmtree(stage, ignore_errors=True)  # the run's sidecars (time spent, resume key) go with it
    return summary


def _continuable(context, storage, w, split, version, last: dict, prefix: str):
    """-> (the published output of this split, None) if this run may continue it: its last
    materialization was made at `version` (its time budget and prompts may differ), and the run is not
    a forced rebuild; else (None, why not). Continued with nothing changed, it asks nothing new."""
    if context.run.tags.get(REBUILD_TAG) == "true":
        return None, f"a forced rebuild ({REBUILD_TAG})"
    if not last:
        return None, "the first build"
    if last.get(f"{prefix}continue_version") != version:
        return None, "code or settings changed since the last build"
    if not storage.exists(Keys.conversations(w, split)):
        return None, "the published output is gone"
    rejected = Keys.responses_rejected(w, split)
    return PublishedResponses(out=str(storage.fetch(Keys.conversations(w, split))),
                              rejected=str(storage.fetch(rejected)) if storage.exists(rejected) else None,
                              spent_s=float(last.get(f"{prefix}time_spent_s") or 0.0)), ""


@asset(partitions_def=workload_partitions, automation_condition=REBUILD_WHEN_UPSTREAM_CHANGED,
       deps=[filtered_prompts], group_name="data",
       kinds={"pytorch", "jsonl"}, owners=OWNERS)
def target_responses(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
                     preset: PresetResource, compute: ComputeResource) -> MaterializeResult:
    """The target's own answers to one workload's kept prompts, turn by turn under its chat template
    (both splits): conversation records with input_ids and a loss mask over the response tokens, the
    template hash and target id; the rest rejected with reasons (PII in an answer, a template that
    cannot render or mask it, too long, left unstarted by the time budget)."""
    w = context.partition_key
    last = last_metadata(context)
    res = {s: _regen_split(context, w, s, storage, target, preset, compute, last) for s in SPLITS}
    meta = {"workload": w, "preset": preset.name, **target.lineage(),
            "template_hash": res["train"].get("template_hash", ""),
            "conversations_uri": location(res["train"]["uri"]),
            "eval_conversations_uri": location(res["eval"]["uri"])}
    for s in SPLITS:
        meta.update(summary_metadata({k: v for k, v in res[s].items() if k not in LOCAL_PATHS},
                                     prefix="" if s == "train" else "eval_"))
    return MaterializeResult(metadata=meta)
