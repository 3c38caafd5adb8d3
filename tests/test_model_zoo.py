"""The model zoo end to end: for every registered family a tiny random checkpoint (testing/zoo.py)
through prepare-target -> sources (chat, multi_turn) -> filter -> regenerate -> extract -> train ->
export -> `eval --verify-lossless`, all through the CLI, fp32; the head's greedy output must equal the
target's own transformers greedy decoding on every prompt."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from eagle3_platform import cli
from eagle3_platform.testing.zoo import ZOO, build_zoo_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TINY = ("--preset", "tiny")
ONE = ("--threads", 1)  # 2 cores shared by other work: OpenMP threads that spin for a core cost more than they win


def _cli(*argv) -> dict:
    """One eagle3 command in-process -> its summary (the last stdout line), asserted ok."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main([str(a) for a in argv])
    out = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert code == 0 and out.get("ok", True), out
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Single- and multi-turn prompt records (sources), shared by every family, plus two short
    multi-turn ones: ShareGPT's multi-turn records mostly run past the tiny preset's 512 tokens under
    a 400-token BPE."""
    from eagle3_platform.store.records import Message, PromptRecord, write_jsonl_atomic

    d = tmp_path_factory.mktemp("zoo_prompts")
    for workload in ("chat", "multi_turn"):
        _cli("sources", "--workload", workload, "--limit", 3, "--out", d / f"{workload}.jsonl", *TINY)
    short = [PromptRecord(id=f"short-{i}", workload="multi_turn", source="test", license="MIT",
                          messages=[Message(role="system", content="You are terse.")] * (i == 0) + [
                              Message(role="user", content=u) for u in turns])
             for i, turns in enumerate([("What is the capital of France?", "And of Italy? Explain."),
                                        ("Write a function that sorts a list.", "Now add tests.", "Why?")])]
    write_jsonl_atomic(d / "short.jsonl", short)
    (d / "prompts.jsonl").write_text("".join((d / f"{w}.jsonl").read_text() for w in ("chat", "multi_turn", "short")))
    return d / "prompts.jsonl"


@pytest.mark.parametrize("family", sorted(ZOO))
def test_family_end_to_end(family, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    src = build_zoo_model(family, tmp_path / "hf")
    d, target = tmp_path, tmp_path / "target"
    meta = _cli("prepare-target", "--model", src, "--out", target)
    assert meta["family"] == ZOO[family].family
    # the prompt-length limit (the regeneration preset's) is measured under this family's template
    _cli("filter", "--in", prompts, "--out", d / "kept.jsonl", "--rejected", d / "rej.jsonl", "--target", target,
         *TINY)
    kept = d / "kept.jsonl"
    # (no PII scan of the answers: a random model's text is what it scans, and it finds "locations")
    regen = _cli("regenerate", "--target", target, "--in", kept, "--out", d / "conv.jsonl",
                 "--dtype", "float32", "--no-scan-responses", *ONE, *TINY)
    convs = [json.loads(line) for line in (d / "conv.jsonl").read_text().splitlines()]
    assert convs, regen
    assert any(sum(m["role"] == "assistant" for m in c["messages"]) > 1 for c in convs), \
        "no multi-turn conversation came through regeneration"
    _cli("extract", "--target", target, "--in", d / "conv.jsonl", "--out", d / "feats",
         "--dtype", "float32", *ONE, *TINY)
    _cli("train", "--target", target, "--features", d / "feats", "--out", d / "draft",
         "--max-steps", 2, "--dtype", "float32", *ONE, *TINY)
    export = _cli("export", "--draft", d / "draft", "--out", d / "export", "--dtype", "float32")
    config = json.loads((d / "export" / "config.json").read_text())
    assert config["hidden_act"] == "silu" and config["target_hidden_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == meta["capture_layer_ids"]
    assert export["aux_layer_ids"] == meta["capture_layer_ids"]
    s = _cli("eval", "--target", target, "--draft", d / "export", "--prompts", kept,
             "--max-new-tokens", 24, "--verify-lossless", "--spec", "tree", *ONE)
    assert s["lossless_mismatches"] == 0 and s["prompts"] >= 2 and s["generated_tokens"] > s["prompts"]
