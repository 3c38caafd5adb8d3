"""The extract stage behind one seam (eagle3_platform.stage): conversations → feature shards."""
from __future__ import annotations

from pydantic import Field

from eagle3_platform.stage import ComputeRequest, optional_count
from eagle3_platform.store.checks import output_dir


class ExtractRequest(ComputeRequest):
    stage = "extract"
    target: str
    in_path: str  # conversation records (JSONL)
    out: str  # feature dir (local path or gs://bucket/path); resumable per shard
    samples_per_shard: int | None = optional_count()
    max_length: int | None = optional_count()
    batch_tokens: int | None = Field(default=None, ge=-1)  # -1 = from free GPU memory
    # sharded loading of a target no single device holds (FeatureConfig.device_map): None = the preset's
    device_map: str | None = None  # "auto" | "balanced" | "sequential" | JSON {module: device}
    max_memory: str | None = None  # JSON {device: size}, e.g. {"0": "70GiB", "cpu": "200GiB"}
    offload_folder: str | None = None
    # hidden states an inference engine captured (vLLM extract_hidden_states files): imported, the
    # target not loaded (features/engine_import.py)
    from_engine: str | None = None


def feature_config(req: ExtractRequest):
    from dataclasses import replace

    cfg = req.platform().features
    fields = {"samples_per_shard": req.samples_per_shard, "max_length": req.max_length,
              "target_dtype": req.dtype, "batch_tokens": req.batch_tokens, "device_map": req.device_map,
              "max_memory": req.max_memory, "offload_folder": req.offload_folder}  # the target's compute dtype; stored features keep cfg.dtype
    return replace(cfg, **{k: v for k, v in fields.items() if v is not None})


def run_extract(req: ExtractRequest) -> dict:
    from eagle3_platform.features.extract import extract_file
    from eagle3_platform.model.compute import set_threads

    output_dir(req.out)
    if req.torch_threads is not None:  # FeatureConfig has no thread setting: torch's default otherwise
        set_threads(req.torch_threads)
    if req.from_engine:
        from eagle3_platform.features.engine_import import import_engine_dir

        return import_engine_dir(req.target, req.from_engine, req.in_path, req.out, feature_config(req))
    return extract_file(req.target, req.in_path, req.out, feature_config(req))


RUNNERS = {ExtractRequest: run_extract}
