"""`run_with_summary`: the one reader of the CLI contract (last stdout line = JSON summary)."""
import sys

from eagle3_platform.cli.summary import run_with_summary


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_summary_is_the_last_json_line_and_every_line_is_echoed():
    lines = []
    rc, s = run_with_summary(_py("print('step 1'); print('{\"ok\": true, \"n\": 1}'); print('{\"ok\": true, \"n\": 2}')"),
                             echo=lines.append)
    assert rc == 0 and s == {"ok": True, "n": 2} and len(lines) == 3


def test_failures_always_carry_ok_false_and_an_error():
    rc, s = run_with_summary(_py("import sys; print('{\"ok\": false, \"error\": \"bad --in\"}'); sys.exit(2)"))
    assert (rc, s["ok"], s["error"]) == (2, False, "bad --in")
    rc, s = run_with_summary(_py("raise ValueError('boom')"), stderr=-2)  # -2 = subprocess.STDOUT
    assert rc == 1 and s == {"ok": False, "error": "ValueError: boom"}
    rc, s = run_with_summary(_py("import sys; print('{\"ok\": true}'); sys.exit(3)"))  # exit code wins
    assert rc == 3 and s == {"ok": False, "error": "exited 3"}
    rc, s = run_with_summary(_py("print('no summary')"))
    assert rc == 0 and s == {"ok": False, "error": "exited 0 without a JSON summary"}


def test_stopping_the_caller_stops_the_command_it_runs(tmp_path):
    """SIGTERM to a process inside run_with_summary (`eagle3 run`) reaches the command it runs (the
    launcher), which ends; the caller goes on to report it, and the command is not left running on its
    own. A signal the caller ignores (SIGHUP under nohup) stays ignored by both."""
    import os
    import signal
    import subprocess
    import time

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    pid_file = tmp_path / "command.pid"
    command = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
               "print('started', flush=True); time.sleep(120)")
    # the caller's dispositions as `nohup eagle3 run` has them, whatever this test process inherited
    caller = ("import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_DFL); "
              "signal.signal(signal.SIGHUP, signal.SIG_IGN); from eagle3_platform.cli.summary import run_with_summary; "
              f"rc, s = run_with_summary([sys.executable, '-c', {command!r}]); print(rc, s['ok']); sys.exit(1)")
    proc = subprocess.Popen(_py(caller), stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None and alive(pid)  # ignored, as nohup asked
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1 and out.split() == [str(-signal.SIGTERM), "False"]
        assert not alive(pid)  # reaped by the caller's wait: gone
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)  # only if the test failed: the command it started
