"""Users' input files as they come (store/records.py's reader, the filter): a UTF-8 BOM keeps the first
record; a line longer than the reader's bound is rejected by line number without being held whole (peak
RSS of `eagle3 filter` on a 50 MB line); a prompt's size is bounded without a tokenizer. And every
artifact is written byte for byte the same twice (answer n-gram table, vocab, export)."""
from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_platform.store import records as R
from eagle3_platform.store.records import BadRecord, LongLine, parse_line, read_jsonl, read_lines

ROOT = Path(__file__).resolve().parents[1]


def rec(i: int, text: str) -> str:
    return json.dumps({"id": f"r{i}", "workload": "chat", "source": "t", "license": "cc0",
                       "messages": [{"role": "user", "content": text}]})


def filter_cli(tmp_path, inp, *extra) -> tuple[dict, list[dict], int]:
    """`eagle3 filter` in its own process -> (summary, rejections, peak RSS of that process in MB)."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    cmd = [sys.executable, "-m", "eagle3_platform.cli", "filter", "--in", str(inp), "--out",
           str(tmp_path / "kept.jsonl"), "--rejected", str(tmp_path / "rej.jsonl"), "--preset", "tiny",
           "--no-decontaminate", *extra]
    r = subprocess.run([sys.executable, "-c", code, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    return json.loads(lines[-2]), list(read_jsonl(tmp_path / "rej.jsonl")), int(lines[-1]) // 1024


def test_a_bom_at_the_start_keeps_the_first_record(tmp_path):
    inp = tmp_path / "bom.jsonl"
    inp.write_bytes(R.BOM + f"{rec(1, 'What is a list?')}\n{rec(2, 'What is a set?')}\n".encode())
    from eagle3_platform.data.filter import filter_file

    s = filter_file(inp, tmp_path / "k.jsonl", tmp_path / "r.jsonl")
    assert (s["read"], s["kept"], s["rejected"]) == (2, 2, 0)
    assert [r["id"] for r in read_jsonl(tmp_path / "k.jsonl")] == ["r1", "r2"]
    assert parse_line("\ufeff" + rec(3, "x"))["id"] == "r3"  # a reader that decodes lines itself


@pytest.mark.parametrize("chunk", [1, 3, 16, 1 << 20])
def test_the_reader_splits_like_bytes_split_and_stands_in_for_long_lines(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(R, "READ_CHUNK", chunk)
    rng = random.Random(chunk)
    for _ in range(60):
        lines = [b"x" * rng.choice([0, 1, 9, 10, 11, 40]) for _ in range(rng.randint(1, 6))]
        data = b"\n".join(lines) + rng.choice([b"", b"\n"])
        (tmp_path / "f.jsonl").write_bytes(data)
        got = list(read_lines(tmp_path / "f.jsonl", max_line_bytes=10))
        want = [LongLine() if len(x) > 10 else x for x in data.split(b"\n")]
        assert got == want and [type(g) for g in got] == [type(w) for w in want]
    with pytest.raises(BadRecord, match="bad:line_too_long"):
        parse_line(LongLine())


def test_a_50mb_line_is_rejected_by_line_number_in_bounded_memory(tmp_path, tiny_target_dir):
    inp = tmp_path / "big.jsonl"
    with open(inp, "w") as f:
        f.write(rec(1, "Say hi.") + "\n" + rec(2, "word " * (10 << 20)) + "\n" + rec(3, "Name a colour.") + "\n")
    assert inp.stat().st_size > 50 << 20
    s, rej, peak_mb = filter_cli(tmp_path, inp, "--target", str(tiny_target_dir))
    assert (s["read"], s["kept"], s["by_reason"]) == (3, 2, {"bad:line_too_long": 1})
    assert [(r["reason"], r["line"]) for r in rej] == [("bad:line_too_long", 2)]
    assert peak_mb < 1024, f"peak RSS {peak_mb} MB"  # a memory bound, not a timing: 12 GB before


def test_a_prompt_is_bounded_without_a_tokenizer(tmp_path):
    from eagle3_platform.data.filter import PRESETS, filter_file

    cfg = PRESETS["tiny"]
    inp = tmp_path / "in.jsonl"
    inp.write_text(rec(1, "Hi there.") + "\n" + rec(2, "a " * cfg.max_prompt_chars) + "\n")
    s = filter_file(inp, tmp_path / "k.jsonl", tmp_path / "r.jsonl", cfg=cfg)  # no tokenizer, no max_tokens
    assert s["kept"] == 1 and s["by_reason"] == {"bad:too_long": 1}
    assert [(r["id"], r["line"]) for r in read_jsonl(tmp_path / "r.jsonl")] == [("r2", 2)]
    assert all(p.max_prompt_chars > 0 and p.max_line_bytes > 4 * p.max_prompt_chars for p in PRESETS.values())


def test_regeneration_reads_through_the_same_bounded_reader(tmp_path, monkeypatch):
    from eagle3_platform.data.regenerate import read_prompts

    monkeypatch.setattr(R, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(R.read_lines, "__defaults__", (1000,))
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(R.BOM + (rec(1, "Hi.") + "\n" + rec(2, "x" * 5000) + "\n").encode())
    p = read_prompts(inp)
    assert [c.rec.id for c in p.convos] == ["r1"]
    assert [(r.reason, r.line) for r in p.rejected] == [("bad:line_too_long", 2)]


def test_a_user_prompt_file_is_read_through_the_bounded_reader(tmp_path, monkeypatch):
    from eagle3_platform.data.sources.extra import iter_extra_file

    monkeypatch.setattr(R.read_lines, "__defaults__", (1000,))
    inp = tmp_path / "mine.jsonl"
    line = lambda text: json.dumps({"messages": [{"role": "user", "content": text}]})  # noqa: E731
    inp.write_bytes(R.BOM + (line("Hi.") + "\n" + line("x" * 5000) + "\n" + line("Bye.") + "\n").encode())
    items = list(iter_extra_file("chat", inp))
    assert [i.messages for i in items] == [(("user", "Hi."),), (), (("user", "Bye."),)]  # the long one: empty, rejected later


# ---- byte-deterministic artifacts ------------------------------------------------------------------
def _same_bytes(write, paths) -> None:
    for p in paths:
        write(p)
    blobs = {Path(p).read_bytes() for p in paths}
    assert len(blobs) == 1, "two writes of the same data differ"


def test_the_answer_ngram_table_is_written_byte_identically(tmp_path):
    """Its two metadata keys came out in hash-map order: 1 in 2^7 for 8 equal writes by chance."""
    from eagle3_platform.draft.answer_ngrams import AnswerNgrams

    table = AnswerNgrams.build([[1, 5, 6, 7, 9], [2, 5, 6, 7, 9], [3, 5, 8]])
    paths = [tmp_path / f"t{i}.safetensors" for i in range(8)]
    _same_bytes(table.save, paths)
    back = AnswerNgrams.load(paths[0])
    assert torch.equal(back.keys, table.keys) and torch.equal(back.shares, table.shares)
    assert back.answer_tokens == table.answer_tokens and back.chain([4, 5], 5) == table.chain([4, 5], 5)


def test_vocab_and_export_are_written_byte_identically(tmp_path, random_head_export):
    from eagle3_platform.draft.export import export_draft
    from eagle3_platform.draft.vocab import build_vocab, save_vocab

    d2t, t2d, stats = build_vocab(torch.arange(50, dtype=torch.int64), 50, 16)
    _same_bytes(lambda p: save_vocab(p, d2t, t2d, stats), [tmp_path / f"v{i}.safetensors" for i in range(6)])
    assert len({(tmp_path / f"v{i}.safetensors.json").read_bytes() for i in range(6)}) == 1
    draft = random_head_export.parent / "draft"
    outs = [tmp_path / f"e{i}" for i in range(3)]
    for o in outs:
        export_draft(draft, o)
    for name in sorted(p.name for p in outs[0].iterdir()):
        assert len({(o / name).read_bytes() for o in outs}) == 1, name
