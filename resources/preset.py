"""The `preset` resource: one name (tiny | demo | full) selects every area's typed config.

`eagle3_platform.config.preset(name)` is the one source of truth; until it exists each area's own
`PRESETS` dict is read directly (same objects, found by area).
"""
from __future__ import annotations

import dataclasses
import importlib

from dagster import ConfigurableResource

from eagle3_platform.config import PRESET_NAMES

# Fallback only: where each area keeps its PRESETS when eagle3_platform.config is absent.
_AREA_MODULES = {
    "sources": ("eagle3_platform.data.sources",),
    "filter": ("eagle3_platform.data.filter",),
    "regen": ("eagle3_platform.data.regenerate",),
    "features": ("eagle3_platform.features.extract", "eagle3_platform.features"),
    "train": ("eagle3_platform.draft.train",),
    "spec": ("eagle3_platform.spec.config", "eagle3_platform.spec.engine", "eagle3_platform.spec"),
    "serve": ("eagle3_platform.serve.server", "eagle3_platform.serve"),
    "bench": ("eagle3_platform.bench.config", "eagle3_platform.bench.run", "eagle3_platform.bench"),
}


def area_config(preset: str, area: str):
    """The typed config of one area for a preset, or None when that area has no config yet."""
    if preset not in PRESET_NAMES:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESET_NAMES}")
    try:
        found = getattr(importlib.import_module("eagle3_platform.config").preset(preset), area, None)
        if found is not None:
            return found
    except ModuleNotFoundError as e:
        if e.name != "eagle3_platform.config":
            raise
    for name in _AREA_MODULES.get(area, ()):
        try:
            presets = getattr(importlib.import_module(name), "PRESETS", None)
        except ModuleNotFoundError:
            continue
        if presets and preset in presets:
            return presets[preset]
    return None


def with_overrides(cfg, **overrides):
    """dataclass/pydantic config with the given fields replaced (unknown fields and None ignored)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if cfg is None or not overrides:
        return cfg
    if dataclasses.is_dataclass(cfg):
        names = {f.name for f in dataclasses.fields(cfg)}
        return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if k in names})
    if hasattr(cfg, "model_copy"):
        fields = type(cfg).model_fields
        return cfg.model_copy(update={k: v for k, v in overrides.items() if k in fields})
    return cfg


def cfg_get(cfg, name: str, default=None):
    return getattr(cfg, name, default) if cfg is not None else default


class PresetResource(ConfigurableResource):
    name: str = "demo"

    def area(self, area: str):
        return area_config(self.name, area)
