"""Helpers shared by the Dagster tests (not a test module)."""
from dagster import materialize

from assets import ALL_ASSETS, ALL_CHECKS
from resources import ComputeResource, PresetResource, ServingResource, TargetResource

GRAPH = [*ALL_ASSETS, *ALL_CHECKS]


def tiny_resources(storage, target_dir, compute: str = "in_process") -> dict:
    return {"storage": storage, "preset": PresetResource(name="tiny"),
            "target": TargetResource(model=str(target_dir), prepared_dir=str(target_dir)),
            "compute": ComputeResource(mode=compute), "serving": ServingResource(mode="embedded")}


def run(selection, resources, instance, partition=None):
    return materialize(GRAPH, selection=selection, partition_key=partition, instance=instance,
                       resources=resources, raise_on_error=True)


def meta(result, name) -> dict:
    (mat,) = result.asset_materializations_for_node(name)
    return {k: getattr(v, "value", v) for k, v in mat.metadata.items()}


def check_prompts_and_responses(storage, result, workload: str) -> None:
    """The invariants of the first two partitioned assets, read back through the storage resource."""
    from eagle3_platform.store.records import ConversationRecord, PromptRecord, read_jsonl

    fp = meta(result, "filtered_prompts")
    assert fp["kept"] + fp["rejected"] == fp["read"] > 0
    assert fp["source_fingerprint"] and fp["workload"] == workload
    kept = [PromptRecord(**r) for r in read_jsonl(storage.fetch(f"{workload}/filtered_prompts/train/kept.jsonl"))]
    rej = list(read_jsonl(storage.fetch(f"{workload}/filtered_prompts/train/rejected.jsonl")))
    assert len(kept) == fp["kept"] and len(rej) == fp["rejected"]
    assert all(m.role in ("system", "user") for r in kept for m in r.messages)  # no source answers
    assert not storage.exists(f"{workload}/sources/train.jsonl")  # raw text never stored
    tr = meta(result, "target_responses")
    assert tr["written"] + tr["rejected"] == tr["read"] == fp["kept"]
    convs = [ConversationRecord(**r) for r in
             read_jsonl(storage.fetch(f"{workload}/target_responses/train/conversations.jsonl"))]
    assert len(convs) == tr["records"] >= tr["written"] > 0  # a conversation may be split into records
    for c in convs:
        assert len(c.input_ids) == len(c.loss_mask) and 0 < sum(c.loss_mask) < len(c.loss_mask)
        assert c.messages[-1].role == "assistant" and c.template_hash == tr["template_hash"]
        assert c.target_id == tr["target_id"]
