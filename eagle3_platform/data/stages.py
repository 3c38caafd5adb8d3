"""The data stages behind one seam (eagle3_platform.stage): sources → filter → regenerate.

Each request names the preset and the paths; fields left None take the preset's value. The same
request comes from an asset, a Pipes worker or `eagle3 sources | filter | regenerate`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3_platform.stage import ComputeRequest, PresetRequest, optional_count
from eagle3_platform.store.checks import distinct_paths, output_file



class SourcesRequest(PresetRequest):
    stage = "sources"
    workload: str
    out: str
    split: Literal["train", "eval"] = "train"
    limit: int | None = Field(default=None, ge=0)  # None: the preset's limit for this split
    seed: int | None = None  # None: the preset's (only math is generated)


class FilterRequest(PresetRequest):
    stage = "filter"
    in_path: str
    out: str
    rejected: str
    policy: Literal["drop", "redact"] = "drop"
    target: str | None = None  # prepared target dir: its template measures prompt length
    max_tokens: int | None = optional_count()  # None with a target: room the regeneration budget leaves
    max_length: int | None = optional_count()  # regeneration budget (prompt + response); None: the preset's
    decontaminate: bool = True  # False only for eval splits themselves

    @model_validator(mode="after")
    def _length_needs_target(self):
        if self.max_tokens is not None and not self.target:
            raise ValueError("--max-tokens needs --target (prompt length is measured with the target's template)")
        return self


class PublishedResponses(BaseModel):
    """A published regeneration output to continue from (data/regenerate.py: Published)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    out: str
    rejected: str | None = None  # None: it rejected nothing
    spent_s: float = Field(default=0.0, ge=0)  # of its time budget


class RegenerateRequest(ComputeRequest):
    stage = "regenerate"
    target: str
    in_path: str
    out: str  # appended; resumable
    rejected: str | None = None  # None: OUT stem + .rejected.jsonl
    max_new_tokens: int | None = optional_count()
    max_length: int | None = optional_count()
    batch_size: int | None = optional_count()
    concurrency: int | None = optional_count()
    temperature: float | None = Field(default=None, ge=0)  # 0 = greedy; > 0 samples
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    time_budget_s: float | None = Field(default=None, ge=0)  # None: the preset's; 0: no limit
    reasoning: Literal["keep", "drop"] | None = None  # None: the preset's (keep)
    device: str | None = None  # local: auto | cpu | cuda | cuda:N (target.pick_device); None: the preset's (auto)
    # OpenAI-compatible base URL(s), a list or comma-separated: data-parallel; None = the local target
    endpoint: str | list[str] | None = None
    served_model: str | None = None  # the id each endpoint's /v1/models must list; None: the target id
    api_key: str | None = Field(default=None, repr=False)
    scan_responses: bool = True
    restart: bool = False  # discard what out/rejected hold instead of resuming
    replace_stale: bool = False  # discard it only where made with another target or settings (staging dirs)
    continue_from: PublishedResponses | None = None  # where out and rejected do not exist yet


def need_file(path: str) -> None:
    if not Path(path).is_file():
        raise FileNotFoundError(f"input not found: {path}")


def need_target(path: str) -> str:
    from eagle3_platform.model.target import META_FILE

    if not (Path(path) / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a prepared target (run `eagle3 prepare-target`)")
    return path


def run_sources(req: SourcesRequest) -> dict:
    from eagle3_platform.data.sources import write_workload

    output_file(req.out)
    return write_workload(req.workload, req.out, split=req.split, limit=req.limit, seed=req.seed,
                          cfg=req.platform().sources)


def prompt_budget(req: FilterRequest) -> int:
    """Tokens a prompt may take: what the regeneration budget leaves after the longest answer."""
    regen = req.platform().regen
    return (req.max_length or regen.max_length) - regen.max_new_tokens


def run_filter(req: FilterRequest) -> dict:
    from eagle3_platform.data.filter import filter_file

    need_file(req.in_path)
    output_file(req.out)
    output_file(req.rejected, "--rejected")
    distinct_paths({"--in": req.in_path, "--out": req.out, "--rejected": req.rejected})
    tokenizer, max_tokens = None, req.max_tokens
    if req.target:
        from eagle3_platform.data.regenerate import load_tokenizer

        tokenizer = load_tokenizer(need_target(req.target))
        max_tokens = max_tokens or prompt_budget(req)
    keys = None
    if req.decontaminate:
        from eagle3_platform.data.sources import eval_keys

        keys = eval_keys()
    return filter_file(req.in_path, req.out, req.rejected, policy=req.policy, max_tokens=max_tokens,
                       tokenizer=tokenizer, eval_keys=keys, cfg=req.platform().filter)


def regen_config(req: RegenerateRequest):
    from eagle3_platform.data.regenerate import resolve_config

    t = req.temperature
    return resolve_config(req.platform().regen, max_new_tokens=req.max_new_tokens, max_length=req.max_length,
                          batch_size=req.batch_size, concurrency=req.concurrency, seed=req.seed,
                          temperature=t, top_p=req.top_p, do_sample=None if t is None else t > 0,
                          time_budget_s=req.time_budget_s, reasoning=req.reasoning, device=req.device,
                          **req.compute_overrides())


def run_regenerate(req: RegenerateRequest) -> dict:
    from eagle3_platform.data.regenerate import default_rejected_path, regenerate_file

    need_file(req.in_path)
    need_target(req.target)
    output_file(req.out)
    output_file(req.rejected, "--rejected")
    distinct_paths({"--in": req.in_path, "--out": req.out,
                    "--rejected": req.rejected or default_rejected_path(req.out)})
    return regenerate_file(req.target, req.in_path, req.out, regen_config(req), endpoint=req.endpoint,
                           rejected_path=req.rejected, scanner=None if req.scan_responses else False,
                           api_key=req.api_key, restart=req.restart, continue_from=published(req.continue_from),
                           replace_stale=req.replace_stale, served_model=req.served_model)


def published(src: PublishedResponses | None):
    from eagle3_platform.data.regenerate import Published

    return None if src is None else Published(Path(src.out), src.rejected and Path(src.rejected), src.spent_s)


RUNNERS = {SourcesRequest: run_sources, FilterRequest: run_filter, RegenerateRequest: run_regenerate}
