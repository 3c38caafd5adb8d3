"""Start/stop the embedded server as a subprocess (used by the deployment asset and tests).

`start_embedded_server` runs `python -m eagle3_platform.cli serve ...` in its own session (a Ctrl-C
meant for the caller reaches the caller, which stops it), learns the bound port from a ready file
(port 0 → the server picks a free port itself, so there is no pick-then-bind race), waits for
/health, and fails with the tail of the server log otherwise.

No orphans: a transient server gets SIGTERM when the thread that started it ends (Linux parent-death
signal), however that ends, SIGKILL included. A `ServerRegistry` (one JSON file per server under a
data dir's `servers/`) records every server started for that data dir: its pid, command line and
start time (so a recycled pid is never taken for it), who started it, and whether it is persistent
(meant to outlive its starter: no parent-death signal). The next start reaps what it recorded and
nobody owns any more; `eagle3 stop` stops the persistent ones.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

HEALTH_TIMEOUT_S = 180.0   # SmolLM2 load + first forward on a busy 2-core machine
POLL_S = 0.25
STOP_TIMEOUT_S = 15.0
LOG_TAIL_CHARS = 3000


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no log)"


@dataclass
class ServerHandle:
    url: str
    pid: int
    log_path: Path
    api_key: str | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    workdir: Path | None = None  # a temp dir of ours (the log when none was asked for): gone at stop
    registry: "ServerRegistry | None" = field(default=None, repr=False)
    persistent: bool = False  # outlives its starter (no parent-death signal); stopped by `eagle3 stop`
    reaped: list[int] = field(default_factory=list)  # leftovers the registry stopped before this start

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (graceful), then SIGKILL after `timeout`. Returns the exit code."""
        code = stop_process(self.proc, timeout) if self.proc else None
        if self.registry is not None:
            self.registry.forget(self.pid)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int | None:
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log_path: Path | None,
                 what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before becoming healthy;"
                               f" log tail:\n{log_tail(log_path) if log_path else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"{what} at {url} not healthy after {timeout:.0f}s; log tail:\n"
                       f"{log_tail(log_path) if log_path else ''}")


def serve_command(target_dir, draft_dir=None, host="127.0.0.1", port=0, api_key=None,
                  spec="chain", ready_file=None, extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "eagle3_platform.cli", "serve", "--target", str(target_dir),
           "--host", host, "--port", str(port), "--spec", spec]
    if draft_dir:
        cmd += ["--draft", str(draft_dir)]
    if ready_file:
        cmd += ["--ready-file", str(ready_file)]
    return cmd + list(extra or [])


def start_embedded_server(target_dir, draft_dir=None, host: str = "127.0.0.1", port: int = 0,
                          api_key: str | None = None, spec: str = "chain", log_path=None,
                          timeout: float = HEALTH_TIMEOUT_S, extra_args: list[str] | None = None,
                          env: dict | None = None, registry: "ServerRegistry | None" = None,
                          persistent: bool = False, role: str = "server") -> ServerHandle:
    """Spawn `eagle3 serve`, wait until /health answers, return a handle that stops it by PID."""
    cmd = serve_command(target_dir, draft_dir, host, port, None, spec, None, extra_args)
    return spawn_server(cmd, api_key=api_key, log_path=log_path, timeout=timeout, env=env,
                        registry=registry, persistent=persistent, role=role)


def spawn_server(cmd: list[str], *, api_key: str | None = None, log_path=None,
                 timeout: float = HEALTH_TIMEOUT_S, env: dict | None = None,
                 registry: "ServerRegistry | None" = None, persistent: bool = False,
                 role: str = "server") -> ServerHandle:
    """Run a server command that understands `--ready-file PATH`; wait for it to be healthy.
    Transient (default): it dies with the calling thread. persistent: it outlives it. registry: where
    it is recorded, after the leftovers recorded there are stopped."""
    from eagle3_platform.serve.server import check_api_key

    check_api_key(api_key or None)  # the server would refuse it at startup anyway; say so at once
    reaped = registry.reap() if registry is not None else []
    workdir = Path(tempfile.mkdtemp(prefix="eagle3-serve-"))
    log_path = Path(log_path) if log_path else workdir / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ready = workdir / "ready.json"
    penv = {**os.environ, **(env or {})}
    penv.setdefault("HF_HUB_OFFLINE", "1")
    penv.pop("EAGLE3_API_KEY", None)
    if api_key:  # through the environment, so the key is not visible in `ps`
        penv["EAGLE3_API_KEY"] = api_key
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(list(cmd) + ["--ready-file", str(ready)], stdout=logf,
                                stderr=subprocess.STDOUT, env=penv, start_new_session=True,
                                preexec_fn=None if persistent else die_with_parent())
    own_log = log_path.parent == workdir
    try:
        url = _wait_ready(ready, proc, timeout, log_path)
        if registry is not None:  # bound: it runs the server's command line now, not the fork's
            registry.record(proc.pid, url=url, role=role, persistent=persistent, log=log_path)
        wait_healthy(url, proc, timeout, log_path, "eagle3 serve")
    except BaseException:
        stop_process(proc)
        if registry is not None:
            registry.forget(proc.pid)
        if not own_log:  # a temp log stays for a look: the error shows only its tail
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    ready.unlink()  # read once; gone, so no temp dir per server is left behind in /tmp
    if not own_log:
        workdir.rmdir()
    return ServerHandle(url=url, pid=proc.pid, log_path=log_path, api_key=api_key, proc=proc,
                        workdir=workdir if own_log else None, registry=registry, persistent=persistent,
                        reaped=reaped)


def _wait_ready(ready: Path, proc: subprocess.Popen, timeout: float, log_path: Path) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())["url"]
        if proc.poll() is not None:
            raise RuntimeError(f"eagle3 serve exited with code {proc.returncode}; log tail:\n"
                               f"{log_tail(log_path)}")
        time.sleep(POLL_S)
    raise TimeoutError(f"eagle3 serve did not bind within {timeout:.0f}s; log tail:\n"
                       f"{log_tail(log_path)}")


# ---- no orphans: tied to the starter, recorded, reaped ---------------------------------------------
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
REGISTRY_DIR = "servers"  # under a data dir: one <pid>.json per server started for it


def _prctl() -> Callable | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets `sig` when the thread that started it ends, however it ends
    (Linux PR_SET_PDEATHSIG; survives exec). A starter already gone by then sends it at once.
    Resolved before the fork, so the child only makes the one call. Elsewhere: does nothing."""
    prctl, parent = _prctl(), os.getpid()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, sig)
            if os.getppid() != parent:  # died between fork and prctl
                os.kill(os.getpid(), sig)
    return preexec


def process_identity(pid: int) -> tuple[list[str], int] | None:
    """(command line, start time in clock ticks since boot) of a running process, None when there is
    none (or it is a zombie, or /proc cannot tell). Together they name one process: a recycled pid
    has another start time."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
    if fields[0] in ("Z", "X"):
        return None
    return [a.decode(errors="replace") for a in cmdline if a], int(fields[19])


class ServerRegistry:
    """The servers started for one data dir, each a JSON file `<pid>.json` in `directory`: pid,
    command line and start time (who it is), the starter's pid and start time (whether anyone still
    owns it), url, role, persistent, log. A record whose process is gone is dropped when read."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def record(self, pid: int, url: str | None, role: str, persistent: bool, log=None) -> Path:
        from eagle3_platform.store.records import write_json_atomic

        ident, owner = process_identity(pid), process_identity(os.getpid())
        if ident is None:
            raise RuntimeError(f"server pid {pid} is not running: nothing to record")
        rec = {"pid": pid, "cmdline": ident[0], "start_ticks": ident[1], "url": url, "role": role,
               "persistent": persistent, "log": str(log) if log else None, "owner_pid": os.getpid(),
               "owner_start_ticks": owner[1] if owner else None, "started_at": time.time()}
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{pid}.json"
        write_json_atomic(path, rec, indent=2, sort_keys=True)
        return path

    def forget(self, pid: int) -> None:
        (self.dir / f"{pid}.json").unlink(missing_ok=True)

    def entries(self) -> list[dict]:
        """Records of servers still running (the same process: command line and start time agree),
        each with `owned`: its starter still runs. Others' files are removed."""
        out = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                rec = json.loads(path.read_text())
                ident = process_identity(int(rec["pid"]))
            except (OSError, ValueError, KeyError, TypeError):
                ident, rec = None, None
            if rec is None or ident != (rec["cmdline"], rec["start_ticks"]):
                path.unlink(missing_ok=True)  # gone, or its pid now names another process
                continue
            owner = process_identity(int(rec.get("owner_pid") or 0))
            out.append({**rec, "owned": owner is not None and owner[1] == rec.get("owner_start_ticks")})
        return out

    def reap(self) -> list[int]:
        """Stop the recorded transient servers whose starter is gone (leftovers of a killed run) ->
        their pids. Persistent ones and those of a starter still running stay."""
        return [self._stop(r) for r in self.entries() if not r["owned"] and not r["persistent"]]

    def stop(self, role: str | None = None) -> list[int]:
        """Stop the persistent servers (of `role`, when given) and the leftovers -> their pids. A
        transient server of a starter still running is its starter's to stop."""
        return [self._stop(r) for r in self.entries()
                if (r["persistent"] or not r["owned"]) and role in (None, r["role"])]

    def _stop(self, rec: dict, timeout: float = STOP_TIMEOUT_S) -> int:
        pid, ident = rec["pid"], (rec["cmdline"], rec["start_ticks"])
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, timeout)):
            if process_identity(pid) != ident:
                break
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and process_identity(pid) == ident:
                time.sleep(POLL_S)
        self.forget(pid)
        return pid
