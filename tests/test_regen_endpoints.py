"""Regeneration through several OpenAI-compatible endpoints: real embedded servers on the tiny target
(one behind a loopback proxy that answers 429 with Retry-After), the model-id check, exact accounting."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3_platform.data.endpoint import EndpointRefused, retry_after_s, split_endpoints
from eagle3_platform.data.regenerate import PRESETS, regenerate_file
from eagle3_platform.store.records import read_jsonl

CFG = replace(PRESETS["tiny"], max_new_tokens=10, backoff_s=0.05, max_retries=3)
USERS = [["What is 2+2?"], ["Name a colour.", "And another one?"], ["Say hi."], ["Count to three.", "Now back."],
         ["Why is the sky blue?"], ["A short poem?"], ["Spell cat.", "Spell dog.", "Spell cow."], ["Hello?"]]


class Proxy:
    """A loopback proxy in front of `upstream`: answers the first `busy` chat requests (and every one
    whose last message holds "BUSY") with 429 + `Retry-After: 1`, forwards the rest. Keeps, per
    request body, when it came and what it was answered."""

    def __init__(self, upstream: str, busy: int = 0):
        import httpx

        self.upstream, self.busy, self.seen = upstream, busy, []
        self.lock = threading.Lock()
        proxy, client = self, httpx.Client(timeout=60)

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code: int, data: bytes, headers=()) -> None:
                self.send_response(code)
                for k, v in (("Content-Type", "application/json"), ("Content-Length", str(len(data))), *headers):
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                r = client.get(proxy.upstream + self.path)
                self._reply(r.status_code, r.content)

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with proxy.lock:
                    busy = proxy.busy > 0 or "BUSY" in json.loads(body)["messages"][-1]["content"]
                    proxy.busy -= int(proxy.busy > 0)
                    proxy.seen.append((body, time.monotonic(), 429 if busy else 200))
                if busy:
                    self._reply(429, b'{"error": "busy"}', [("Retry-After", "1")])
                else:
                    r = client.post(proxy.upstream + self.path, content=body,
                                    headers={"Content-Type": "application/json"})
                    self._reply(r.status_code, r.content)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._client = client

    def __enter__(self) -> "Proxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
        self._client.close()


def embedded(target_dir, name: str | None = None):
    """The real embedded server app (`eagle3 serve` without a draft) on the tiny target, fp32 greedy."""
    from eagle3_platform.serve.config import PRESETS as SERVE
    from eagle3_platform.serve.server import build_app, build_engine
    from eagle3_platform.testing.serve import ThreadServer

    engine, target, info = build_engine(target_dir, None, "chain", "float32")
    app = build_app(engine, target.tokenizer, SERVE["tiny"], model_name=name or info["target_id"],
                    context_length=512, info=info)
    return ThreadServer(app)


@pytest.fixture(scope="module")
def servers(tiny_target_dir):
    with embedded(tiny_target_dir) as a, embedded(tiny_target_dir) as b:
        yield a.url, b.url


def write_in(path, users=USERS):
    rows = [{"id": f"r{i}", "workload": "multi_turn", "source": "test", "license": "MIT",
             "messages": [{"role": "user", "content": u} for u in us]} for i, us in enumerate(users)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_without_endpoint(path) -> list[dict]:
    rows = list(read_jsonl(path))
    for r in rows:
        r["generation"].pop("endpoint")  # the URLs asked: the one field that names the servers
    return rows


def test_two_endpoints_one_busy_give_the_one_endpoint_records(tiny_target_dir, servers, tmp_path):
    inp = write_in(tmp_path / "in.jsonl")
    one = regenerate_file(tiny_target_dir, inp, tmp_path / "one.jsonl", CFG, endpoint=servers[0], scanner=False)
    assert (one["read"], one["written"], one["rejected"], one["endpoint_retries"]) == (8, 8, 0, 0)
    with Proxy(servers[1], busy=3) as busy:
        two = regenerate_file(tiny_target_dir, inp, tmp_path / "two.jsonl", CFG, endpoint=[servers[0], busy.url],
                              scanner=False)
    assert (two["read"], two["written"], two["rejected"]) == (8, 8, 0)
    assert two["endpoint_retries"] == 3 and two["endpoints"][busy.url]["retries"] == 3
    assert all(e["conversations"] > 0 for e in two["endpoints"].values())  # both did work
    assert sum(e["conversations"] for e in two["endpoints"].values()) == 8
    # every 429 was asked again, never sooner than its Retry-After (1 s)
    refused = [(body, t) for body, t, code in busy.seen if code == 429]
    assert len(refused) == 3
    for body, t in refused:
        again = [t2 for b2, t2, _ in busy.seen if b2 == body and t2 > t]
        assert again and again[0] - t >= 1.0
    # same records, same order, byte for byte but the endpoint URLs
    assert rows_without_endpoint(tmp_path / "two.jsonl") == rows_without_endpoint(tmp_path / "one.jsonl")
    gen = next(read_jsonl(tmp_path / "two.jsonl"))["generation"]
    assert gen["endpoint"] == f"{servers[0]},{busy.url}"
    # a rerun over the comma-separated list resumes: nothing asked again, nothing written twice
    again = regenerate_file(tiny_target_dir, inp, tmp_path / "two.jsonl", CFG,
                            endpoint=f"{servers[1]},{servers[0]}", scanner=False)
    assert (again["resumed"], again["written"], again["endpoint_retries"]) == (8, 8, 0)
    assert rows_without_endpoint(tmp_path / "two.jsonl") == rows_without_endpoint(tmp_path / "one.jsonl")


def test_a_conversation_still_busy_after_its_retries_is_rejected_and_counted(tiny_target_dir, servers, tmp_path):
    inp = write_in(tmp_path / "in.jsonl", [["fine"], ["please BUSY"], ["Hi", "then BUSY again"], ["also fine"]])
    with Proxy(servers[0]) as p0, Proxy(servers[1]) as p1:
        s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", replace(CFG, max_retries=1),
                            endpoint=[p0.url, p1.url], scanner=False, rejected_path=tmp_path / "rej.jsonl")
    assert (s["read"], s["written"], s["rejected"]) == (4, 2, 2)  # read == kept + rejected
    assert s["by_reason"] == {"endpoint:429": 2}
    assert {r["id"] for r in read_jsonl(tmp_path / "rej.jsonl")} == {"r1", "r2"}
    assert {r["id"] for r in read_jsonl(tmp_path / "out.jsonl")} == {"r0", "r3"}
    # each BUSY conversation asked twice (one retry) wherever it went; the summary counts those retries
    assert sum(code == 429 for _, _, code in p0.seen + p1.seen) == 4 and s["endpoint_retries"] == 2


def test_an_endpoint_serving_another_model_is_refused_before_any_work(tiny_target_dir, servers, tmp_path):
    inp = write_in(tmp_path / "in.jsonl")
    with embedded(tiny_target_dir, "other-model") as other, Proxy(other.url) as watch:
        with pytest.raises(EndpointRefused) as e:
            regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", CFG, endpoint=[servers[0], watch.url],
                            scanner=False)
        assert not watch.seen  # no chat request reached it
    msg = str(e.value)
    assert watch.url in msg and "'other-model'" in msg and "'tiny-random'" in msg
    out = tmp_path / "out.jsonl"
    assert not out.exists() or not out.read_text()  # nothing asked of the good one either
    # the id it is served under, named: accepted
    with embedded(tiny_target_dir, "other-model") as other:
        s = regenerate_file(tiny_target_dir, write_in(tmp_path / "in2.jsonl", USERS[:2]), tmp_path / "out2.jsonl",
                            CFG, endpoint=other.url, scanner=False, served_model="other-model")
    assert s["written"] == 2
    # a server started on the model's directory lists its path: its last components are the target id
    with embedded(tiny_target_dir, "/models/tiny-random") as by_path, Proxy(by_path.url) as watch:
        s = regenerate_file(tiny_target_dir, write_in(tmp_path / "in3.jsonl", USERS[:1]), tmp_path / "out3.jsonl",
                            CFG, endpoint=watch.url, scanner=False)
    assert s["written"] == 1 and json.loads(watch.seen[0][0])["model"] == "/models/tiny-random"
    with embedded(tiny_target_dir, "/models/not-tiny-random") as near:
        with pytest.raises(EndpointRefused, match="not-tiny-random"):
            regenerate_file(tiny_target_dir, tmp_path / "in3.jsonl", tmp_path / "out4.jsonl", CFG,
                            endpoint=near.url, scanner=False)


def test_endpoint_lists_and_retry_after():
    assert split_endpoints("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    assert split_endpoints(["http://a:1", "http://b:2,http://c:3"]) == ["http://a:1", "http://b:2", "http://c:3"]
    assert split_endpoints(None) == []
    with pytest.raises(ValueError, match="more than once: http://a:1"):
        split_endpoints(["http://u:pw@a:1", "http://u:pw@a:1"])
    assert retry_after_s("2") == 2.0 and retry_after_s(None) is None and retry_after_s("soon") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: at once


def test_the_cli_takes_repeated_endpoints_and_reports_a_refusal(tiny_target_dir, servers, tmp_path, capsys):
    from eagle3_platform.cli import main

    inp = write_in(tmp_path / "in.jsonl", USERS[:3])

    def cli(*endpoints) -> tuple[int, dict]:
        capsys.readouterr()
        rc = main(["regenerate", "--target", str(tiny_target_dir), "--in", str(inp), "--out",
                   str(tmp_path / "out.jsonl"), "--preset", "tiny", "--max-new-tokens", "8", "--no-scan-responses",
                   *[a for e in endpoints for a in ("--endpoint", e)]])
        return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    with embedded(tiny_target_dir, "other-model") as other:
        rc, s = cli(servers[0], other.url)
    assert rc != 0 and other.url in s["error"] and "'other-model'" in s["error"]
    rc, s = cli(*servers)
    assert rc == 0 and s["written"] == 3 and set(s["endpoints"]) == set(servers)
