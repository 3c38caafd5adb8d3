"""`eagle3 sources | filter | regenerate`: argv → the stage's request (eagle3_platform.data.stages).

Every command returns its summary dict; eagle3_platform.cli prints it as the last line (JSON).
Heavy imports (presidio, transformers, torch) happen when a stage runs, so `eagle3 --help` is fast.
"""
from __future__ import annotations

import os

from eagle3_platform.cli.args import add_compute_args, add_preset_arg
from eagle3_platform.data.stages import FilterRequest, RegenerateRequest, SourcesRequest
from eagle3_platform.stage import run


def add_commands(sub) -> None:
    p = sub.add_parser("sources", help="write one workload's prompt records (JSONL)")
    p.add_argument("--workload", required=True, help="chat | multi_turn | code | math | long_context")
    p.add_argument("--limit", type=int, default=None, help="records to write (default: the preset's)")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--split", choices=("train", "eval"), default="train")
    p.add_argument("--seed", type=int, default=None)
    add_preset_arg(p)
    p.set_defaults(func=cmd_sources)

    p = sub.add_parser("filter", help="validate, dedupe, decontaminate and PII/DLP-filter prompt records")
    p.add_argument("--in", dest="in_path", required=True, help="prompt records JSONL")
    p.add_argument("--out", required=True, help="kept records JSONL")
    p.add_argument("--rejected", required=True, help="rejection records JSONL (reasons only, no text)")
    p.add_argument("--policy", choices=("drop", "redact"), default="drop")
    p.add_argument("--target", default=None, help="prepared target dir: its template measures prompt length")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="reject prompts longer than this (needs --target; default with --target: the "
                        "regeneration preset's max_length - max_new_tokens)")
    add_preset_arg(p)
    p.add_argument("--no-decontaminate", action="store_true",
                   help="skip eval-set decontamination (only for eval splits themselves)")
    p.set_defaults(func=cmd_filter)

    p = sub.add_parser("regenerate", help="the target answers the kept prompts (locally or via an endpoint)")
    p.add_argument("--target", required=True, help="prepared target dir (tokenizer + template, local model)")
    p.add_argument("--in", dest="in_path", required=True, help="kept prompt records JSONL")
    p.add_argument("--out", required=True, help="conversation records JSONL (appended; resumable)")
    p.add_argument("--rejected", default=None, help="rejections JSONL (default: OUT stem + .rejected.jsonl)")
    add_preset_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None, help="prompt + response token budget")
    p.add_argument("--batch-size", type=int, default=None,
                   help="local: conversations decoded together (rows of the running batch)")
    p.add_argument("--endpoint", action="append", default=None,
                   help="OpenAI-compatible base URL (SGLang, vLLM, eagle3 serve); repeat (or comma-separate) "
                        "to spread the conversations over several servers of the same weights")
    p.add_argument("--served-model", default=None,
                   help="endpoint: the model id /v1/models must list (default: the prepared target's id)")
    p.add_argument("--concurrency", type=int, default=None, help="endpoint: requests in flight, per endpoint")
    p.add_argument("--api-key", default=os.environ.get("EAGLE3_API_KEY"),
                   help="endpoint bearer token (default: $EAGLE3_API_KEY)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; > 0 samples")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling: per-record seeds derive from it")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="wall minutes this output may take, counted across resumes; conversations not "
                        "begun by then are deferred (budget:time) and retried by a rerun with budget left "
                        "(default: the preset's; 0 = no limit)")
    p.add_argument("--no-scan-responses", action="store_true", help="skip the PII/DLP scan of responses")
    p.add_argument("--reasoning", choices=("keep", "drop"), default=None,
                   help="a reasoning target's thinking: trained as it is emitted (keep, the presets') or "
                        "not asked for and cut from the answers (drop)")
    p.add_argument("--restart", action="store_true",
                   help="discard what --out/--rejected hold (e.g. written for another target) and start fresh")
    add_compute_args(p)
    p.add_argument("--device", default=None,
                   help="local: auto | cpu | cuda | cuda:N, where the target decodes; auto = CUDA where torch "
                        "sees a GPU (default: the preset's, auto)")
    p.set_defaults(func=cmd_regenerate)


def cmd_sources(a) -> dict:
    return run(SourcesRequest(workload=a.workload, out=a.out, split=a.split, limit=a.limit, seed=a.seed,
                              preset=a.preset))


def cmd_filter(a) -> dict:
    return run(FilterRequest(in_path=a.in_path, out=a.out, rejected=a.rejected, policy=a.policy,
                             target=a.target, max_tokens=a.max_tokens, decontaminate=not a.no_decontaminate,
                             preset=a.preset))


def cmd_regenerate(a) -> dict:
    return run(RegenerateRequest(
        target=a.target, in_path=a.in_path, out=a.out, rejected=a.rejected, preset=a.preset,
        max_new_tokens=a.max_new_tokens, max_length=a.max_length, batch_size=a.batch_size,
        concurrency=a.concurrency, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
        time_budget_s=None if a.time_budget_min is None else a.time_budget_min * 60, reasoning=a.reasoning,
        endpoint=a.endpoint, served_model=a.served_model, api_key=a.api_key, scan_responses=not a.no_scan_responses, restart=a.restart,
        dtype=a.dtype, torch_threads=a.threads, device=a.device))
