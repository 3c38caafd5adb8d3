"""`eagle3`: every stage runs standalone (the same requests run as Dagster Pipes workers).

Each area's subcommands are one module of this package (`add_commands(subparsers)` in cli/data.py,
cli/features.py, ...), which only turn argv into the stage's request (eagle3_platform.stage); this
module assembles them and owns the contract: the last line a command prints is a one-line JSON
summary, and bad input is a one-line error with exit code 2, never a traceback. The area modules are
loaded by name when the parser is built, and load torch only when a command runs.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from pydantic import ValidationError

AREAS = (
    "eagle3_platform.cli.data",
    "eagle3_platform.cli.features",
    "eagle3_platform.cli.draft",
    "eagle3_platform.cli.spec",
    "eagle3_platform.cli.serve",
    "eagle3_platform.cli.bench",
    "eagle3_platform.cli.run",
)


def add_prepare_target(sub) -> None:
    p = sub.add_parser("prepare-target", help="convert/cache the target as a plain HF checkpoint")
    p.add_argument("--model", required=True, help="smollm2-135m-instruct | tiny-random | PATH")
    p.add_argument("--out", required=True)
    p.set_defaults(func=prepare_target)


def prepare_target(a) -> dict:
    from eagle3_platform.model.target import prepare_target
    from eagle3_platform.store.checks import output_dir

    output_dir(a.out)
    return {"out": a.out, **prepare_target(a.model, a.out)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_prepare_target(sub)
    for name in AREAS:
        importlib.import_module(name).add_commands(sub)
    return parser


def emit_summary(summary: dict) -> None:
    """The contract: the last line a command prints is its JSON summary."""
    print(json.dumps(summary, sort_keys=True, default=str), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = args.func(args)
    except (ValueError, OSError) as e:  # bad input, failed stage, the file system's refusals: one line
        from eagle3_platform.stage import describe

        msg = describe(e) if isinstance(e, ValidationError) else str(e)
        print(f"eagle3 {args.command}: error: {msg}", file=sys.stderr)
        emit_summary({"ok": False, "error": msg})
        return 2
    emit_summary({"ok": True, **(summary or {})})
    return 0
