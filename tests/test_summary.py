"""`run_with_summary`: the one reader of the CLI contract (last stdout line = JSON summary)."""
import sys

from eagle3_platform.summary import run_with_summary


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
