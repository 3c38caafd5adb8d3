"""The decode benchmarks (`scripts/bench_decode.py`, `scripts/bench_batch.py`, `scripts/bench_serve.py`) run
end to end on the tiny target with a random exported head: every method named by the flags gets a row,
and in fp32 every speculative row emits exactly plain greedy decoding's tokens (the scripts' own
agreement figures). `scripts/bench_regen.py` compares like with like: both paths answer every prompt."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eagle3_platform.store.records import Message, PromptRecord, write_jsonl_atomic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_batch  # noqa: E402
import bench_decode  # noqa: E402
import bench_regen  # noqa: E402
import bench_serve  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_decode_rows_and_fp32_agreement(tiny_target_dir, random_head_export, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl_atomic(prompts, [
        PromptRecord(id=f"p{i}", workload="chat", source="test", license="MIT",
                     messages=[Message(role="user", content=text)])
        for i, text in enumerate(["Name three colours.", "Count from one to five, please."])])
    out = tmp_path / "bd.json"
    assert bench_decode.main([
        "--target", str(tiny_target_dir), "--draft", str(random_head_export), "--prompts", str(prompts),
        "--max-new-tokens", "12", "--repeats", "1", "--dtype", "float32", "--spec", "chain",
        "--lookup-tokens", "4", "--draft-threads", "1", "2", "--oracle", "--oracle-steps", "4", "2", "--policy",
        "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    figures = result["figures"]
    spec_rows = {"eagle3_chain", "eagle3_chain_dt2", "eagle3_chain_lookup4", "eagle3_chain_lookup4_dt2",
                 "lookup4_plain", "oracle_chain", "oracle_chain2", "eagle3_chain_lookup4_policy"}
    assert spec_rows | {"hf_greedy", "engine_baseline"} <= set(figures)
    assert result["config"]["dtype"] == "float32" and result["config"]["n_prompts"] == 2
    for name in spec_rows:
        f = figures[name]
        assert f["tok_s_median"] > 0 and f["tau"] >= 1.0, name
        assert f["token_agreement"] == 1.0, name  # fp32: greedy speculation is exact
    assert figures["oracle_chain"]["tau"] > figures["eagle3_chain"]["tau"]  # a random head rarely hits
    # the oracle proposes what the engine emits: every step takes its whole chain but near the end
    assert figures["oracle_chain"]["tau"] > figures["oracle_chain2"]["tau"] > 2.0
    with pytest.raises(SystemExit):  # refused before any model is loaded
        bench_decode.main(["--target", str(tiny_target_dir), "--oracle", "--oracle-steps", "4", "0"])


def test_bench_regen_answers_every_prompt_on_both_paths_despite_a_preset_time_budget(
        tiny_target_dir, tmp_path, monkeypatch):
    """A preset's time budget would end the slower path's run early (the demo's 45 s cut the reference
    path's on a box without bf16, so its rate was over less work): the bench lifts it, and both paths
    answer the same prompts in full."""
    from dataclasses import replace

    from eagle3_platform.data.regenerate import PRESETS

    monkeypatch.setitem(bench_regen.PRESETS, "tiny", replace(PRESETS["tiny"], time_budget_s=1e-6))
    out = tmp_path / "br.json"
    bench_regen.main(["--target", str(tiny_target_dir), "--prompts", "6", "--preset", "tiny",
                      "--max-new-tokens", "6", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    written, rejected = result["written"], result["rejected"]
    assert written["tiny_path"] == written["turn1_demo_path"] > 0  # the same prompts answered on both paths
    assert rejected["tiny_path"] == rejected["turn1_demo_path"]  # e.g. too long for the tiny target
    assert not any("budget" in reason for r in rejected.values() for reason in r)  # none left unasked
    assert all(n > 0 for n in result["new_tokens"].values())
    assert all(r > 0 for r in result["tok_per_s_median"].values())


def test_bench_batch_rows_and_fp32_invariance(tiny_target_dir, random_head_export, tmp_path):
    out = tmp_path / "bb.json"
    assert bench_batch.main([
        "--target", str(tiny_target_dir), "--draft", str(random_head_export), "--batch-sizes", "1,3",
        "--prompts", "3", "--max-new", "8", "--repeats", "1", "--fixed", "2", "--dtype", "float32",
        "--draft-threads", "2", "--invariance", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["batch"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(b, m) for b in (1, 3) for m in ("hf_generate", "baseline", "eagle3", "eagle3_k2")}
    assert all(r["tok_s"] > 0 for r in rows.values())
    assert rows[(3, "eagle3_k2")]["mean_draft_size"] == 2 and rows[(3, "eagle3_k2")]["tau"] >= 1.0
    for name in ("baseline", "eagle3"):  # fp32: a request's tokens do not depend on its batch
        assert result["invariance"][name] == {"batch": 3, "requests_differing": 0.0, "token_agreement": 1.0}


def test_bench_serve_rows_and_fp32_outputs_match_the_baseline(tiny_target_dir, random_head_export, tmp_path):
    """Rotated rounds through the server's worker: a row per level and method, and in fp32 every
    request's greedy output is the baseline's, whatever shared its batch (continuous batching)."""
    out = tmp_path / "bs.json"
    assert bench_serve.main([
        "--target", str(tiny_target_dir), "--draft", str(random_head_export), "--n-prompts", "3",
        "--concurrency", "1,3", "--rounds", "2", "--max-tokens", "8", "--dtype", "float32",
        "--spec", "chain", "--fixed", "0,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["concurrency"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(c, m) for c in (1, 3) for m in ("baseline", "eagle3", "eagle3_k0", "eagle3_k2")}
    assert all(r["tok_s"] > 0 and r["outputs_differing_from_baseline"] == 0 for r in rows.values())
    assert rows[(3, "eagle3")]["requests"] == 12 and rows[(1, "baseline")]["vs_baseline"] == 1.0
    assert sum(rows[(1, "eagle3")]["draft_size_hist"].values()) > 0  # the policy chose every step
