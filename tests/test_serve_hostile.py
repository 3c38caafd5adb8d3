"""The embedded server against careless and hostile clients: every bad request is a 4xx that names
what is wrong, slow clients time out, bounds hold on one path, a client that leaves stops its work,
every request is counted in exactly one outcome, and a key-less server serves only its own names."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from eagle3_platform.model.target import tiny_tokenizer
from eagle3_platform.serve.server import host_name
from eagle3_platform.testing.serve import FakeEngine, ThreadServer, fake_app, word_token_ids

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
OUTCOMES = ("requests_ok", "requests_rejected", "requests_disconnected", "requests_failed")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def make_app(tok, engine=None, api_key=None, **cfg):
    return fake_app(tok, engine, api_key, model_name="fake", **{"default_max_tokens": 8, **cfg})[0]


@pytest.fixture()
def client(tok):
    app = make_app(tok)
    with TestClient(app) as c:
        c.engine = app.state.service.worker.engine
        yield c


def post_raw(c, path: str, body: bytes, **headers):
    return c.post(path, content=body, headers={"content-type": "application/json", **headers})


def error_of(r) -> dict:
    err = r.json()["error"]
    assert err["code"] == r.status_code and err["message"]
    return err


def assert_outcomes_add_up(info: dict) -> None:
    assert sum(info[k] for k in OUTCOMES) == info["requests_total"], info


# -------------------------------------------------------------------- 1. one error path, no 500s

@pytest.mark.parametrize("path,body,field", [
    (COMP, b'{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
    (COMP, b'{"prompt": ["\\udfff"], "max_tokens": 4}', "prompt.0"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages.0.content.0.text"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop.0"),
])
def test_a_lone_surrogate_is_400_naming_the_field(client, path, body, field):
    r = post_raw(client, path, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == field and "surrogate" in err["message"]


def test_raw_surrogate_bytes_are_400(client):
    """The JSON decoder lets encoded surrogates (ED A0 80) through as str ('surrogatepass')."""
    r = post_raw(client, COMP, b'{"prompt": "a\xed\xa0\x80"}')
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"


@pytest.mark.parametrize("levels", [33, 2_000, 100_000])
def test_deep_nesting_is_400(tok, levels):
    body = b'{"messages": ' + b"[" * levels + b"]" * levels + b"}"
    with TestClient(make_app(tok, max_body_bytes=1 << 20)) as c:
        r = post_raw(c, CHAT, body)
    assert r.status_code == 400 and "nested deeper than 32 levels" in error_of(r)["message"]


def test_nesting_within_the_bound_reaches_validation(client):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 30 + b"]" * 30 + b"}"
    assert post_raw(client, CHAT, body).status_code == 200


@pytest.mark.parametrize("literal,what", [(b"1" * 5_000, "longer than 64 digits"),
                                          (b"-" + b"9" * 65, "longer than 64 digits"),
                                          (b"NaN", "NaN is not a JSON number"),
                                          (b"Infinity", "Infinity is not a JSON number")])
def test_number_literals_the_server_will_not_parse_are_400(client, literal, what):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + literal + b"}"
    r = post_raw(client, CHAT, body)
    assert r.status_code == 400 and what in error_of(r)["message"]


@pytest.mark.parametrize("body,what", [(b"{not json", "not valid JSON"), (b"\xff\xfe{", "not valid JSON"),
                                       (b"", "not valid JSON"), (b'"a string"', "JSON object")])
def test_unparseable_bodies_are_400(client, body, what):
    r = post_raw(client, CHAT, body)
    assert r.status_code == 400 and what in error_of(r)["message"]


def test_a_tokenizer_failure_is_400_naming_the_prompt(tok):
    app = make_app(tok)
    svc = app.state.service

    def broken(*a, **kw):
        raise RuntimeError("tokenizer says no to 'secret text'")
    svc.tok = broken
    with TestClient(app) as c:
        r = c.post(COMP, json={"prompt": "secret text"})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    assert "secret" not in r.text


def test_an_unexpected_error_in_parsing_is_400_and_logged_without_text(tok, caplog, monkeypatch):
    from eagle3_platform.serve import protocol as P

    def bug(model, obj):
        raise KeyError(obj["messages"][0]["content"])
    monkeypatch.setattr(P, "validate", bug)
    with caplog.at_level(logging.INFO, logger="eagle3.serve"), TestClient(make_app(tok)) as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "alice@example.com"}]})
    assert r.status_code == 400 and "validating the request failed (KeyError)" in error_of(r)["message"]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "eagle3.serve"]
    assert any(r.headers["x-request-id"] in ln and "KeyError" in ln for ln in lines)
    assert "alice" not in caplog.text and "alice" not in r.text


def test_an_engine_fault_is_the_only_500_and_is_logged_with_the_request_id(tok, caplog):
    engine = FakeEngine(word_token_ids(tok), chunk=2, fail_after=2)
    with caplog.at_level(logging.INFO, logger="eagle3.serve"), \
            TestClient(make_app(tok, engine=engine)) as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "bob@example.com"}]})
        info = c.get("/server_info").json()
    assert r.status_code == 500 and error_of(r)["type"] == "server_error"
    rid = r.headers["x-request-id"]
    assert any(rid in rec.getMessage() and rec.levelno == logging.ERROR for rec in caplog.records)
    assert "bob@" not in caplog.text
    assert info["requests_failed"] == 1 and info["requests_total"] == 1


def test_an_unhandled_error_is_a_json_500_logged_without_its_message(tok, caplog):
    app = make_app(tok)

    async def bug(request):  # an exception whose message quotes what the client sent
        raise ValueError(f"{request.headers['x-note']} is in this message")
    app.add_route("/boom", bug)
    with caplog.at_level(logging.INFO, logger="eagle3.serve"), \
            TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/boom", headers={"x-note": "carol@example.com"})
    assert r.status_code == 500 and error_of(r)["type"] == "server_error"
    assert "ValueError" in caplog.text and "carol" not in caplog.text


# -------------------------------------------------------------------- 2. the request schema

@pytest.mark.parametrize("field,value,why", [
    ("top_p", 2, "less than or equal to 1"), ("top_p", -1, "greater than 0"),
    ("top_p", 0, "greater than 0"), ("top_p", "x", "valid number"), ("top_p", True, "valid number"),
    ("top_k", "x", "valid integer"), ("top_k", -2, "greater than or equal to -1"),
    ("top_k", 1.5, "valid integer"),
    ("presence_penalty", 5, "less than or equal to 2"), ("frequency_penalty", -3, "greater than"),
    ("frequency_penalty", "0", "valid number"), ("repetition_penalty", 0, "greater than 0"),
    ("min_p", 2, "less than or equal to 1"),
    ("temperature", 3, "less than or equal to 2"), ("temperature", -0.1, "greater than or equal to 0"),
    ("temperature", None, "valid number"),
    ("max_tokens", 0, "greater than or equal to 1"), ("max_tokens", 1.5, "valid integer"),
    ("max_tokens", True, "valid integer"), ("max_completion_tokens", -1, "greater than or equal"),
    ("seed", "1", "valid integer"), ("stream", 1, "valid boolean"), ("n", 0, "greater than"),
    ("logprobs", "yes", "valid boolean"), ("top_logprobs", 21, "less than or equal to 20"),
    ("logit_bias", [1], "valid dictionary"), ("response_format", "json", "valid dictionary"),
])
def test_out_of_range_or_wrong_type_is_400_naming_the_field(client, field, value, why):
    r = client.post(CHAT, json={"messages": MSGS, field: value})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"].split(".")[0] == field and field in err["message"] and why in err["message"]


@pytest.mark.parametrize("path,extra,field", [
    (CHAT, {"logprobs": True}, "logprobs"), (CHAT, {"top_logprobs": 3}, "top_logprobs"),
    (COMP, {"logprobs": 5}, "logprobs"), (COMP, {"logprobs": 0}, "logprobs"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"), (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"n": 2}, "n"), (COMP, {"n": 3}, "n"), (COMP, {"best_of": 2}, "best_of"),
    (COMP, {"echo": True}, "echo"), (COMP, {"suffix": "end"}, "suffix"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -1}, "frequency_penalty"),
    (CHAT, {"repetition_penalty": 1.1}, "repetition_penalty"),
    (CHAT, {"logit_bias": {"5": 10}}, "logit_bias"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"top_p": 0.5, "temperature": 0.8}, "top_p"),
    (CHAT, {"top_k": 40, "temperature": 0.8}, "top_k"),
    (CHAT, {"min_p": 0.1, "temperature": 0.8}, "min_p"),
])
def test_unsupported_fields_are_400_naming_the_field(client, path, extra, field):
    base = {"messages": MSGS} if path == CHAT else {"prompt": "The quick"}
    r = client.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == field and err["message"].startswith(f"{field}: ")
    assert "not" in err["message"] or "only" in err["message"]
    assert client.engine.calls == []  # refused before anything was generated


@pytest.mark.parametrize("path,extra", [
    (CHAT, {"logprobs": False, "top_logprobs": 0}), (CHAT, {"logprobs": None}),
    (CHAT, {"tools": [], "tool_choice": "none"}), (CHAT, {"tools": None, "tool_choice": None}),
    (CHAT, {"n": 1, "top_p": 1, "top_k": -1, "min_p": 0, "presence_penalty": 0,
            "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}}),
    (CHAT, {"response_format": {"type": "text"}, "user": "u-1", "parallel_tool_calls": False}),
    (CHAT, {"top_p": 0.5, "top_k": 40, "min_p": 0.1, "temperature": 0}),  # greedy: no effect
    (CHAT, {"top_p": None, "top_k": None, "seed": 3, "temperature": 0.7}),
    (CHAT, {"some_future_field": {"x": 1}}),
    (COMP, {"logprobs": None, "echo": False, "best_of": 1, "suffix": None, "n": 1}),
])
def test_values_that_change_nothing_are_served(client, path, extra):
    base = {"messages": MSGS} if path == CHAT else {"prompt": "The quick"}
    r = client.post(path, json={**base, **extra, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


def test_no_logprobs_are_returned_today(client):
    """Why logprobs are refused: the server has none to give (the engine returns token ids)."""
    for path, body in ((CHAT, {"messages": MSGS}), (COMP, {"prompt": "The quick"})):
        choice = client.post(path, json={**body, "max_tokens": 3}).json()["choices"][0]
        assert choice["logprobs"] is None


def test_validation_messages_never_echo_values(client):
    secret = "dave@example.com"
    for extra in ({"top_p": secret}, {"tools": secret}, {"messages": [{"role": secret, "content": "x"}]},
                  {"logit_bias": {secret: "x"}}):
        r = client.post(CHAT, json={"messages": MSGS, **extra})
        assert r.status_code == 400 and secret not in r.text and "dave" not in r.text


# -------------------------------------------------------------------- 3. limits, content type

def test_a_post_must_be_application_json(client):
    body = json.dumps({"messages": MSGS}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/jsonx", None):
        headers = {"content-type": ctype} if ctype else {}
        r = client.post(CHAT, content=body, headers=headers)
        assert r.status_code == 415, (ctype, r.status_code)
        assert error_of(r)["param"] == "content-type"
    ok = client.post(CHAT, content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_too_many_header_fields_is_431(tok):
    with TestClient(make_app(tok, max_headers=20)) as c:
        r = c.post(CHAT, json={"messages": MSGS}, headers={f"x-h{i}": "v" for i in range(30)})
        assert r.status_code == 431 and "more than 20 header fields" in error_of(r)["message"]
        assert c.post(CHAT, json={"messages": MSGS}, headers={"x-a": "1"}).status_code == 200


def test_body_over_the_bound_is_413_declared_or_not(client):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 30_000}]}).encode()
    r = post_raw(client, CHAT, big)  # Content-Length declared
    assert r.status_code == 413 and "larger than 20000 bytes" in error_of(r)["message"]
    r = client.post(CHAT, content=iter([big[:10_000], big[10_000:]]),  # chunked: no length
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than 20000 bytes" in error_of(r)["message"]
    assert client.post(CHAT, json={"messages": MSGS, "max_tokens": 2}).status_code == 200


def test_host_names():
    values = ("LocalHost:8000", "127.0.0.1", "[::1]:80", "::1", "localhost.", "evil.example:1", "[::1")
    assert [host_name(h) for h in values] == \
        ["localhost", "127.0.0.1", "::1", "::1", "localhost", "evil.example", "::1"]


# -------------------------------------------------------------------- 5. Host and Origin

@pytest.mark.parametrize("host,status", [
    ("127.0.0.1:8000", 200), ("localhost", 200), ("LOCALHOST:1", 200), ("[::1]:8000", 200),
    ("evil.example", 421), ("evil.example:8000", 421), ("127.0.0.1.evil.example", 421),
    ("localhost.evil.example:80", 421), ("", 421)])
def test_without_a_key_only_loopback_names_are_served(tok, host, status):
    with TestClient(make_app(tok, allowed_hosts=())) as c:
        r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2}, headers={"host": host})
        assert r.status_code == status, r.text
        g = c.get("/v1/models", headers={"host": host})
        assert g.status_code == status
        if status == 421:
            assert error_of(r)["param"] == "host"
        assert c.get("/health", headers={"host": host}).status_code == 200  # probes: any Host


def test_the_bind_address_and_allowed_hosts_are_served(tok):
    with TestClient(make_app(tok, host="10.1.2.3", allowed_hosts=("gpu-box.internal",))) as c:
        for host in ("10.1.2.3:8000", "gpu-box.internal", "GPU-BOX.internal:9"):
            assert c.post(CHAT, json={"messages": MSGS, "max_tokens": 2},
                          headers={"host": host}).status_code == 200, host
        assert c.post(CHAT, json={"messages": MSGS}, headers={"host": "other"}).status_code == 421


@pytest.mark.parametrize("origin,status", [
    ("http://evil.example", 403), ("null", 403), ("http://localhost.evil.example:8000", 403),
    ("http://localhost:3000", 200), ("http://127.0.0.1:8000", 200), ("http://[::1]:8000", 200)])
def test_without_a_key_a_foreign_origin_is_refused(tok, origin, status):
    with TestClient(make_app(tok)) as c:
        r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2}, headers={"origin": origin})
        assert r.status_code == status, r.text
        if status == 403:
            assert error_of(r)["param"] == "origin"


def test_with_a_key_any_host_and_origin_with_the_key(tok):
    with TestClient(make_app(tok, api_key="k3y", allowed_hosts=())) as c:
        h = {"host": "gpu-box.example", "origin": "http://dashboard.example"}
        assert c.post(CHAT, json={"messages": MSGS}, headers=h).status_code == 401
        ok = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2},
                    headers={**h, "authorization": "Bearer k3y"})
        assert ok.status_code == 200


def test_a_cors_preflight_is_not_answered_with_permission(client):
    r = client.options(CHAT, headers={"origin": "http://evil.example",
                                      "access-control-request-method": "POST"})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


# -------------------------------------------------------------------- 4. outcomes

def test_every_request_is_counted_in_exactly_one_outcome(tok):
    engine = FakeEngine(word_token_ids(tok), chunk=2, fail_after=6)
    with TestClient(make_app(tok, engine=engine)) as c:
        c.post(CHAT, json={"messages": MSGS, "max_tokens": 4})                    # ok
        c.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "stream": True})    # ok
        c.post(CHAT, json={"messages": MSGS, "max_tokens": 20})                   # failed
        c.post(CHAT, json={"messages": MSGS, "max_tokens": 20, "stream": True})   # failed
        c.post(CHAT, json={"messages": MSGS, "top_p": 3})                         # rejected
        c.post(CHAT, content=b"{}", headers={"content-type": "text/plain"})       # rejected
        c.post(CHAT, json={"messages": MSGS}, headers={"host": "evil"})           # rejected
        info = c.get("/server_info").json()
    assert (info["requests_total"], info["requests_ok"], info["requests_failed"],
            info["requests_rejected"], info["requests_disconnected"]) == (7, 2, 2, 3, 0)
    assert_outcomes_add_up(info)


# -------------------------------------------------------------------- real sockets

def raw_request(url: str, data: bytes, timeout: float = 10.0, chunks=None) -> tuple[str, float]:
    """Send bytes (then `chunks`, each after a pause), read the answer's status line or what the
    server did instead -> (status line | 'closed' | 'reset' | 'open', seconds)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(timeout)
    t0 = time.monotonic()
    try:
        s.sendall(data)
        for pause, part in chunks or ():
            time.sleep(pause)
            s.sendall(part)
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = s.recv(65536)
            if not got:
                return ("closed" if not buf else buf.split(b"\r\n")[0].decode()), time.monotonic() - t0
            buf += got
        return buf.split(b"\r\n")[0].decode() + " " + buf.partition(b"\r\n\r\n")[2][:300].decode(
            errors="replace"), time.monotonic() - t0
    except socket.timeout:
        return "open", time.monotonic() - t0
    except (ConnectionResetError, BrokenPipeError):
        return "reset", time.monotonic() - t0
    finally:
        s.close()


def head(path: str = CHAT, length: int | None = None, extra: str = "", host: str = "127.0.0.1",
         ctype: str = "application/json") -> bytes:
    cl = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
            f"{cl}{extra}\r\n").encode()


def request_bytes(body: bytes, path: str = CHAT, **kw) -> bytes:
    return head(path, len(body), **kw) + body


@pytest.fixture()
def slow_server(tok):
    app = make_app(tok, header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=5.0,
                   max_header_bytes=4096, max_body_bytes=1 << 20)
    with ThreadServer(app) as srv:
        srv.app = app
        yield srv


def test_a_head_that_never_finishes_gets_408_at_the_header_timeout(slow_server):
    status, took = raw_request(slow_server.url, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n".encode())
    assert status.startswith("HTTP/1.1 408") and "headers not received within 0.5 s" in status
    assert 0.4 < took < 3


def test_a_trickled_head_is_timed_as_a_whole(slow_server):
    """Bytes still arriving do not extend the deadline (an idle timer would fire only at 0.9 s)."""
    parts = [(0.1, b"Host: 127.0.0.1\r\n"), (0.1, b"X-A: 1\r\n"), (0.1, b"X-B: 2\r\n"),
             (0.1, b"X-C: 3\r\n")]
    status, took = raw_request(slow_server.url, b"GET /health HTTP/1.1\r\n", chunks=parts)
    assert status.startswith("HTTP/1.1 408") and 0.45 < took < 0.85, (status, took)


def test_a_connection_that_sends_nothing_is_closed(slow_server):
    status, took = raw_request(slow_server.url, b"")
    assert status == "closed" and 0.4 < took < 3


def test_keep_alive_then_a_stalled_second_head_is_timed_out(slow_server):
    host, port = slow_server.url.rsplit("/", 1)[-1].split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
    second = s.recv(65536)
    s.close()
    assert second.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3


def test_a_body_shorter_than_its_length_gets_408_at_the_body_timeout(slow_server):
    status, took = raw_request(slow_server.url, head(length=100) + b'{"mess')
    assert status.startswith("HTTP/1.1 408") and "body not received within 0.5 s" in status
    assert 0.4 < took < 3
    info = httpx.get(slow_server.url + "/server_info").json()
    assert info["requests_rejected"] == 1
    assert_outcomes_add_up(info)


def test_a_long_header_is_431(slow_server):
    status, _ = raw_request(slow_server.url, head(length=2, extra="X-Big: " + "a" * 1_000_000 + "\r\n") + b"{}")
    assert status.startswith("HTTP/1.1 431") and "larger than 4096 bytes" in status


def test_ten_thousand_headers_are_431(slow_server):
    many = "".join(f"X-H{i}: v\r\n" for i in range(10_000))
    status, _ = raw_request(slow_server.url, head(length=2, extra=many) + b"{}")
    assert status.startswith("HTTP/1.1 431")


def test_many_small_headers_within_the_size_are_431_from_the_app(slow_server):
    many = "".join(f"X{i}: v\r\n" for i in range(150))  # ~1.3 KB < 4 KB, but > 100 fields
    status, _ = raw_request(slow_server.url, head(length=2, extra=many) + b"{}")
    assert status.startswith("HTTP/1.1 431") and "more than 100 header fields" in status


@pytest.mark.parametrize("size", [1_100_000, 2_000_000, 7_000_000])
@pytest.mark.parametrize("close", [False, True])
def test_one_413_path_whatever_the_size(slow_server, size, close):
    """A body over the bound, sent at once by a client that reads only afterwards, gets its 413
    (drained, not reset), with or without keep-alive."""
    body = json.dumps({"messages": [{"role": "user", "content": "x" * size}]}).encode()
    extra = "Connection: close\r\n" if close else ""
    status, _ = raw_request(slow_server.url, head(length=len(body), extra=extra) + body)
    assert status.startswith("HTTP/1.1 413") and "larger than 1048576 bytes" in status


def test_a_declared_body_far_over_the_bound_is_413_at_once(slow_server):
    status, took = raw_request(slow_server.url, head(length=10 ** 12) + b"{")
    assert status.startswith("HTTP/1.1 413") and took < 2


def test_a_non_streaming_client_that_leaves_stops_its_generation(tok):
    """The poll is timed: a decode emitting faster than the poll interval still sees the client go."""
    engine = FakeEngine(word_token_ids(tok), chunk=1, delay_s=0.005)
    app = make_app(tok, engine=engine, max_tokens=2000, disconnect_poll_s=0.1)
    with ThreadServer(app) as srv:
        body = json.dumps({"messages": MSGS, "max_tokens": 2000}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(head(length=len(body)) + body)
        time.sleep(0.3)
        s.close()
        deadline, info = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            info = httpx.get(srv.url + "/server_info").json()
            if info["requests_disconnected"] and not info["in_flight"]:
                break
            time.sleep(0.05)
    assert info["requests_cancelled"] == 1 and info["requests_disconnected"] == 1, info
    assert info["generated_tokens"] < 400  # ~0.4 s of 10 s of decoding
    assert_outcomes_add_up(info)


def test_streaming_clients_that_leave_are_counted(tok):
    engine = FakeEngine(word_token_ids(tok), chunk=1, delay_s=0.01)
    app = make_app(tok, engine=engine, disconnect_poll_s=0.05)
    with ThreadServer(app) as srv:
        for _ in range(4):
            with httpx.stream("POST", srv.url + CHAT, json={"messages": MSGS, "max_tokens": 40,
                                                           "stream": True}, timeout=30) as r:
                for _ in r.iter_bytes():
                    break
        assert httpx.post(srv.url + CHAT, json={"messages": MSGS, "max_tokens": 3}).status_code == 200
        deadline, info = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            info = httpx.get(srv.url + "/server_info").json()
            if info["requests_disconnected"] == 4 and not info["in_flight"]:
                break
            time.sleep(0.05)
    assert (info["requests_total"], info["requests_ok"], info["requests_disconnected"]) == (5, 1, 4)
    assert info["requests_cancelled"] == 4 and info["generated_tokens"] < 4 * 40
    assert_outcomes_add_up(info)


def test_a_stream_whose_client_left_while_queued_is_dropped_and_counted(tok):
    """A streaming client gone while its request still waits for a batch slot: its job is
    cancelled before it runs, and the request counted."""
    engine = FakeEngine(word_token_ids(tok), chunk=1, delay_s=0.02)
    app = make_app(tok, engine=engine, max_batch=1, disconnect_poll_s=0.05)
    with ThreadServer(app) as srv:
        hold = threading.Thread(target=httpx.post, args=(srv.url + CHAT,),
                                kwargs={"json": {"messages": MSGS, "max_tokens": 30}, "timeout": 30})
        hold.start()
        body = json.dumps({"messages": MSGS, "max_tokens": 30, "stream": True}).encode()
        status, _ = raw_request(srv.url, head(length=len(body)) + body, timeout=0.2)
        hold.join(30)
        deadline, info = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            info = httpx.get(srv.url + "/server_info").json()
            if info["requests_ok"] + info["requests_disconnected"] == 2 and not info["in_flight"]:
                break
            time.sleep(0.05)
    assert info["requests_disconnected"] == 1 and info["requests_ok"] == 1, (status, info)
    assert info["generated_tokens"] < 60
    assert_outcomes_add_up(info)


def test_a_stream_cut_by_starlette_still_settles_its_request(tok):
    """ASGI level: the disconnect is already there when the streaming answer begins, so Starlette
    cancels the body iterator (no exception of ours reaches it); the request is still counted and
    its job cancelled."""
    import asyncio

    app = make_app(tok, engine=FakeEngine(word_token_ids(tok), chunk=1, delay_s=0.05))
    svc = app.state.service
    body = json.dumps({"messages": MSGS, "max_tokens": 30, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    svc.worker.start()
    try:
        asyncio.run(app(scope, receive, send))
        deadline = time.monotonic() + 5
        while svc.worker.outstanding and time.monotonic() < deadline:
            time.sleep(0.02)
        info = svc.server_info_dict()
    finally:
        svc.worker.stop(5)
    assert info["requests_disconnected"] == 1 and info["requests_total"] == 1, info
    assert svc.worker.outstanding == 0 and info["generated_tokens"] < 30


# -------------------------------------------------------------------- a real `eagle3 serve`

@pytest.fixture(scope="module")
def tiny_export(tiny_target_dir, tmp_path_factory):
    from eagle3_platform.testing.serve import random_export
    return random_export(tiny_target_dir, tmp_path_factory.mktemp("draft") / "export")


@pytest.fixture(scope="module")
def real_server(tiny_target_dir, tiny_export, tmp_path_factory):
    from eagle3_platform.serve.launch import start_embedded_server

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with start_embedded_server(tiny_target_dir, tiny_export, spec="chain", log_path=log,
                               timeout=120, extra_args=["--preset", "tiny"]) as h:
        h.log = log
        yield h


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


@pytest.mark.integration
def test_the_probes_against_a_real_server(real_server):
    url = real_server.url
    ok = json.dumps({"messages": MSGS, "max_tokens": 2}).encode()
    probes = [
        (request_bytes(b'{"prompt": "a\\ud800b", "max_tokens": 4}', COMP), "400"),
        (request_bytes(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "400"),
        (request_bytes(b'{"messages": [], "max_tokens": ' + b"1" * 5_000 + b"}"), "400"),
        (request_bytes(ok, ctype="text/plain"), "415"),
        (request_bytes(ok, host="evil.example"), "421"),
        (request_bytes(ok, extra="Origin: http://evil.example\r\n"), "403"),
        (request_bytes(ok, extra="X-Big: " + "a" * 1_000_000 + "\r\n"), "431"),
        (request_bytes(ok), "200"),
    ]
    for data, want in probes:
        status, _ = raw_request(url, data)
        assert status.startswith(f"HTTP/1.1 {want}"), (want, status[:200])
    for extra in ({"top_p": 2}, {"logprobs": True}, {"tools": [{"type": "function"}]}):
        assert httpx.post(url + CHAT, json={"messages": MSGS, **extra}).status_code == 400
    assert httpx.post(url + COMP, json={"prompt": "hi", "logprobs": 5}).status_code == 400
    info = httpx.get(url + "/server_info").json()
    assert info["kernel_cache_entries"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 256,
                                            "LRU_CACHE_CAPACITY": 256}
    assert_outcomes_add_up(info)
    assert "\\ud800" not in real_server.log.read_text()


@pytest.mark.integration
def test_soak_rss_levels_off_and_the_counters_add_up(real_server):
    """Sequential and concurrent requests of many prompt lengths, streaming, non-streaming and
    abandoned: RSS over the second half stays within a bound (the shape-keyed kernel caches are
    bounded: at oneDNN's defaults it grew ~130 MB over the same half), and every request is counted."""
    import random

    url, rng = real_server.url, random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex bold zebras".split()
    before = httpx.get(url + "/server_info").json()

    def one(i: int, c: httpx.Client) -> None:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 300)))
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(4, 24),
                "temperature": rng.choice([0, 0, 0.8]), "stream": i % 3 == 0}
        if i % 10 == 9:  # abandoned mid-answer
            try:
                with c.stream("POST", url + CHAT, json={**body, "max_tokens": 64, "stream": True},
                              timeout=0.05) as r:
                    for _ in r.iter_bytes():
                        break
            except httpx.TimeoutException:
                pass
            return
        assert c.post(url + CHAT, json=body, timeout=60).status_code == 200

    def run(start: int, n: int) -> None:
        with httpx.Client() as c:
            for i in range(start, start + n):
                one(i, c)

    run(0, 150)
    mid = rss_mb(real_server.pid)
    threads = [threading.Thread(target=run, args=(150 + 25 * k, 25)) for k in range(2)]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    run(200, 100)
    end = rss_mb(real_server.pid)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = httpx.get(url + "/server_info").json()
        if not info["in_flight"] and not info["queue_depth"]:
            break
        time.sleep(0.1)
    delta = {k: info[k] - before[k] for k in ("requests_total", *OUTCOMES)}
    assert delta["requests_total"] == 300 and sum(delta[k] for k in OUTCOMES) == 300, delta
    assert delta["requests_disconnected"] >= 15 and delta["requests_failed"] == 0, delta
    assert end - mid < 40, (mid, end)
