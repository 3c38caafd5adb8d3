"""The other side of the CLI contract: run a command whose last stdout line is its JSON summary
(`eagle3 …`, `python -m pipeline`) and read that summary back. The ONE reader; used by `eagle3 run`,
the Pipes worker and the benchmark asset. Dagster-free."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import Callable

FORWARDED = (signal.SIGTERM, signal.SIGHUP)  # stopping the caller stops the command it runs
STOP_GRACE_S = 30.0  # a command the caller gave up on (an exception) gets this long to stop cleanly


def run_with_summary(cmd: list[str], echo: Callable[[str], None] | None = None, **popen) -> tuple[int, dict]:
    """Runs cmd, hands every stdout line to `echo` as it arrives, returns (exit code, summary).

    The summary is the last JSON object line. It always has "ok", false unless the command exited 0 and
    said ok, and then an "error": the command's own, else the first uncaught exception line, else
    that there was no summary."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, **popen)
    summary, crash = None, ""
    try:
        with _forwarding(proc):
            for line in proc.stdout:
                if echo:
                    echo(line)
                summary = _json_object(line) or summary
                if not crash and "Error:" in line and not line.startswith("{"):
                    crash = line.strip()  # a traceback's last line, when the command died without a summary
            rc = proc.wait()
    except BaseException:  # Ctrl-C, or the caller's own interrupt: the command must not run on unowned
        _stop(proc)
        raise
    if summary is None:
        summary = {"ok": False, "error": crash or f"exited {rc} without a JSON summary"}
    if rc != 0 or not summary.get("ok"):
        summary["ok"] = False
        summary["error"] = summary.get("error") or crash or f"exited {rc}"
    return rc, summary


@contextmanager
def _forwarding(proc: subprocess.Popen):
    """SIGTERM/SIGHUP sent to this process go to the command too (without this, `kill` of `eagle3 run`
    left the pipeline running on its own). A handler already installed (Dagster's interrupt handler in
    a step) still runs after. Signals can only be handled in the main thread; elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)
        if callable(previous.get(signum)):
            previous[signum](signum, frame)

    for sig in FORWARDED:
        previous[sig] = signal.signal(sig, forward)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _json_object(line: str) -> dict | None:
    if not line.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None
