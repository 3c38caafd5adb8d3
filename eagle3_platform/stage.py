"""The one seam between a caller and a heavy stage: a typed request in, a summary dict out.

Every heavy stage (sources, filter, regenerate, extract, vocab, train, export) has one request type
(preset name, paths, overrides; validated, unknown fields refused) and one `run_<stage>(request)` in
its area's `stages.py`. Callers never spell a stage twice:
- a Dagster asset builds the request once and hands it to the compute resource, which calls `run` in
  process or ships `to_payload(request)` (plain JSON) to a Pipes worker that calls the same `run`;
- each `eagle3 <stage>` command only turns argv into the request.
Torch, presidio and the area configs load when a stage runs, not when a request is built.
"""
from __future__ import annotations

import importlib
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eagle3_platform.config import DEFAULT_PRESET, check_preset

# The modules that define requests and their runners (each exposes RUNNERS: {request type: run fn}).
AREAS = ("eagle3_platform.data.stages", "eagle3_platform.features.stages", "eagle3_platform.draft.stages")


class StageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: ClassVar[str]


class PresetRequest(StageRequest):
    """A stage whose defaults come from a named preset (eagle3_platform.config)."""

    preset: str = DEFAULT_PRESET

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        return check_preset(v)

    def platform(self):
        """The preset's configs of every area (eagle3_platform.config.PlatformConfig)."""
        from eagle3_platform.config import preset

        return preset(self.preset)


class ComputeRequest(PresetRequest):
    """A stage that runs a model: the compute dtype and torch thread count override the preset's."""

    dtype: Literal["auto", "bfloat16", "float32"] | None = None
    torch_threads: int | None = Field(default=None, ge=0)  # 0 = every core this process may use

    def compute_overrides(self) -> dict:
        return {k: v for k, v in (("dtype", self.dtype), ("torch_threads", self.torch_threads))
                if v is not None}


def optional_count():
    """An override of a count: None = the preset's value, else >= 1."""
    return Field(default=None, ge=1)


def runners() -> dict:
    found: dict = {}
    for name in AREAS:
        found.update(importlib.import_module(name).RUNNERS)
    return found


def run(request: StageRequest) -> dict:
    """Run one stage; returns its summary (what `eagle3 <stage>` prints as JSON)."""
    return runners()[type(request)](request)


def to_payload(request: StageRequest) -> dict:
    """JSON-safe form of a request (what the Pipes worker receives)."""
    return {"stage": request.stage, "request": request.model_dump(mode="json")}


def from_payload(payload: dict) -> StageRequest:
    types = {t.stage: t for t in runners()}
    stage = payload.get("stage")
    if stage not in types:
        raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(sorted(types))}")
    return types[stage].model_validate(payload.get("request") or {})


FLAGS = {"in_path": "--in", "torch_threads": "--threads", "weights_dtype": "--dtype"}  # CLI names


def describe(error: ValidationError) -> str:
    """A request's validation errors on one line, fields named as the CLI flags that set them."""
    parts = []
    for e in error.errors():
        name = ".".join(str(x) for x in e["loc"])
        flag = FLAGS.get(name, "--" + name.replace("_", "-")) if name else ""
        bound = (e.get("ctx") or {}).get("ge")
        if e["type"] == "greater_than_equal":
            parts.append(f"{flag} must be >= {bound}, not {e['input']}")
        else:
            parts.append(f"{flag}: " * bool(flag) + e["msg"].removeprefix("Value error, "))
    return "; ".join(parts)
