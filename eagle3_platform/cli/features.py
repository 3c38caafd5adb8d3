"""`eagle3 extract` (argv → eagle3_platform.features.stages.ExtractRequest) and `eagle3 verify-features`."""
from __future__ import annotations

import argparse

from eagle3_platform.cli.args import add_compute_args, add_preset_arg


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract", help="target hidden states of conversations -> feature shards")
    p.add_argument("--target", required=True, help="prepared target dir")
    p.add_argument("--in", dest="conv", required=True, help="conversation records (JSONL)")
    p.add_argument("--out", required=True, help="feature dir (local path or gs://bucket/path)")
    add_preset_arg(p)
    p.add_argument("--samples-per-shard", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="padded tokens per forward (0 = one conversation at a time; -1 = from free GPU memory)")
    p.add_argument("--device-map", default=None,
                   help="load the target sharded: auto | balanced | sequential | JSON {module: device} "
                        "(devices: GPU index, cpu, disk)")
    p.add_argument("--max-memory", default=None, help='with --device-map: JSON {device: size}, e.g. {"0": "70GiB"}')
    p.add_argument("--offload-folder", default=None, help="with --device-map: where its 'disk' entries live")
    p.add_argument("--from-engine", default=None, metavar="DIR",
                   help="import the hidden states vLLM's extract_hidden_states wrote to DIR instead of "
                        "running the target (docs/PRODUCTION.md)")
    add_compute_args(p)
    p.set_defaults(func=_extract)

    v = sub.add_parser("verify-features", help="check every shard of a feature dir against its manifest")
    v.add_argument("--dir", required=True)
    v.set_defaults(func=_verify)


def _extract(args) -> dict:
    from eagle3_platform.features.stages import ExtractRequest
    from eagle3_platform.stage import run

    return run(ExtractRequest(target=args.target, in_path=args.conv, out=args.out, preset=args.preset,
                              samples_per_shard=args.samples_per_shard, max_length=args.max_length,
                              batch_tokens=args.batch_tokens, device_map=args.device_map,
                              max_memory=args.max_memory, offload_folder=args.offload_folder,
                              from_engine=args.from_engine,
                              dtype=args.dtype, torch_threads=args.threads))


def _verify(args) -> dict:
    from eagle3_platform.features.shards import verify_shards

    report = verify_shards(args.dir)
    if report["bad"]:
        names = ", ".join(b["shard"] for b in report["bad"])
        raise ValueError(f"{len(report['bad'])} bad shard(s) in {args.dir}: {names}; "
                         + "; ".join(b["reason"] for b in report["bad"]))
    return report
