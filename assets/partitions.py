"""The `workload` partitioning and the storage-key convention every asset shares.

Assets never hand tensors to each other through an IO manager: each writes its artifacts under a
well-known storage key and the downstream asset locates them by the same key. This module is the one
place that spells those keys.
"""

from dagster import StaticPartitionsDefinition

from eagle3_platform.records import WORKLOADS

workload_partitions = StaticPartitionsDefinition(list(WORKLOADS))


SPLITS = ("train", "eval")


class Keys:
    """Storage keys (relative, '/'-separated) for every artifact in the graph.

    The eval split (held-out slice + MT-bench) flows through the same steps as its own table, so the
    draft head can be scored on held-out features and the benchmark can use held-out prompts."""

    @staticmethod
    def raw(workload: str, split: str = "train") -> str:
        return f"{workload}/sources/{split}.jsonl"

    @staticmethod
    def kept(workload: str, split: str = "train") -> str:
        return f"{workload}/filtered_prompts/{split}/kept.jsonl"

    @staticmethod
    def rejected(workload: str, split: str = "train") -> str:
        return f"{workload}/filtered_prompts/{split}/rejected.jsonl"

    @staticmethod
    def conversations(workload: str, split: str = "train") -> str:
        return f"{workload}/target_responses/{split}/conversations.jsonl"

    @staticmethod
    def responses_rejected(workload: str, split: str = "train") -> str:
        return f"{workload}/target_responses/{split}/rejected.jsonl"

    @staticmethod
    def features(workload: str, split: str = "train") -> str:
        return f"{workload}/features/{split}"

    VOCAB = "draft/vocab"
    DRAFT = "draft/checkpoint"
    EXPORT = "draft/export"
    DEPLOYMENT = "deployment/deployment.json"
    BENCH = "bench"
