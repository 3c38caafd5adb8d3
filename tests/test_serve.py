"""Embedded OpenAI-compatible server: format, validation, auth, accounting, concurrency, shutdown."""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from eagle3_platform.model.target import tiny_tokenizer
from eagle3_platform.serve.config import ServeConfig
from eagle3_platform.serve.server import build_app
from eagle3_platform.serve.text import TextStream
from eagle3_platform.testing.serve import FakeEngine, ThreadServer, fake_app, word_token_ids

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def make_app(tok, engine=None, api_key=None, **cfg):
    return fake_app(tok, engine, api_key, **cfg)


@pytest.fixture()
def client(tok):
    app, engine = make_app(tok)
    with TestClient(app) as c:
        c.engine = engine
        yield c


def sse_events(text: str) -> list:
    lines = [ln for ln in text.split("\n") if ln.strip()]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [ln[len("data: "):] for ln in lines]


def test_chat_non_streaming(client, tok):
    r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 7})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 7
    assert u["total_tokens"] == u["prompt_tokens"] + 7
    # The engine saw the chat template + generation prompt, not raw text.
    ids = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert client.engine.calls[-1]["n_prompt"] == len(ids)
    assert client.engine.calls[-1]["max_new_tokens"] == 7


def test_chat_streaming_matches_non_streaming(client):
    full = client.post(CHAT, json={"messages": MSGS, "max_tokens": 9}).json()
    r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 9, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9


def test_stream_without_include_usage_has_no_usage_chunk(client):
    r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all("usage" not in c for c in chunks)


def test_completions_raw_prompt(client, tok):
    r = client.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    assert client.engine.calls[-1]["n_prompt"] == len(tok("The quick")["input_ids"])
    r = client.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 5, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == body["choices"][0]["text"]


def test_stop_string_truncates_and_finishes(client):
    full = client.post(CHAT, json={"messages": MSGS, "max_tokens": 30}).json()
    text = full["choices"][0]["message"]["content"]
    stop = "fox"
    assert stop in text
    r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 30, "stop": [stop]}).json()
    assert r["choices"][0]["message"]["content"] == text[:text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert client.engine.calls[-1]["stop"] == (stop,)
    s = client.post(CHAT, json={"messages": MSGS, "max_tokens": 30, "stop": stop, "stream": True})
    chunks = [json.loads(e) for e in sse_events(s.text)[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == text[:text.index(stop)]
    info = client.get("/server_info").json()
    assert info["requests_cancelled"] == 0 and info["requests_completed"] == 3


def test_params_reach_engine_and_max_tokens_is_bounded(client):
    client.post(CHAT, json={"messages": MSGS, "max_tokens": 10_000, "temperature": 0.7, "seed": 5})
    call = client.engine.calls[-1]
    assert call["max_new_tokens"] == 40          # server bound
    assert call["temperature"] == 0.7 and call["seed"] == 5
    client.post(CHAT, json={"messages": MSGS})
    assert client.engine.calls[-1]["max_new_tokens"] == 12  # server default


def test_models_and_health(client):
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_server_info_accounting(client):
    before = client.get("/server_info").json()
    assert before["avg_spec_accept_length"] is None and before["spec_verify_steps"] == 0
    usages = []
    for n in (7, 8):  # fake engine: 1 prefill token, then 3 per verify step → steps 2 and 3
        usages.append(client.post(CHAT, json={"messages": MSGS, "max_tokens": n}).json()["usage"])
    assert [(u["spec_accepted_tokens"], u["spec_verify_steps"]) for u in usages] == [(6, 2), (7, 3)]
    info = client.get("/server_info").json()
    assert info["generated_tokens"] == 15
    assert info["spec_accepted_tokens"] == 13 and info["spec_verify_steps"] == 5
    assert info["avg_spec_accept_length"] == pytest.approx(13 / 5)
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(13 / 5)
    assert info["requests_total"] == 2 and info["requests_ok"] == 2
    assert info["requests_completed"] == 2
    client.post(CHAT, content=b"{not json")
    assert client.get("/server_info").json()["requests_rejected"] == 1


BAD = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (json.dumps({"max_tokens": 5}).encode(), 400),                               # no messages
    (json.dumps({"messages": []}).encode(), 400),
    (json.dumps({"messages": "hi"}).encode(), 400),                              # wrong type
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400),
    (json.dumps({"messages": MSGS, "max_tokens": -1}).encode(), 400),
    (json.dumps({"messages": MSGS, "max_tokens": "10"}).encode(), 400),
    (json.dumps({"messages": MSGS, "temperature": "hot"}).encode(), 400),
    (json.dumps({"messages": MSGS, "stream": "yes"}).encode(), 400),
    (json.dumps({"messages": MSGS, "n": 2}).encode(), 400),
    (json.dumps({"messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 400}]}).encode(), 400),  # > ctx
    (json.dumps({"messages": [{"role": "user", "content": "x" * 30_000}]}).encode(), 413),  # body
]


@pytest.mark.parametrize("body,status", BAD)
def test_bad_requests_are_4xx_json(client, body, status):
    r = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    # The server is still fine afterwards.
    assert client.post(CHAT, json={"messages": MSGS, "max_tokens": 2}).status_code == 200


def test_validation_errors_do_not_echo_user_text(client):
    secret = "alice@example.com"
    r = client.post(CHAT, json={"messages": [{"role": "robot", "content": secret}]})
    assert r.status_code == 400 and secret not in r.text


def test_unknown_route_and_method(client):
    assert client.get("/nope").status_code == 404 and "error" in client.get("/nope").json()
    r = client.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(tok):
    app, _ = make_app(tok, api_key="s3cret")
    with TestClient(app) as c:
        assert c.post(CHAT, json={"messages": MSGS}).status_code == 401
        r = c.post(CHAT, json={"messages": MSGS}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = c.post(CHAT, json={"messages": MSGS}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/server_info", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200  # probes need no key


def test_engine_error_is_json_500_and_server_survives(tok):
    engine = FakeEngine(word_token_ids(tok), chunk=2, fail_after=4)
    app, _ = make_app(tok, engine=engine)
    with TestClient(app) as c:
        r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 10})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        s = c.post(CHAT, json={"messages": MSGS, "max_tokens": 10, "stream": True})
        events = sse_events(s.text)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert c.post(CHAT, json={"messages": MSGS, "max_tokens": 3}).status_code == 200
        assert c.get("/server_info").json()["requests_failed"] == 2


def test_a_failing_prefill_fails_only_its_request(tok):
    """An engine error in one request's prefill answers that request with a 500; the request that
    is decoding meanwhile finishes normally."""
    from eagle3_platform.testing.serve import FakeBatch

    class Engine(FakeEngine):
        def batch(self):
            b = FakeBatch(self)
            prefill = b.prefill

            def failing(r, max_tokens=None, **kw):  # alone, or riding the first request's step
                if len(r.ids) > 40:  # the long prompt's prefill breaks
                    raise RuntimeError("prefill bug")
                return prefill(r, max_tokens, **kw)
            b.prefill = failing
            return b

    engine = Engine(word_token_ids(tok), chunk=1, delay_s=0.02)
    app, _ = make_app(tok, engine=engine)
    with ThreadServer(app) as srv:
        res = _second_request_while_the_first_decodes(srv, engine, ("q", 30), ("a long prompt " * 4, 5))
        info = httpx.get(srv.url + "/server_info").json()
    assert {k: status for k, (_, status) in res.items()} == {"first": 200, "second": 500}
    assert info["engine_errors"] == 1 and info["requests_completed"] == 1


def test_text_stream_holds_back_partial_stop_and_utf8(tok):
    ids = tok("héllo wörld foo", add_special_tokens=False)["input_ids"]
    ts = TextStream(tok, stop=["wör"])
    out = "".join(ts.feed([i]) for i in ids) + ts.flush()
    assert out == "héllo " and ts.stopped
    ts = TextStream(tok)
    out = "".join(ts.feed([i]) for i in ids) + ts.flush()
    assert out == "héllo wörld foo" and "\ufffd" not in out


# -- real sockets -------------------------------------------------------------------------------

def test_concurrent_clients_all_served(tok):
    engine = FakeEngine(word_token_ids(tok), chunk=2, delay_s=0.005)
    app, _ = make_app(tok, engine=engine)
    results, n = [], 8
    with ThreadServer(app) as srv:
        def one(i):
            body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 8,
                    "stream": i % 2 == 0, "stream_options": {"include_usage": True}}
            r = httpx.post(srv.url + CHAT, json=body, timeout=60)
            results.append((r.status_code, r.text))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        info = httpx.get(srv.url + "/server_info").json()
    assert len(results) == n and all(s == 200 for s, _ in results), results
    assert info["requests_ok"] == n and info["generated_tokens"] == 8 * n
    assert max(b for kind, b in engine.events if kind == "step") > 1  # decoded together
    assert sum(info["batch_size_hist"].values()) == info["batch_steps"] > 0


def _second_request_while_the_first_decodes(srv, engine, first, second) -> dict:
    """Sends `first` = (content, max_tokens) from a thread, waits for the engine's first decode step,
    then sends `second`; -> {"first" | "second": (time it finished, status code)}."""
    import time

    done = {}

    def one(name, content, max_tokens):
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        r = httpx.post(srv.url + CHAT, json=body, timeout=60)
        done[name] = (time.perf_counter(), r.status_code)

    running = threading.Thread(target=one, args=("first", *first))
    running.start()
    while not any(kind == "step" for kind, _ in engine.events):
        time.sleep(0.005)
    one("second", *second)
    running.join(60)
    return done


def test_a_request_joins_the_running_batch_and_long_prompts_are_chunked(tok):
    """A later request starts streaming while an earlier one is still decoding (it joins the batch at
    the next step instead of waiting), and its long prompt is prefilled in chunks between steps."""
    engine = FakeEngine(word_token_ids(tok), chunk=1, delay_s=0.02)
    app, _ = make_app(tok, engine=engine, prefill_chunk=8, mixed_prefill_tokens=8)
    with ThreadServer(app) as srv:
        done = _second_request_while_the_first_decodes(srv, engine, ("q", 40),
                                                       ("a much longer prompt " * 6, 3))
    assert done["second"][1] == done["first"][1] == 200
    assert done["second"][0] < done["first"][0]  # finished while the first was still decoding
    kinds = [kind for kind, _ in engine.events]
    chunks = [n for kind, n in engine.events if kind == "prefill"][1:]  # the short request's prompt
    assert len(chunks) > 2 and max(chunks) <= 8
    first = kinds.index("prefill", 1)
    assert "step" in kinds[first:first + 2 * len(chunks)]  # decode steps ran between its chunks
    assert ("step", 2) in engine.events


def test_queue_bound_gives_503_json(tok):
    engine = FakeEngine(word_token_ids(tok), chunk=1, delay_s=0.05)
    app, _ = make_app(tok, engine=engine, max_queue=1)
    statuses = []
    with ThreadServer(app) as srv:
        def one():
            r = httpx.post(srv.url + CHAT, json={"messages": MSGS, "max_tokens": 10}, timeout=60)
            statuses.append((r.status_code, r.json()))

        threads = [threading.Thread(target=one) for _ in range(4)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
    codes = sorted(s for s, _ in statuses)
    assert codes[0] == 200 and 503 in codes
    assert all("error" in b for s, b in statuses if s == 503)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_running_and_queued_jobs(tok, stream):
    import time

    engine = FakeEngine(word_token_ids(tok), chunk=1, delay_s=0.05)
    app, _ = make_app(tok, engine=engine, disconnect_poll_s=0.05)
    with ThreadServer(app) as srv:
        def gone():  # hangs up after the first bytes or 0.3 s of a ~2 s generation
            body = {"messages": MSGS, "max_tokens": 40, "stream": stream}
            try:
                with httpx.stream("POST", srv.url + CHAT, json=body, timeout=0.3) as r:
                    for _ in r.iter_bytes():
                        break
            except httpx.ReadTimeout:
                pass
        threads = [threading.Thread(target=gone) for _ in range(2)]  # one running, one queued
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        deadline = time.time() + 10
        while time.time() < deadline:
            info = httpx.get(srv.url + "/server_info").json()
            if info["requests_cancelled"] == 2 and not info["in_flight"]:
                break
            time.sleep(0.05)
    assert info["requests_cancelled"] == 2, info
    assert info["generated_tokens"] < 40  # the engine stopped early and the queued job never ran


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_subprocess_server_clean_shutdown_with_inflight_request(tmp_path, sig):
    from eagle3_platform.serve.launch import spawn_server

    cmd = [sys.executable, "-m", "eagle3_platform.testing.serve", "--delay-s", "0.05",
           "--chunk", "1"]
    h = spawn_server(cmd, api_key="k", log_path=tmp_path / "server.log", timeout=60)
    got = {}

    def slow():
        body = {"messages": MSGS, "max_tokens": 30, "stream": True}
        with httpx.stream("POST", h.url + CHAT, json=body, headers=h.headers(), timeout=60) as r:
            got["status"] = r.status_code
            got["text"] = "".join(r.iter_text())

    t = threading.Thread(target=slow)
    t.start()
    import time
    deadline = time.time() + 20
    while time.time() < deadline:  # wait until the request is running
        if httpx.get(h.url + "/server_info", headers=h.headers()).json()["in_flight"]:
            break
        time.sleep(0.05)
    assert httpx.get(h.url + "/server_info").status_code == 401
    os.kill(h.pid, sig)
    t.join(30)
    assert h.proc.wait(30) == 0
    assert got["status"] == 200 and got["text"].rstrip().endswith("data: [DONE]")
    log = (tmp_path / "server.log").read_text()
    assert "capital of France" not in log  # no prompt text in logs
    assert h.workdir is None  # the log is the caller's: no temp dir kept


@pytest.mark.integration
def test_spawned_server_leaves_no_temp_dir(tmp_path):
    """The ready file's directory goes once read; a temp log's directory goes at stop()."""
    from eagle3_platform.serve.launch import spawn_server

    cmd = [sys.executable, "-m", "eagle3_platform.testing.serve", "--chunk", "1"]
    before = set(Path(tempfile.gettempdir()).glob("eagle3-serve-*"))
    with spawn_server(cmd, log_path=tmp_path / "server.log", timeout=60) as h:
        assert h.workdir is None and set(Path(tempfile.gettempdir()).glob("eagle3-serve-*")) == before
    h2 = spawn_server(cmd, timeout=60)
    assert h2.log_path.parent == h2.workdir and h2.log_path.exists()  # its log, while it runs
    assert not (h2.workdir / "ready.json").exists()
    h2.stop()
    assert not h2.workdir.exists()
    assert set(Path(tempfile.gettempdir()).glob("eagle3-serve-*")) == before


# -- the real engine on the tiny target ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_export(tiny_target_dir, tmp_path_factory):
    from eagle3_platform.testing.serve import random_export
    return random_export(tiny_target_dir, tmp_path_factory.mktemp("draft") / "export")


def test_real_engine_through_server_is_lossless(tiny_target_dir, tiny_export):
    """Greedy through the server with a (random) EAGLE-3 head == the baseline server's output."""
    from eagle3_platform.serve.server import build_engine

    outs = {}
    for name, draft in (("baseline", None), ("eagle3", tiny_export)):
        engine, target, meta = build_engine(tiny_target_dir, draft, "tree")
        cfg = ServeConfig(max_tokens=24, allowed_hosts=("testserver",))
        app = build_app(engine, target.tokenizer, cfg, model_name=name,
                        context_length=int(target.model.config.max_position_embeddings), info=meta)
        with TestClient(app) as c:
            r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 20})
            s = c.post(CHAT, json={"messages": MSGS, "max_tokens": 20, "stream": True})
            info = c.get("/server_info").json()
        assert r.status_code == 200 and s.status_code == 200
        streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                           for e in sse_events(s.text)[:-1])
        outs[name] = r.json()["choices"][0]["message"]["content"]
        assert streamed == outs[name]
        assert info["spec"] == ("tree" if draft else "baseline")
        assert info["avg_spec_accept_length"] >= 1.0
        if draft is None:
            assert info["avg_spec_accept_length"] == 1.0
    assert outs["eagle3"] == outs["baseline"]


def test_build_engine_takes_the_head_weights_setting(tiny_target_dir, tiny_export):
    from torch import nn

    from eagle3_platform.draft.quant import Int8Linear
    from eagle3_platform.model.packed_linear import PackedLinear, packing_available
    from eagle3_platform.serve.server import build_engine
    from eagle3_platform.store.records import sha256_file

    engine, _, meta = build_engine(tiny_target_dir, tiny_export, "chain")
    assert meta["spec_config"]["head_weights"] == "auto"
    assert meta["head_weights"] == "packed"  # the tiny target is off the 4-bit grid
    assert meta["head_sha256"] == sha256_file(f"{tiny_export}/model.safetensors")  # which head is served
    assert isinstance(engine.draft.lm_head, PackedLinear if packing_available() else nn.Linear)
    engine, _, meta = build_engine(tiny_target_dir, tiny_export, "chain", head_weights="int8")
    assert isinstance(engine.draft.lm_head, Int8Linear) and meta["spec_config"]["head_weights"] == "int8"
    engine, _, meta = build_engine(tiny_target_dir, tiny_export, "chain", head_weights="native")
    assert isinstance(engine.draft.lm_head, nn.Linear) and meta["spec_config"]["head_weights"] == "native"


def test_build_engine_takes_the_answer_tokens_setting_only_with_a_table(tiny_target_dir, tiny_export, tmp_path):
    """answer_tokens (SpecConfig) drafts from the export's answer table (off by default); an export without one
    is refused rather than served silently without it."""
    import shutil

    from eagle3_platform.draft.answer_ngrams import AnswerNgrams
    from eagle3_platform.draft.export import ANSWERS_FILE
    from eagle3_platform.serve.server import build_engine
    from eagle3_platform.spec.tree import root_only

    engine, _, meta = build_engine(tiny_target_dir, tiny_export, "chain_adaptive_lookup")
    assert meta["answer_ngrams"] is None and meta["spec_config"]["answer_tokens"] == 0
    with pytest.raises(ValueError, match="no answer n-gram table"):
        build_engine(tiny_target_dir, tiny_export, "chain_adaptive_lookup", answer_tokens=3)
    with_table = tmp_path / "export"
    shutil.copytree(tiny_export, with_table)
    (with_table / ANSWERS_FILE).parent.mkdir()
    AnswerNgrams.build([[5, 6, 7, 8], [5, 6, 7, 9]]).save(with_table / ANSWERS_FILE)
    engine, _, meta = build_engine(tiny_target_dir, with_table, "chain_adaptive_lookup", answer_tokens=3)
    assert meta["answer_ngrams"] > 0 and engine.cfg.answer_tokens == 3
    drafter = engine.make_drafter()
    drafter.history = [1, 2, 5]
    # 5 -> 6 -> 7 -> 8 (7 was followed by 8 and 9 once each: a tie, the lowest id; share 1/2 >= MIN_SHARE)
    assert drafter.plain_step(root_only(4)).tokens.tolist() == [4, 6, 7, 8]


def test_build_engine_runs_the_target_on_target_threads(tiny_target_dir):
    from eagle3_platform.model.compute import resolve_threads
    from eagle3_platform.serve.config import PRESETS
    from eagle3_platform.serve.server import build_engine

    engine, _, meta = build_engine(tiny_target_dir, None, "chain", target_threads=0, draft_threads=0)
    assert engine.target_threads == engine.draft_threads == 0
    assert meta["threads"]["target"] == meta["threads"]["head"] == resolve_threads(0)
    engine, _, meta = build_engine(tiny_target_dir, None, "chain")
    assert engine.target_threads is None and engine.draft_threads is None
    assert meta["threads"]["target"] == meta["threads"]["head"] == meta["threads"]["rest"]
    # the loaded server of a sweep takes the cores for the target and the head, the rest keeps one
    # thread (more contend); tests (tiny) stay on one thread
    for preset in ("demo", "cpu"):
        assert PRESETS[preset].target_threads == PRESETS[preset].draft_threads == 0
        assert PRESETS[preset].torch_threads == 1
    assert PRESETS["tiny"].target_threads is None and PRESETS["tiny"].torch_threads == 1


@pytest.mark.parametrize("mixed_prefill_tokens", [16, 0])
def test_real_engine_batched_requests_equal_each_alone(tiny_target_dir, tiny_export, mixed_prefill_tokens):
    """Concurrent greedy requests (mixed prompt lengths and budgets, staggered) through the batching
    server give what each request gives alone (fp32: exact), with the draft size chosen per step,
    whether prompt chunks ride along the running step or are prefilled apart."""
    from eagle3_platform.serve.server import build_engine

    engine, target, meta = build_engine(tiny_target_dir, tiny_export, "tree", dtype="float32")
    prompts = [("What is the capital of France?", 20), ("Sort a list. " * 12, 9),
               ("Hi", 16), ("Explain hash maps with an example and a short history.", 12)]
    alone = {}
    for text, n in prompts:
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                   add_generation_prompt=True, tokenize=True)["input_ids"]
        alone[text] = target.tokenizer.decode(engine.generate(ids, n)[0], skip_special_tokens=True)
    app = build_app(engine, target.tokenizer, ServeConfig(max_tokens=24, prefill_chunk=16,
                                                          mixed_prefill_tokens=mixed_prefill_tokens),
                    model_name="eagle3", context_length=512, info=meta)
    got = {}
    with ThreadServer(app) as srv:
        def one(text, n):
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": n}
            r = httpx.post(srv.url + CHAT, json=body, timeout=120)
            got.setdefault(text, set()).add(r.json()["choices"][0]["message"]["content"])

        threads = [threading.Thread(target=one, args=p) for p in prompts * 2]
        for t in threads:
            t.start()
            t.join(0.05)  # staggered arrivals
        [t.join(120) for t in threads]
        info = httpx.get(srv.url + "/server_info").json()
    assert got == {text: {out} for text, out in alone.items()}  # both copies of every prompt
    assert any(int(b) > 1 for b in info["batch_size_hist"])
    assert sum(info["draft_size_hist"].values()) == info["batch_steps"]
    assert info["draft_size_current"] in range(0, 12)
    assert info["mixed_prefill_tokens"] == mixed_prefill_tokens
    assert (info["mixed_steps"] > 0) == (mixed_prefill_tokens > 0)
    assert info["step_s"] > 0


def test_the_worker_hands_the_policy_each_steps_catch_up(tiny_target_dir, tiny_export):
    """The worker passes the draft-size policy each step's catch-up of steps decoded plainly between
    drafts (which it reports, spec/policy.py): none at the request's first draft or while decoding
    plainly, their backlog at the next draft; and apart from it the catch-up on a new request's
    prompt (charged to drafting): at its first draft only."""
    from eagle3_platform.serve.server import build_engine
    from eagle3_platform.serve.worker import EngineWorker, Job

    class Scripted:  # a draft of 2, plain decoding for 3 steps, drafts again
        def __init__(self):
            self.seen = []

        def choose(self, batch_size):
            return 0 if len(self.seen) in (1, 2, 3) else 2

        def observe(self, batch_size, k, seconds, accepted, drafted=None, catch_up_s=0.0,
                    prompt_catch_up_s=0.0):
            self.seen.append((k, catch_up_s, prompt_catch_up_s))

    engine, target, _ = build_engine(tiny_target_dir, tiny_export, "chain", dtype="float32")
    policy = Scripted()
    worker = EngineWorker(engine, max_queue=4, policy=policy)
    batch = engine.batch()
    worker.submit(Job(target.tokenizer.encode("What is the capital of France?"), max_new_tokens=12,
                      emit=lambda ev: None))
    worker._pull(block=False)
    worker._prefill(batch)
    for _ in range(5):
        worker._step(batch)
    assert [k for k, _, _ in policy.seen] == [2, 0, 0, 0, 2]
    assert [c for _, c, _ in policy.seen[:4]] == [0.0] * 4 and policy.seen[4][1] > 0.0
    assert policy.seen[0][2] > 0.0 and [p for _, _, p in policy.seen[1:]] == [0.0] * 4


@pytest.mark.integration
def test_real_server_subprocess_serves_and_exits_cleanly(tiny_target_dir, tiny_export, tmp_path):
    from eagle3_platform.serve.launch import start_embedded_server

    h = start_embedded_server(tiny_target_dir, tiny_export, spec="chain",
                              log_path=tmp_path / "serve.log", timeout=120)
    try:
        r = httpx.post(h.url + CHAT, json={"messages": MSGS, "max_tokens": 6}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        info = httpx.get(h.url + "/server_info").json()
        assert info["draft"] is True and info["spec_verify_steps"] >= 1
        assert httpx.get(h.url + "/v1/models").json()["data"][0]["id"].endswith("-eagle3")
    finally:
        code = h.stop()
    assert code == 0
    log = (tmp_path / "serve.log").read_text()
    assert "Application shutdown complete" in log and "capital of France" not in log
