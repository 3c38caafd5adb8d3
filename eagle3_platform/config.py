"""Named presets for the whole platform: one name (tiny | demo | cpu | full) selects every area's config.

Each area owns its typed config and its PRESETS (sources, pii, filter, regen, features, train, serve,
bench); this module only names and composes them, so there is one source of truth per setting.
Speculative decoding settings are named by shape (chain | tree | baseline), so each platform preset
picks one. The areas are imported when a preset is resolved, not when this module is: the CLI parses
its arguments (and validates a preset name) without loading torch or presidio.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3_platform.bench.run import BenchConfig
    from eagle3_platform.data.filter import FilterConfig
    from eagle3_platform.data.pii import PiiConfig
    from eagle3_platform.data.regenerate import RegenConfig
    from eagle3_platform.data.sources import SourceConfig
    from eagle3_platform.draft.train import TrainConfig
    from eagle3_platform.features.extract import FeatureConfig
    from eagle3_platform.serve.config import ServeConfig
    from eagle3_platform.spec.config import SpecConfig

# tiny: tests; demo: README command 1 on 2 CPU cores (<= 20 min); cpu: the best head 2 cores can train in
# <= 2 h; full: GPU-scale training.
PRESET_NAMES = ("tiny", "demo", "cpu", "full")
DEFAULT_PRESET = "demo"
# tiny runs on a random target, where drafting shape matters less than test speed.
# The embedded CPU server drafts adaptively with a prompt-lookup branch beside the head (spec/config.py,
# spec/lookup.py); `full` targets SGLang's fixed chain.
SPEC_FOR_PRESET = {"tiny": "tiny", "demo": "chain_adaptive_lookup", "cpu": "chain_adaptive_lookup",
                   "full": "chain"}


@dataclass(frozen=True)
class PlatformConfig:
    name: str
    sources: SourceConfig
    pii: PiiConfig
    filter: FilterConfig
    regen: RegenConfig
    features: FeatureConfig
    train: TrainConfig
    spec: SpecConfig
    serve: ServeConfig
    bench: BenchConfig

    def with_(self, **areas) -> "PlatformConfig":
        return replace(self, **areas)


def check_preset(name: str) -> str:
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESET_NAMES)}")
    return name


def preset(name: str) -> PlatformConfig:
    from eagle3_platform.bench.run import PRESETS as BENCH
    from eagle3_platform.data.filter import PRESETS as FILTER
    from eagle3_platform.data.pii import PRESETS as PII
    from eagle3_platform.data.regenerate import PRESETS as REGEN
    from eagle3_platform.data.sources import PRESETS as SOURCES
    from eagle3_platform.draft.train import PRESETS as TRAIN
    from eagle3_platform.features.extract import PRESETS as FEATURES
    from eagle3_platform.serve.config import PRESETS as SERVE
    from eagle3_platform.spec.config import PRESETS as SPEC

    check_preset(name)
    return PlatformConfig(
        name=name, sources=SOURCES[name], pii=PII[name], filter=FILTER[name], regen=REGEN[name],
        features=FEATURES[name], train=TRAIN[name], spec=SPEC[SPEC_FOR_PRESET[name]],
        serve=SERVE[name], bench=BENCH[name])
