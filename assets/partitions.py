"""The `workload` partitioning and the storage-key convention every asset shares.

Assets never hand tensors to each other through an IO manager: each writes its artifacts under a
well-known storage key and the downstream asset locates them by the same key. This module is the one
place that spells those keys.
"""

from dagster import StaticPartitionsDefinition

from eagle3_platform.store.records import WORKLOADS

workload_partitions = StaticPartitionsDefinition(list(WORKLOADS))


SPLITS = ("train", "eval")


def _per_split(template: str):
    """A key function (workload, split="train") -> "<workload>/<template with {split}>"."""
    return staticmethod(lambda workload, split="train": f"{workload}/{template.format(split=split)}")


class Keys:
    """Storage keys (relative, '/'-separated) for every artifact in the graph.

    The eval split (held-out slice + MT-bench) flows through the same steps as its own table, so the
    draft head can be scored on held-out features and the benchmark can use held-out prompts."""

    raw = _per_split("sources/{split}.jsonl")
    kept = _per_split("filtered_prompts/{split}/kept.jsonl")
    rejected = _per_split("filtered_prompts/{split}/rejected.jsonl")
    conversations = _per_split("target_responses/{split}/conversations.jsonl")
    responses_rejected = _per_split("target_responses/{split}/rejected.jsonl")
    features = _per_split("features/{split}")

    VOCAB = "draft/vocab"
    DRAFT = "draft/checkpoint"
    EXPORT = "draft/export"
    DEPLOYMENT = "deployment/deployment.json"
    BENCH = "bench"
