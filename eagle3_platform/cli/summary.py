"""The other side of the CLI contract: run a command whose last stdout line is its JSON summary
(`eagle3 …`, `python -m assets.launch`) and read that summary back. The ONE reader; used by `eagle3 run`,
the Pipes worker and the benchmark asset. Dagster-free."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
from typing import Callable

from eagle3_platform.serve.launch import die_with_parent

FORWARDED = (signal.SIGTERM, signal.SIGHUP)  # stopping the caller stops the command it runs
STOP_GRACE_S = 30.0  # a command the caller gave up on (an exception) gets this long to stop cleanly


def run_with_summary(cmd: list[str], echo: Callable[[str], None] | None = None, **popen) -> tuple[int, dict]:
    """Runs cmd, hands every stdout line to `echo` as it arrives, returns (exit code, summary).

    The summary is the last JSON object line. It always has "ok", false unless the command exited 0 and
    said ok, and then an "error": the command's own, else the first uncaught exception line, else
    that there was no summary. The command gets SIGTERM when this thread ends, SIGKILL included
    (serve.launch.die_with_parent): a killed caller leaves nothing running on its own."""
    summary, crash, proc = None, "", None
    with _Forwarder() as forwarder:
        try:
            proc = forwarder.attach(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1,
                                                     preexec_fn=die_with_parent(), **popen))
            for line in proc.stdout:
                if echo:
                    echo(line)
                summary = _json_object(line) or summary
                if not crash and "Error:" in line and not line.startswith("{"):
                    crash = line.strip()  # a traceback's last line, when the command died without a summary
            rc = proc.wait()
        except BaseException:  # Ctrl-C, or the caller's own interrupt: the command must not run on unowned
            if proc is not None:
                _stop(proc)
            raise
    if summary is None:
        summary = {"ok": False, "error": crash or f"exited {rc} without a JSON summary"}
    if rc != 0 or not summary.get("ok"):
        summary["ok"] = False
        summary["error"] = summary.get("error") or crash or f"exited {rc}"
    return rc, summary


class _Forwarder:
    """SIGTERM/SIGHUP sent to this process while the command runs go to the command too (without this,
    `kill` of `eagle3 run` would leave its launcher running on its own). Installed before the command starts,
    so none falls in between. A signal this process ignores stays ignored, the command's too (SIGHUP
    under nohup); a handler already installed (Dagster's, in a step) still runs after. Only the main
    thread can handle signals: elsewhere this does nothing."""

    def __init__(self):
        self.proc, self.pending, self.previous = None, [], {}

    def __enter__(self) -> "_Forwarder":
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def attach(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.proc = proc
        for sig in self.pending:  # arrived while the command was starting
            proc.send_signal(sig)
        return proc

    def _forward(self, signum, frame) -> None:
        if self.proc is None:
            self.pending.append(signum)
        elif self.proc.poll() is None:
            self.proc.send_signal(signum)
        if callable(self.previous.get(signum)):
            self.previous[signum](signum, frame)


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
