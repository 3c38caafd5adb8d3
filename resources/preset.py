"""The `preset` resource: one name (tiny | demo | cpu | full) selects every area's typed config, and the
compute overrides (dtype, torch_threads) apply to every stage that runs a model; the regeneration time
budget and the number of train prompts per workload can be overridden too.

Presets are named and resolved in one place, `eagle3_platform.config`; this resource only carries the
choice into the assets, which put it in each stage's request (eagle3_platform.stage).
"""
from __future__ import annotations

import hashlib
import json

from dagster import ConfigurableResource

from eagle3_platform.config import DEFAULT_PRESET


class PresetResource(ConfigurableResource):
    name: str = DEFAULT_PRESET
    dtype: str | None = None  # auto | bfloat16 | float32 (checked by each request); None: the presets'
    torch_threads: int | None = None  # None: each area preset's own; 0 = every core
    # None: the preset's; 0: no limit. It changes the responses' code version (stale) but not
    # staging_key, so a step that failed or stopped before publishing resumes its staging output and
    # takes up what it deferred; a published output made under another budget is continued
    # (assets/responses.py).
    regen_time_budget_s: float | None = None
    # where local regeneration decodes: auto | cpu | cuda | cuda:N (None: the preset's, auto = CUDA
    # where torch sees a GPU); a device asked for and absent fails the step at its start
    regen_device: str | None = None
    # None: the preset's; else train prompts per workload (SourceConfig.with_train_prompts). A larger
    # set keeps the smaller one's prompts, and the responses step continues what they were answered
    # with (assets/responses.py): growing the data asks only the new prompts.
    prompts_per_workload: int | None = None

    def config(self):
        """eagle3_platform.config.PlatformConfig of this preset (unknown names are refused there), with
        the time budget and prompt count overrides applied."""
        from eagle3_platform.config import preset
        from eagle3_platform.data.regenerate import resolve_config

        config = preset(self.name)
        if self.regen_time_budget_s is not None:
            config = config.with_(regen=resolve_config(config.regen, time_budget_s=self.regen_time_budget_s))
        if self.prompts_per_workload is not None:
            config = config.with_(sources=config.sources.with_train_prompts(self.prompts_per_workload))
        return config

    def area(self, area: str):
        return getattr(self.config(), area)

    def compute(self) -> dict:
        """The compute overrides, as ComputeRequest fields."""
        return {k: v for k, v in (("dtype", self.dtype), ("torch_threads", self.torch_threads)) if v is not None}

    def identity(self) -> str:
        """The preset and its overrides, as one string (part of what a step's output depends on)."""
        return self.name + (json.dumps(self.compute(), sort_keys=True) if self.compute() else "")

    def staging_key(self, input_hash: str) -> str:
        """Key of a resumable step's staging dir: same input + same preset → same dir (a killed step
        resumes), anything else → a fresh one."""
        return hashlib.sha256(f"{input_hash}:{self.identity()}".encode()).hexdigest()
