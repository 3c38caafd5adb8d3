"""Pipes worker: `python -m resources.pipes_worker <eagle3 args...>`.

Runs `eagle3 <args>` as a child process, forwards its output line by line, and reports the JSON
summary (the CLI's last line) to the orchestrator as a Pipes custom message. Uses only
`dagster_pipes` (the tiny client library), never `dagster` itself.
"""
from __future__ import annotations

import sys

from dagster_pipes import open_dagster_pipes

from eagle3_platform.summary import run_with_summary


def main(argv: list[str]) -> int:
    with open_dagster_pipes() as pipes:
        rc, summary = run_with_summary([sys.executable, "-m", "eagle3_platform.cli", *argv], echo=_forward)
        if not summary["ok"]:
            pipes.log.error(f"eagle3 {argv[0]} failed (exit {rc}): {summary['error']}")
            raise SystemExit(rc or 1)
        pipes.report_custom_message(summary)
    return 0


def _forward(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
