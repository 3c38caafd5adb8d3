"""The other side of the CLI contract: run a command whose last stdout line is its JSON summary
(`eagle3 …`, `python -m pipeline`) and read that summary back. The ONE reader; used by `eagle3 run`,
the Pipes worker and the benchmark asset. Dagster-free."""
from __future__ import annotations

import json
import subprocess
from typing import Callable


def run_with_summary(cmd: list[str], echo: Callable[[str], None] | None = None, **popen) -> tuple[int, dict]:
    """Runs cmd, hands every stdout line to `echo` as it arrives, returns (exit code, summary).

    The summary is the last JSON object line. It always has "ok", false unless the command exited 0 and
    said ok, and then an "error": the command's own, else the first uncaught exception line, else
    that there was no summary."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, **popen)
    summary, crash = None, ""
    for line in proc.stdout:
        if echo:
            echo(line)
        summary = _json_object(line) or summary
        if not crash and "Error:" in line and not line.startswith("{"):
            crash = line.strip()  # a traceback's last line, when the command died without a summary
    rc = proc.wait()
    if summary is None:
        summary = {"ok": False, "error": crash or f"exited {rc} without a JSON summary"}
    if rc != 0 or not summary.get("ok"):
        summary["ok"] = False
        summary["error"] = summary.get("error") or crash or f"exited {rc}"
    return rc, summary


def _json_object(line: str) -> dict | None:
    if not line.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None
