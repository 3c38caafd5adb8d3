"""SGLang launcher: exact command, validation, and start/health/info/stop against a stand-in."""
from __future__ import annotations

import socket
import sys
import textwrap

import pytest

from eagle3_platform.serve.sglang import (SGLangConfig, SGLangServer, sglang_available,
                                          spec_accept_length)


def test_build_command_exact():
    cfg = SGLangConfig("T", "D", num_steps=3, eagle_topk=1, num_draft_tokens=4, port=30001)
    assert cfg.build_command("python") == [
        "python", "-m", "sglang.launch_server", "--model-path", "T",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "D",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--host", "127.0.0.1", "--port", "30001"]


def test_baseline_and_extras():
    cmd = SGLangConfig("T", mem_fraction_static=0.8, extra_args=("--chunked-prefill-size", "4096")).build_command("py")
    assert "--speculative-algorithm" not in cmd
    assert cmd[-4:] == ["--mem-fraction-static", "0.8", "--chunked-prefill-size", "4096"]
    # A draft without the three ints lets SGLang choose its defaults.
    cmd = SGLangConfig("T", "D").build_command("py")
    assert "--speculative-num-steps" not in cmd and "EAGLE3" in cmd


@pytest.mark.parametrize("kw,msg", [
    (dict(draft_path="D", num_steps=3), "all three"),
    (dict(draft_path="D", num_steps=3, eagle_topk=1), "all three"),
    (dict(num_steps=3, eagle_topk=1, num_draft_tokens=4), "draft model path"),
    (dict(draft_path="D", num_steps=3, eagle_topk=1, num_draft_tokens=8), "chain"),
    (dict(draft_path="D", num_steps=2, eagle_topk=2, num_draft_tokens=9), "tree size"),
    (dict(draft_path="D", num_steps=0, eagle_topk=1, num_draft_tokens=2), "num_steps>=1"),
    (dict(draft_path="D", num_steps=4, eagle_topk=4, num_draft_tokens=12, spec_v2=True), "topk=1"),
    (dict(port=0), "port"),
    (dict(mem_fraction_static=1.5), "mem_fraction"),
    (dict(extra_args=("--port", "1")), "repeat"),
    (dict(extra_args=("--tp=2",)), "repeat"),
    (dict(tp_size=0), "tp_size"),
    (dict(context_length=0), "context_length"),
    (dict(dtype="fp8"), "dtype"),
])
def test_validation_refuses(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SGLangConfig("T", **kw)


def test_spec_v2_env_and_from_spec():
    from eagle3_platform.spec.config import PRESETS
    cfg = SGLangConfig.from_spec("T", "D", PRESETS["chain"], spec_v2=True)
    assert cfg.env() == {"SGLANG_ENABLE_SPEC_V2": "True"}
    assert SGLangConfig("T", spec_v2=False).env() == {"SGLANG_ENABLE_SPEC_V2": "False"}
    assert SGLangConfig("T").env() == {}  # SGLang's own default
    assert cfg.build_command("py")[cfg.build_command("py").index("--speculative-eagle-topk") + 1] == "1"
    assert "--speculative-algorithm" not in SGLangConfig.from_spec("T", None, PRESETS["tree"]).build_command()
    assert SGLangConfig.from_spec("T", "D", PRESETS["tree"]).num_draft_tokens == 12


def test_spec_accept_length_forms():
    assert spec_accept_length({"avg_spec_accept_length": 2.5}) == 2.5
    assert spec_accept_length({"internal_states": [{"avg_spec_accept_length": 2.0},
                                                   {"avg_spec_accept_length": 3.0}]}) == 2.5
    assert spec_accept_length({"internal_states": [{}]}) is None


def test_sglang_available_is_false_here():
    assert sglang_available() in (False, True)  # never raises
    try:
        import torch
        if not torch.cuda.is_available():
            assert sglang_available() is False
    except ImportError:
        pass


FAKE_LAUNCH = textwrap.dedent('''
    """Stand-in for `python -m sglang.launch_server`: parses SGLang flags, serves health/info."""
    import argparse, json, signal, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--speculative-algorithm")
    ap.add_argument("--speculative-draft-model-path")
    ap.add_argument("--speculative-num-steps", type=int)
    ap.add_argument("--speculative-eagle-topk", type=int)
    ap.add_argument("--speculative-num-draft-tokens", type=int)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key")
    args = ap.parse_args()
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body = b""
            elif self.path == "/server_info":
                if args.api_key and self.headers.get("Authorization") != "Bearer " + args.api_key:
                    self.send_response(401); self.end_headers(); return
                body = json.dumps({**vars(args), "internal_states": [
                    {"avg_spec_accept_length": 2.75}]}).encode()
            else:
                self.send_response(404); self.end_headers(); return
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a):
            pass
    srv = ThreadingHTTPServer((args.host, args.port), H)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    print("fake sglang up", flush=True)
    srv.serve_forever()
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def fake_sglang(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkgs" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fakepkgs"))
    return tmp_path


@pytest.mark.integration
def test_start_health_info_stop_with_stand_in(fake_sglang):
    cfg = SGLangConfig("/models/T", "/models/D", num_steps=3, eagle_topk=1, num_draft_tokens=4,
                       port=free_port())
    srv = SGLangServer(cfg, log_path=fake_sglang / "sglang.log", python=sys.executable,
                       api_key="k").start(timeout=30)
    try:
        info = srv.server_info()
        assert info["speculative_algorithm"] == "EAGLE3"
        assert info["speculative_draft_model_path"] == "/models/D"
        assert info["speculative_num_draft_tokens"] == 4
        assert srv.accept_length() == 2.75
    finally:
        code = srv.stop()
    assert code == 0 and srv.proc.poll() == 0


@pytest.mark.integration
def test_start_failure_reports_log_tail(fake_sglang):
    (fake_sglang / "fakepkgs" / "sglang" / "launch_server.py").write_text(
        "import sys; print('CUDA error: no device', flush=True); sys.exit(3)")
    srv = SGLangServer(SGLangConfig("T", port=free_port()), log_path=fake_sglang / "s.log",
                       python=sys.executable)
    with pytest.raises(RuntimeError, match="no device"):
        srv.start(timeout=30)


@pytest.mark.integration
def test_start_sglang_server_uses_spec_preset(fake_sglang):
    from eagle3_platform.serve.sglang import start_sglang_server

    srv = start_sglang_server("/models/T", "/models/D", log_path=fake_sglang / "s.log", timeout=30)
    try:
        info = srv.server_info()
        assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
                info["speculative_num_draft_tokens"]) == (4, 1, 5)   # the "chain" preset
        assert srv.url.startswith("http://127.0.0.1:") and srv.pid
    finally:
        assert srv.stop() == 0
