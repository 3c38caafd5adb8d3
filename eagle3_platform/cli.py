"""`eagle3`: every stage runs standalone (and as a Dagster Pipes worker).

Each area registers its own subcommands (`add_commands(subparsers)` in its `cli.py`), so this module
only assembles them. Every command's last line of output is a one-line JSON summary.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

AREAS = (
    "eagle3_platform.target_cli",
    "eagle3_platform.data.cli",
    "eagle3_platform.features.cli",
    "eagle3_platform.draft.cli",
    "eagle3_platform.spec.cli",
    "eagle3_platform.serve.cli",
    "eagle3_platform.bench.cli",
    "eagle3_platform.run_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency, not an area not built yet
                raise
            continue
        module.add_commands(sub)
    return parser


def emit_summary(summary: dict) -> None:
    """The contract: the last line a command prints is its JSON summary."""
    print(json.dumps(summary, sort_keys=True, default=str), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = args.func(args)
    except (ValueError, OSError) as e:  # bad input, failed stage, the file system's refusals: one line
        print(f"eagle3 {args.command}: error: {e}", file=sys.stderr)
        emit_summary({"ok": False, "error": str(e)})
        return 2
    emit_summary({"ok": True, **(summary or {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
