"""`eagle3 eval`: τ, tok/s and losslessness of a draft head on prompt records."""
from __future__ import annotations

from pathlib import Path

from eagle3_platform.cli.args import require_positive
from eagle3_platform.spec.config import PRESETS, get_preset
from eagle3_platform.store.checks import output_file
from eagle3_platform.store.records import write_json_atomic


def add_commands(sub) -> None:
    p = sub.add_parser("eval", help="speculative decoding eval: acceptance length, tok/s, losslessness")
    p.add_argument("--target", required=True, help="prepared target dir")
    p.add_argument("--draft", default=None, help="exported draft dir (omit: baseline decoding)")
    p.add_argument("--prompts", required=True, help="PromptRecord JSONL (first user turn is used)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--verify-lossless", action="store_true",
                   help="also decode with the target alone and count outputs that differ")
    p.add_argument("--spec", default="chain", choices=sorted(k for k in PRESETS if k != "baseline"))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--out", default=None, help="write the full result (per prompt) as JSON here")
    p.set_defaults(func=run_eval)


def run_eval(args) -> dict:
    import torch

    from eagle3_platform.spec.eval import evaluate

    output_file(args.out)
    require_positive(max_new_tokens=args.max_new_tokens, limit=args.limit, threads=args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.draft and not Path(args.draft).is_dir():
        raise FileNotFoundError(f"draft export dir {args.draft} not found")
    result = evaluate(args.target, args.draft, args.prompts, get_preset(args.spec), args.max_new_tokens,
                      args.verify_lossless, args.limit, args.temperature)
    if args.out:
        write_json_atomic(args.out, result, indent=2, sort_keys=True)
    summary = {k: v for k, v in result.items() if k != "per_prompt"}
    summary.setdefault("lossless_mismatches", None)  # only counted with --verify-lossless
    return summary
