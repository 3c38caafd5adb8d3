"""`eagle3 extract` and `eagle3 verify-features`."""
from __future__ import annotations

import argparse
from dataclasses import replace

from eagle3_platform.cli_args import output_dir
from eagle3_platform.features.extract import PRESETS, extract_file
from eagle3_platform.features.shards import verify_shards


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract", help="target hidden states of conversations -> feature shards")
    p.add_argument("--target", required=True, help="prepared target dir")
    p.add_argument("--in", dest="conv", required=True, help="conversation records (JSONL)")
    p.add_argument("--out", required=True, help="feature dir (local path or gs://bucket/path)")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--samples-per-shard", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None)
    p.set_defaults(func=_extract)

    v = sub.add_parser("verify-features", help="check every shard of a feature dir against its manifest")
    v.add_argument("--dir", required=True)
    v.set_defaults(func=_verify)


def _extract(args) -> dict:
    output_dir(args.out)
    cfg = PRESETS[args.preset]
    overrides = {k: v for k, v in (("samples_per_shard", args.samples_per_shard),
                                   ("max_length", args.max_length)) if v is not None}
    return extract_file(args.target, args.conv, args.out, replace(cfg, **overrides))


def _verify(args) -> dict:
    report = verify_shards(args.dir)
    if report["bad"]:
        names = ", ".join(b["shard"] for b in report["bad"])
        raise ValueError(f"{len(report['bad'])} bad shard(s) in {args.dir}: {names}; "
                         + "; ".join(b["reason"] for b in report["bad"]))
    return report
