"""`eagle3 sources | filter | regenerate`: the data stages, each standalone (and as a Pipes worker).

Every command returns its summary dict; eagle3_platform.cli prints it as the last line (JSON).
Heavy imports (presidio, transformers, torch) happen inside the commands, so `eagle3 --help` is fast.
"""
from __future__ import annotations

import os
from pathlib import Path

from eagle3_platform.cli_args import distinct_paths, output_file, require_positive


def add_commands(sub) -> None:
    p = sub.add_parser("sources", help="write one workload's prompt records (JSONL)")
    p.add_argument("--workload", required=True, help="chat | multi_turn | code | math | long_context")
    p.add_argument("--limit", type=int, default=None, help="records to write (default: the preset's)")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--split", choices=("train", "eval"), default="train")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--preset", default="full", help="source preset (limits, long-context size): tiny | demo | full")
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
    p.add_argument("--preset", default="demo", help="regeneration preset for the default --max-tokens")
    p.add_argument("--no-decontaminate", action="store_true",
                   help="skip eval-set decontamination (only for eval splits themselves)")
    p.set_defaults(func=cmd_filter)

    p = sub.add_parser("regenerate", help="the target answers the kept prompts (locally or via an endpoint)")
    p.add_argument("--target", required=True, help="prepared target dir (tokenizer + template, local model)")
    p.add_argument("--in", dest="in_path", required=True, help="kept prompt records JSONL")
    p.add_argument("--out", required=True, help="conversation records JSONL (appended; resumable)")
    p.add_argument("--rejected", default=None, help="rejections JSONL (default: OUT stem + .rejected.jsonl)")
    p.add_argument("--preset", default="demo", help="tiny | demo | full")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None, help="prompt + response token budget")
    p.add_argument("--batch-size", type=int, default=None, help="local: conversations decoded together")
    p.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL (SGLang, vLLM, eagle3 serve)")
    p.add_argument("--concurrency", type=int, default=None, help="endpoint: requests in flight")
    p.add_argument("--api-key", default=os.environ.get("EAGLE3_API_KEY"),
                   help="endpoint bearer token (default: $EAGLE3_API_KEY)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; > 0 samples")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling: per-record seeds derive from it")
    p.add_argument("--no-scan-responses", action="store_true", help="skip the PII/DLP scan of responses")
    p.add_argument("--restart", action="store_true",
                   help="discard what --out/--rejected hold (e.g. written for another target) and start fresh")
    p.set_defaults(func=cmd_regenerate)


def cmd_sources(a) -> dict:
    from eagle3_platform.data.sources import write_workload

    output_file(a.out)
    return write_workload(a.workload, a.out, split=a.split, limit=a.limit, seed=a.seed, cfg=a.preset)


def cmd_filter(a) -> dict:
    from eagle3_platform.data.filter import filter_file

    _need_file(a.in_path)
    output_file(a.out)
    output_file(a.rejected, "--rejected")
    distinct_paths({"--in": a.in_path, "--out": a.out, "--rejected": a.rejected})
    require_positive(max_tokens=a.max_tokens)
    tokenizer, max_tokens = None, a.max_tokens
    if a.target:
        from eagle3_platform.data.regenerate import PRESETS, load_tokenizer

        tokenizer = load_tokenizer(_need_target(a.target))
        if max_tokens is None:
            cfg = _preset(PRESETS, a.preset)
            max_tokens = cfg.max_length - cfg.max_new_tokens
    elif max_tokens is not None:
        raise ValueError("--max-tokens needs --target (prompt length is measured with the target's template)")
    eval_keys = None
    if not a.no_decontaminate:
        from eagle3_platform.data.sources import eval_keys as compute_eval_keys

        eval_keys = compute_eval_keys()
    return filter_file(a.in_path, a.out, a.rejected, policy=a.policy, max_tokens=max_tokens,
                       tokenizer=tokenizer, eval_keys=eval_keys)


def cmd_regenerate(a) -> dict:
    from eagle3_platform.data.regenerate import PRESETS, default_rejected_path, regenerate_file, resolve_config

    require_positive(max_new_tokens=a.max_new_tokens, max_length=a.max_length, batch_size=a.batch_size,
                     concurrency=a.concurrency)
    _need_file(a.in_path)
    _need_target(a.target)
    output_file(a.out)
    output_file(a.rejected, "--rejected")
    distinct_paths({"--in": a.in_path, "--out": a.out, "--rejected": a.rejected or default_rejected_path(a.out)})
    cfg = resolve_config(_preset(PRESETS, a.preset), max_new_tokens=a.max_new_tokens,
                         max_length=a.max_length, batch_size=a.batch_size, concurrency=a.concurrency,
                         seed=a.seed, temperature=a.temperature, top_p=a.top_p,
                         do_sample=None if a.temperature is None else a.temperature > 0)
    return regenerate_file(a.target, a.in_path, a.out, cfg, endpoint=a.endpoint, rejected_path=a.rejected,
                           scanner=False if a.no_scan_responses else None, api_key=a.api_key,
                           restart=a.restart)


def _preset(presets: dict, name: str):
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(presets)}")
    return presets[name]


def _need_file(path: str) -> None:
    if not Path(path).is_file():
        raise FileNotFoundError(f"input not found: {path}")


def _need_target(path: str) -> str:
    from eagle3_platform.target import META_FILE

    if not (Path(path) / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a prepared target (run `eagle3 prepare-target`)")
    return path
