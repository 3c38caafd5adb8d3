"""`eagle3 eval` on the tiny target with a random exported head: summary keys, per-workload figures,
losslessness check, user errors."""
from __future__ import annotations

import json

import pytest

from eagle3_platform import cli
from eagle3_platform.store.records import Message, PromptRecord, write_jsonl_atomic


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    def rec(i, workload, msgs):
        return PromptRecord(id=f"p{i}", workload=workload, source="test", license="MIT",
                            messages=[Message(role=r, content=c) for r, c in msgs])
    rows = [rec(0, "chat", [("user", "What is the capital of France?")]),
            rec(1, "code", [("system", "You are terse."), ("user", "Write a sort function.")]),
            rec(2, "multi_turn", [("user", "Hi there."), ("user", "Now explain step by step.")])]
    path = tmp_path_factory.mktemp("spec_prompts") / "prompts.jsonl"
    write_jsonl_atomic(path, rows)
    return path


def _run(capsys, argv):
    code = cli.main(argv)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_cli_lossless(tiny_target_dir, random_head_export, prompts, tmp_path, capsys):
    code, s = _run(capsys, ["eval", "--target", str(tiny_target_dir), "--draft", str(random_head_export),
                            "--prompts", str(prompts), "--max-new-tokens", "8", "--verify-lossless",
                            "--spec", "tree", "--out", str(tmp_path / "r.json")])
    assert code == 0 and s["ok"]
    assert s["lossless_mismatches"] == 0 and s["prompts"] == 3
    assert set(s["workloads"]) == {"chat", "code", "multi_turn"}
    assert s["acceptance_length"] >= 1.0 and s["tokens_per_s"] > 0 and s["baseline_tokens_per_s"] > 0
    assert s["spec"]["eagle_topk"] == 4
    full = json.loads((tmp_path / "r.json").read_text())
    assert len(full["per_prompt"]) == 3 and all(r["lossless"] for r in full["per_prompt"])


def test_eval_cli_baseline_and_limit(tiny_target_dir, prompts, capsys):
    code, s = _run(capsys, ["eval", "--target", str(tiny_target_dir), "--prompts", str(prompts),
                            "--max-new-tokens", "4", "--limit", "1"])
    assert code == 0 and s["prompts"] == 1 and s["acceptance_length"] == 1.0
    assert s["lossless_mismatches"] is None and s["spec"]["num_draft_tokens"] == 1


def test_eval_cli_user_errors(tiny_target_dir, prompts, tmp_path, capsys):
    code, s = _run(capsys, ["eval", "--target", str(tiny_target_dir), "--prompts", str(tmp_path / "nope.jsonl")])
    assert code == 2 and not s["ok"] and "not found" in s["error"]
    code, s = _run(capsys, ["eval", "--target", str(tiny_target_dir), "--draft", str(tmp_path / "nodraft"),
                            "--prompts", str(prompts)])
    assert code == 2 and not s["ok"]


def test_first_turn_only():
    from eagle3_platform.spec.eval import first_turn

    rec = PromptRecord(id="x", workload="multi_turn", source="t", license="MIT",
                       messages=[Message(role="system", content="s"), Message(role="user", content="a"),
                                 Message(role="user", content="b")])
    assert first_turn(rec) == [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]
