"""Start/stop the embedded server as a subprocess (used by the deployment asset and tests).

`start_embedded_server` runs `python -m eagle3_platform.cli serve ...` in its own process group,
learns the bound port from a ready file (port 0 → the server picks a free port itself, so there is
no pick-then-bind race), waits for /health, and fails with the tail of the server log otherwise.
"""
from __future__ import annotations

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

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (graceful), then SIGKILL after `timeout`. Returns the exit code."""
        code = stop_process(self.proc, timeout) if self.proc else None
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
                          env: dict | None = None) -> ServerHandle:
    """Spawn `eagle3 serve`, wait until /health answers, return a handle that stops it by PID."""
    cmd = serve_command(target_dir, draft_dir, host, port, None, spec, None, extra_args)
    return spawn_server(cmd, api_key=api_key, log_path=log_path, timeout=timeout, env=env)


def spawn_server(cmd: list[str], *, api_key: str | None = None, log_path=None,
                 timeout: float = HEALTH_TIMEOUT_S, env: dict | None = None) -> ServerHandle:
    """Run a server command that understands `--ready-file PATH`; wait for it to be healthy."""
    from eagle3_platform.serve.server import check_api_key

    check_api_key(api_key or None)  # the server would refuse it at startup anyway; say so at once
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
                                stderr=subprocess.STDOUT, env=penv, start_new_session=True)
    own_log = log_path.parent == workdir
    try:
        url = _wait_ready(ready, proc, timeout, log_path)
        wait_healthy(url, proc, timeout, log_path, "eagle3 serve")
    except BaseException:
        stop_process(proc)
        if not own_log:  # a temp log stays for a look: the error shows only its tail
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    ready.unlink()  # read once; gone, so no temp dir per server is left behind in /tmp
    if not own_log:
        workdir.rmdir()
    return ServerHandle(url=url, pid=proc.pid, log_path=log_path, api_key=api_key, proc=proc,
                        workdir=workdir if own_log else None)


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
