"""Pipes worker: `python -m resources.pipes_worker <eagle3 args...>`.

Runs `eagle3 <args>` as a child process, forwards its output line by line, and reports the JSON
summary (the CLI's last line) to the orchestrator as a Pipes custom message. Uses only
`dagster_pipes` (the tiny client library), never `dagster` itself.
"""
from __future__ import annotations

import json
import subprocess
import sys

from dagster_pipes import open_dagster_pipes


def main(argv: list[str]) -> int:
    with open_dagster_pipes() as pipes:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3_platform.cli", *argv],
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        last = ""
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last = line
        rc = proc.wait()
        try:
            summary = json.loads(last)
        except json.JSONDecodeError:
            summary = {"ok": False, "error": "no JSON summary"}
        if rc != 0 or not summary.get("ok", False):
            pipes.log.error(f"eagle3 {argv[0]} failed (exit {rc}): {summary.get('error', '')}")
            raise SystemExit(rc or 1)
        pipes.report_custom_message(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
