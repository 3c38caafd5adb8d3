"""The `target` resource: which model the draft is trained for, prepared once and cached."""
from __future__ import annotations

import re
from pathlib import Path

from dagster import ConfigurableResource


class TargetResource(ConfigurableResource):
    """model: "smollm2-135m-instruct" | "tiny-random" | a local HF checkpoint directory."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    max_length: int | None = None  # None: the preset's max length
    prepared_dir: str | None = None  # None: <EAGLE3_CACHE>/prepared/<model name>
    endpoint: str | None = None  # OpenAI-compatible server of this target: regenerate through it
    # extraction of a target no single device holds (FeatureConfig.device_map): None = one device
    device_map: str | None = None  # "auto" | "balanced" | "sequential" | JSON {module: device}
    max_memory: str | None = None  # JSON {device: size}
    # hidden states an inference engine wrote (vLLM extract_hidden_states files, one directory for every
    # partition): feature_shards imports them instead of running the target (features/engine_import.py)
    engine_dir: str | None = None

    def dir(self) -> Path:
        """The prepared target directory (prepared on first use; cached afterwards)."""
        from eagle3_platform.model.target import cache_root, prepare_target

        if self.prepared_dir:
            out = Path(self.prepared_dir)
        else:
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self.model).name or self.model)
            out = cache_root() / "prepared" / name
        prepare_target(self.model, out)
        return out

    def meta(self) -> dict:
        from eagle3_platform.model.target import read_meta

        return read_meta(self.dir())

    def lineage(self) -> dict:
        """Metadata every asset that depends on the target carries."""
        m = self.meta()
        return {"target_id": m["target_id"], "target_weights_hash": m["weights_hash"],
                "capture_layer_ids": str(m["capture_layer_ids"])}
