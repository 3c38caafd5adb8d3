"""Bad input through the CLI, as a user calls it: every bad record is rejected with a reason and the run
goes on; a stage with nothing usable fails with one line saying why; resume never mixes targets or
settings; bad paths are one-line errors. Ends with a seeded fuzz run."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from eagle3_platform.cli import main
from eagle3_platform.model.target import META_FILE
from eagle3_platform.store.records import read_jsonl


def rec(i: int | str, *users: str, **extra) -> dict:
    rid = i if isinstance(i, str) else f"r{i}"
    return {"id": rid, "workload": "chat", "source": "unit", "license": "MIT",
            "messages": [{"role": "user", "content": u} for u in users], "n_chars": 0, **extra}


def write(path: Path, lines: list) -> Path:
    """lines: dicts (dumped) or raw str/bytes lines, written as they are."""
    out = b""
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        out += (line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line) + b"\n"
    path.write_bytes(out)
    return path


def cli(capsys, *argv) -> tuple[int, dict, str]:
    """Run `eagle3 argv` in-process: (exit code, JSON summary from the last stdout line, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, json.loads(cap.out.strip().splitlines()[-1]), cap.err


def filter_args(inp: Path, tmp_path: Path) -> list:
    return ["filter", "--in", inp, "--out", tmp_path / "kept.jsonl", "--rejected", tmp_path / "rej.jsonl",
            "--no-decontaminate"]


def regen_args(target: Path, inp: Path, out: Path, *more) -> list:
    return ["regenerate", "--target", target, "--in", inp, "--out", out, "--preset", "tiny",
            "--max-new-tokens", "3", "--no-scan-responses", *more]


def reasons(path: Path) -> dict[str, str]:
    return {r["id"]: r["reason"] for r in read_jsonl(path)}


# ------------------------------------------------------------------------- one bad record, run goes on

SURROGATE = '{"id": "sur", "workload": "chat", "source": "unit", "license": "MIT", ' \
            '"messages": [{"role": "user", "content": "a \\ud800 b"}]}'


def test_lone_surrogate_and_non_objects_are_rejected_and_the_run_goes_on(tiny_target_dir, tmp_path, capsys):
    lines = [rec(1, "What is a list?"), SURROGATE, b'{"id": "raw", "x": "\xff\xfe"}', "[1]", '"x"', "42",
             rec(2, "What is a dict?")]
    inp = write(tmp_path / "in.jsonl", lines)
    rc, s, err = cli(capsys, *filter_args(inp, tmp_path))
    assert rc == 0, err
    assert (s["read"], s["kept"], s["rejected"]) == (7, 2, 5)
    rej = list(read_jsonl(tmp_path / "rej.jsonl"))
    assert {r["line"]: r["reason"] for r in rej} == {2: "bad:encoding", 3: "bad:encoding", 4: "bad:json",
                                                     5: "bad:json", 6: "bad:json"}
    # regenerate gets the same file (it is the first stage for users who bring their own prompts)
    rc, s, err = cli(capsys, *regen_args(tiny_target_dir, inp, tmp_path / "conv.jsonl"))
    assert rc == 0, err
    assert (s["read"], s["written"], s["rejected"]) == (7, 2, 5)
    assert s["by_reason"] == {"bad:encoding": 2, "bad:json": 3}


def test_sources_survive_a_surrogate_in_a_user_supplied_file(tmp_path, capsys, monkeypatch):
    extra = tmp_path / "extra" / "code"
    extra.mkdir(parents=True)
    write(extra / "mine.jsonl", ['{"prompt": "bad \\ud800 text", "split": "train"}',
                                 {"prompt": "Write a function that reverses a string.", "split": "train"}])
    monkeypatch.setenv("EAGLE3_EXTRA_SOURCES", str(tmp_path / "extra"))
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "src.jsonl"
    rc, s, err = cli(capsys, "sources", "--workload", "code", "--preset", "tiny", "--limit", "12", "--out", out)
    assert rc == 0, err
    mine = [r for r in read_jsonl(out) if r["source"] == "extra/code/mine.jsonl"]
    assert [len(r["messages"]) for r in mine] == [0, 1]  # kept empty: the filter rejects and counts it


# ------------------------------------------------------------------------------------- duplicate ids

def test_duplicate_ids_are_rejected_as_dup_id_by_filter_and_regenerate(tiny_target_dir, tmp_path, capsys):
    inp = write(tmp_path / "in.jsonl", [rec(1, "What is a list?"), rec(1, "Something else entirely?"),
                                        rec(2, "What is a set?")])
    rc, s, _ = cli(capsys, *filter_args(inp, tmp_path))
    assert rc == 0 and (s["kept"], s["by_reason"]) == (2, {"dup:id": 1})
    assert [r["id"] for r in read_jsonl(tmp_path / "kept.jsonl")] == ["r1", "r2"]
    dup = next(read_jsonl(tmp_path / "rej.jsonl"))
    assert dup["line"] == 2 and dup["id"] != "r1"  # named by its line: ids stay unique across outputs
    # regenerate on the unfiltered file: the later one is rejected, never a crash
    rc, s, err = cli(capsys, *regen_args(tiny_target_dir, inp, tmp_path / "conv.jsonl"))
    assert rc == 0, err
    assert (s["read"], s["written"], s["rejected"], s["by_reason"]) == (3, 2, 1, {"dup:id": 1})


def test_schema_invalid_records_sharing_an_id_are_accounted_on_every_rerun(tiny_target_dir, tmp_path, capsys):
    bad = {"id": "same", "workload": "chat", "messages": "not a list"}
    inp = write(tmp_path / "in.jsonl", [bad, bad, rec(1, "What is a tuple?")])
    args = regen_args(tiny_target_dir, inp, tmp_path / "conv.jsonl")
    for run in range(2):  # the rerun resumes: nothing new, same exact accounting
        rc, s, err = cli(capsys, *args)
        assert rc == 0, err
        assert (s["read"], s["written"], s["rejected"]) == (3, 1, 2)
        assert s["by_reason"] == {"bad:schema:source": 1, "dup:id": 1}
        assert s["resumed"] == (0 if run == 0 else 3)


# ------------------------------------------------------------------- unknown keys, named reasons, lines

def test_extra_keys_are_ignored_counted_and_never_copied(tmp_path, capsys):
    rows = [rec(1, "What is a list?"), rec(2, "What is a list?"), rec(3, "Mail jane.roe@example.org today"),
            {**rec(4, "Hi"), "messages": [{"role": "wizard", "content": "Hi"}]}, rec(5, "What is a set?")]
    plain = write(tmp_path / "plain.jsonl", rows)
    labelled = write(tmp_path / "labelled.jsonl", [{**r, "label": f"L{i}"} for i, r in enumerate(rows)])
    for d in "ab":
        (tmp_path / d).mkdir()
    rc_a, s_a, _ = cli(capsys, *filter_args(plain, tmp_path / "a"))
    rc_b, s_b, _ = cli(capsys, *filter_args(labelled, tmp_path / "b"))
    assert rc_a == rc_b == 0
    assert (tmp_path / "a/kept.jsonl").read_bytes() == (tmp_path / "b/kept.jsonl").read_bytes()
    rej_a, rej_b = (list(read_jsonl(tmp_path / d / "rej.jsonl")) for d in "ab")
    assert [(r["id"], r["reason"]) for r in rej_a] == [(r["id"], r["reason"]) for r in rej_b]
    assert s_a["by_reason"] == s_b["by_reason"] == {"bad:schema:messages[0].role": 1, "dup": 1,
                                                    "pii:EMAIL_ADDRESS": 1}
    assert s_a["ignored_keys"] == {} and s_b["ignored_keys"] == {"label": 5}
    assert "label" not in (tmp_path / "b/kept.jsonl").read_text()


def test_reason_names_the_field_and_bad_json_its_line(tmp_path, capsys):
    inp = write(tmp_path / "in.jsonl", [rec(1, "What is a list?"),
                                        {**rec(2, "Hi"), "messages": [{"role": "user", "content": "Hi"},
                                                                      {"role": "robot", "content": "x"}]},
                                        "", '{"id": "torn", "mess'])
    rc, s, _ = cli(capsys, *filter_args(inp, tmp_path))
    assert rc == 0
    rej = {r["reason"]: r for r in read_jsonl(tmp_path / "rej.jsonl")}
    assert set(rej) == {"bad:schema:messages[1].role", "bad:json"}
    assert rej["bad:json"]["line"] == 4 and rej["bad:schema:messages[1].role"]["line"] == 2


def test_a_json_array_file_is_refused_as_not_json_lines(tmp_path, capsys):
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([rec(1, "Hi"), rec(2, "Hello")], indent=2))
    rc, s, err = cli(capsys, *filter_args(arr, tmp_path))
    assert rc == 2 and "expected JSON Lines" in s["error"] and err.startswith("eagle3 filter: error:")


# ------------------------------------------------------------------------ empty results are failures

def test_stages_with_nothing_usable_exit_nonzero_and_say_why(tiny_target_dir, tmp_path, capsys):
    inp = write(tmp_path / "in.jsonl", ["[1]", {"id": "x", "messages": []},
                                        {**rec(3), "messages": [{"role": "system", "content": "Be brief."}]}])
    rc, s, err = cli(capsys, *filter_args(inp, tmp_path))
    assert rc == 2 and not s["ok"]
    assert "0 of 3 records kept" in s["error"] and "bad:" in s["error"] and "rej.jsonl" in s["error"]
    assert len(list(read_jsonl(tmp_path / "rej.jsonl"))) == 3  # the reasons are there to read
    rc, s, _ = cli(capsys, *regen_args(tiny_target_dir, inp, tmp_path / "conv.jsonl"))
    assert rc == 2 and "0 of 3 records written" in s["error"]
    empty = write(tmp_path / "empty.jsonl", [])
    rc, s, _ = cli(capsys, *filter_args(empty, tmp_path))
    assert rc == 2 and "no records" in s["error"]
    rc, s, _ = cli(capsys, "sources", "--workload", "code", "--preset", "tiny", "--limit", "0",
                   "--out", tmp_path / "src.jsonl")
    assert rc == 2 and "0 code/train records" in s["error"]


# --------------------------------------------------------------------------------- resume key

def test_regenerate_resume_refuses_another_target_or_settings(tiny_target_dir, tmp_path, capsys):
    inp = write(tmp_path / "in.jsonl", [rec(1, "What is a list?"), rec(2, "What is a set?")])
    out = tmp_path / "conv.jsonl"
    assert cli(capsys, *regen_args(tiny_target_dir, inp, out))[0] == 0
    before = out.read_bytes()
    rc, s, err = cli(capsys, *regen_args(tiny_target_dir, inp, out, "--temperature", "0.7"))
    assert rc == 2 and "temperature 0.0 -> 0.7" in s["error"] and "--restart" in s["error"]
    assert len(err.strip().splitlines()) == 1 and out.read_bytes() == before
    other = tmp_path / "other-target"  # as `prepare-target` writes it for another checkpoint
    shutil.copytree(tiny_target_dir, other)
    meta = json.loads((other / META_FILE).read_text())
    (other / META_FILE).write_text(json.dumps({**meta, "target_id": "other-model", "weights_hash": "0" * 64}))
    rc, s, _ = cli(capsys, *regen_args(other, inp, out))
    assert rc == 2 and "target_id 'tiny-random' -> 'other-model'" in s["error"] and "weights_hash" in s["error"]
    rc, s, err = cli(capsys, *regen_args(other, inp, out, "--restart"))
    assert rc == 0, err
    assert s["target_id"] == "other-model" and s["resumed"] == 0 and s["written"] == 2
    assert {r["target_id"] for r in read_jsonl(out)} == {"other-model"}


# ------------------------------------------------------------------------------------ bad paths

def test_same_path_arguments_are_refused(tiny_target_dir, tmp_path, capsys):
    inp = write(tmp_path / "in.jsonl", [rec(1, "What is a list?")])
    before = inp.read_bytes()
    x = tmp_path / "x.jsonl"
    cases = [["filter", "--in", inp, "--out", x, "--rejected", x, "--no-decontaminate"],
             ["filter", "--in", inp, "--out", x, "--rejected", inp, "--no-decontaminate"],
             ["filter", "--in", inp, "--out", tmp_path / "." / "in.jsonl", "--rejected", x, "--no-decontaminate"],
             regen_args(tiny_target_dir, inp, inp),
             regen_args(tiny_target_dir, inp, x, "--rejected", inp),
             regen_args(tiny_target_dir, inp, x, "--rejected", x)]
    for argv in cases:
        rc, s, err = cli(capsys, *argv)
        assert rc == 2 and "same file" in s["error"], argv
        assert len(err.strip().splitlines()) == 1
    assert inp.read_bytes() == before and not x.exists()


def _output_cases(t: Path, f: Path, d: Path) -> list[tuple[str, list, str, str]]:
    """(command, argv with OUT for the output, flag, kind): every subcommand that writes a path."""
    return [("prepare-target", ["--model", "tiny-random", "--out", "OUT"], "--out", "dir"),
            ("sources", ["--workload", "code", "--out", "OUT"], "--out", "file"),
            ("filter", ["--in", f, "--out", "OUT", "--rejected", d / "r.jsonl"], "--out", "file"),
            ("filter", ["--in", f, "--out", d / "k.jsonl", "--rejected", "OUT"], "--rejected", "file"),
            ("regenerate", ["--target", t, "--in", f, "--out", "OUT"], "--out", "file"),
            ("regenerate", ["--target", t, "--in", f, "--out", d / "o.jsonl", "--rejected", "OUT"], "--rejected",
             "file"),
            ("extract", ["--target", t, "--in", f, "--out", "OUT"], "--out", "dir"),
            ("train", ["--target", t, "--features", d, "--out", "OUT"], "--out", "dir"),
            ("export", ["--draft", d, "--out", "OUT"], "--out", "dir"),
            ("vocab", ["--features", d, "--target", t, "--out", "OUT", "--draft-vocab-size", "8"], "--out", "file"),
            ("serve", ["--target", t, "--ready-file", "OUT"], "--ready-file", "file"),
            ("eval", ["--target", t, "--prompts", f, "--out", "OUT"], "--out", "file"),
            ("bench", ["--url", "http://127.0.0.1:9", "--prompts", f, "--out", "OUT"], "--out", "dir"),
            ("run", ["--data-dir", "OUT"], "--data-dir", "dir"),
            ("run", ["--dagster-home", "OUT"], "--dagster-home", "dir")]


def test_bad_output_paths_are_one_line_errors_for_every_command(tiny_target_dir, tmp_path, capsys):
    f = write(tmp_path / "in.jsonl", [rec(1, "What is a list?")])
    d = tmp_path / "dir"
    d.mkdir()
    for cmd, argv, flag, kind in _output_cases(tiny_target_dir, f, d):
        # under a regular file; and the wrong kind (a directory for a file output, a file for a dir output)
        for bad in (f / "sub" / "out", d if kind == "file" else f):
            rc, s, err = cli(capsys, cmd, *[bad if a == "OUT" else a for a in argv])
            assert rc == 2 and not s["ok"], (cmd, bad)
            assert err.strip().splitlines()[-1].startswith(f"eagle3 {cmd}: error: {flag}"), (cmd, bad, err[-500:])
            assert "Traceback" not in err


# ------------------------------------------------------------------------------------------ fuzz

def fuzz_lines(n: int, seed: int) -> list[bytes]:
    """Seeded malformed JSONL: random bytes, truncations, wrong types, surrogates, huge values, non-objects,
    duplicate ids, extra keys, template tokens in text; plus some valid records."""
    rng = random.Random(seed)
    junk = [None, 42, -1, 1.5, True, "", "x", [], {}, [1], {"a": 1}, "\u0000", 10 ** 30]
    out = []
    for i in range(n):
        r = rec(i, f"Question {i}: what is {i} plus one?")
        kind = rng.randrange(14)
        if kind == 0:
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))).replace(b"\n", b" "))
            continue
        if kind == 1:
            line = json.dumps(r).encode()
            out.append(line[: rng.randrange(1, len(line))])
            continue
        if kind == 2:
            out.append(rng.choice([b"[1]", b'"x"', b"42", b"null", b"true", b"1e999", b"NaN", b"{}", b"[]"]))
            continue
        if kind == 3:
            out.append(json.dumps(r).replace("Question", rng.choice(["\\ud800", "\\udfff", "a\\ud83d"])).encode())
            continue
        if kind == 4:
            big = rng.choice(["{\"id\": \"h%d\", \"n_chars\": 1%s}" % (i, "9" * 5000),
                              "[" * 100_000 + "]" * 100_000, json.dumps({**r, "n_chars": 1e999}),
                              json.dumps({**r, "id": "i" * 100_000})])
            out.append(big.encode())
            continue
        if kind == 5:
            r[rng.choice(list(r))] = rng.choice(junk)
        elif kind == 6:
            r["messages"] = [rng.choice([1, "hi", None, {"role": "user"}, {"content": "x"},
                                         {"role": "wizard", "content": "x"}, {"role": "user", "content": ["a"]},
                                         {"role": "assistant", "content": "only an answer"}])]
        elif kind == 7:
            r["id"] = f"r{rng.randrange(i + 1)}"  # often an earlier record's id
        elif kind == 8:
            r["label"], r["meta"] = rng.choice(junk), {"k": rng.choice(junk)}
            r["messages"][0]["name"] = "tool"
        elif kind == 9:
            r["messages"][0]["content"] = rng.choice(["<|im_start|>assistant\nhi<|im_end|>", "<|im_end|>",
                                                      "\u2028\ufeff\x00", "  "])
        elif kind == 10 and rng.random() < 0.2:
            r["messages"][0]["content"] = "long words " * 3000
        out.append(json.dumps(r, ensure_ascii=rng.random() < 0.5).encode())
    return out


def test_fuzz_malformed_lines_through_filter_and_regenerate(tiny_target_dir, tmp_path, capsys):
    lines = fuzz_lines(300, seed=8)
    inp = tmp_path / "fuzz.jsonl"
    inp.write_bytes(b"\n".join(lines) + b"\n")
    n_read = sum(1 for line in inp.read_bytes().split(b"\n") if line.strip())
    rc, s, err = cli(capsys, *filter_args(inp, tmp_path))
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    assert s["read"] == n_read and s["kept"] + s["rejected"] == n_read and s["kept"] > 0
    kept, rej = list(read_jsonl(tmp_path / "kept.jsonl")), list(read_jsonl(tmp_path / "rej.jsonl"))
    assert (len(kept), len(rej)) == (s["kept"], s["rejected"])
    ids = [r["id"] for r in kept + rej]
    assert len(ids) == len(set(ids))  # ids unique after the filter
    assert all(1 <= r["line"] <= len(lines) for r in rej)
    assert "Question" not in (tmp_path / "rej.jsonl").read_text()  # reasons only, never text
    assert "label" not in (tmp_path / "kept.jsonl").read_text()

    out = tmp_path / "conv.jsonl"
    rc, s, err = cli(capsys, *regen_args(tiny_target_dir, inp, out))
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    assert s["read"] == n_read and s["written"] + s["rejected"] == n_read and s["written"] > 0
    rows = list(read_jsonl(out)) + list(read_jsonl(tmp_path / "conv.rejected.jsonl"))
    assert len(rows) == n_read and len({r["id"] for r in rows}) == n_read


def test_dropping_rows_keeps_the_other_lines_as_written_and_cuts_a_torn_tail(tmp_path):
    from eagle3_platform.store.records import drop_jsonl_rows

    path = tmp_path / "out.jsonl"
    lines = [b'{"id":"a","n":1}\n', b'{"id": "b", "n": 2}\n', b'{"id":"c","n":3}\n']
    path.write_bytes(b"".join(lines) + b'{"id":"d","n"')  # a killed appender's torn last line
    assert drop_jsonl_rows(path, lambda r: r["n"] == 5) == 0 and path.read_bytes().endswith(b'"n"')  # untouched
    assert drop_jsonl_rows(path, lambda r: r["id"] == "b") == 1  # b; the torn tail goes too
    assert path.read_bytes() == lines[0] + lines[2]
    assert not list(tmp_path.glob("*.tmp"))
    path.write_bytes(lines[0] + b"{broken\n" + lines[2])
    with pytest.raises(ValueError, match="broken JSON line 2"):
        drop_jsonl_rows(path, lambda r: True)
    assert path.read_bytes() == lines[0] + b"{broken\n" + lines[2]  # nothing written
