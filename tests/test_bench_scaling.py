"""scripts/bench_scaling.py data subsets: nested, balanced across workloads, valid shards."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from eagle3_platform.features.shards import ShardDataset, read_header
from eagle3_platform.testing.synthetic import random_features

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_scaling import sample_table, subset_counts, subset_dir  # noqa: E402

META = {"target_id": "t", "weights_hash": "w", "capture_layer_ids": [1, 2, 3]}


def _dirs(tmp_path: Path) -> list[Path]:
    return [random_features(tmp_path / name, META, vocab_size=50, hidden_size=8, n_samples=n, seq_len=20,
                            seed=i, per_shard=4)
            for i, (name, n) in enumerate([("a", 9), ("b", 3)])]


def test_subsets_are_balanced_nested_prefixes(tmp_path):
    dirs = _dirs(tmp_path)
    table = sample_table(dirs)
    assert [len(t) for t in table] == [9, 3]
    per_sample = table[0][0][2]                      # seq_len 20, 30% prompt: 14 response tokens each
    assert per_sample == int(ShardDataset(dirs[0])[0]["loss_mask"].sum())
    assert subset_counts(table, 3 * per_sample) == [2, 1]     # one sample per dir in turn
    assert subset_counts(table, 8 * per_sample) == [5, 3]     # b runs out; a continues alone
    assert subset_counts(table, 13 * per_sample) is None      # more than both hold


def test_subset_dir_copies_the_samples_with_their_headers(tmp_path):
    dirs = _dirs(tmp_path)
    table = sample_table(dirs)
    (out,), tokens, samples = subset_dir(dirs, table, 5 * table[0][0][2], tmp_path / "out", shard_samples=2)
    assert samples == 5                                       # a: 3, b: 2
    sub, a, b = ShardDataset(out), ShardDataset(dirs[0]), ShardDataset(dirs[1])
    assert len(sub) == 5 and tokens == sum(int(sub[i]["loss_mask"].sum()) for i in range(5))
    for got, want in zip([sub[i] for i in range(5)], [a[0], a[1], a[2], b[0], b[1]]):
        assert got["id"] == want["id"]
        assert torch.equal(got["aux_hidden"], want["aux_hidden"])  # a byte copy, not a recomputation
    assert read_header(sub.shard_paths[0])["weights_hash"] == "w"


def test_the_whole_set_is_not_copied(tmp_path):
    dirs = _dirs(tmp_path)
    table = sample_table(dirs)
    got, tokens, samples = subset_dir(dirs, table, 12 * table[0][0][2], tmp_path / "out")
    assert got == dirs and samples == 12 and tokens == 12 * table[0][0][2]
    assert not (tmp_path / "out").exists()


def test_teacher_forced_records_extract_and_account(tiny_target_dir, tmp_path, capsys):
    """scripts/teacher_forced_records.py: every prompt is written, excluded or counted too long; the
    records are the template's render with every token supervised, and the extractor takes them."""
    import json

    from teacher_forced_records import main

    from eagle3_platform.data.chat import render
    from eagle3_platform.features.extract import FeatureConfig, extract_file
    from eagle3_platform.store.records import Message, PromptRecord, read_jsonl, write_jsonl_atomic
    from transformers import AutoTokenizer

    prompts = [PromptRecord(id=f"p{i}", workload="chat", source="test", license="MIT",
                            messages=[Message(role="user", content=text)])
               for i, text in enumerate(["Name three colours.", "Count to five.", "word " * 300])]
    write_jsonl_atomic(tmp_path / "kept.jsonl", [p.model_dump() for p in prompts])
    write_jsonl_atomic(tmp_path / "done.jsonl", [prompts[1].model_dump()])
    out = tmp_path / "rec.jsonl"
    assert main(["--target", str(tiny_target_dir), "--in", str(tmp_path / "kept.jsonl"), "--exclude",
                 str(tmp_path / "done.jsonl"), "--out", str(out), "--max-length", "200"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (counts["read"], counts["written"], counts["excluded"], counts["too_long"]) == (3, 1, 1, 1)
    (rec,) = list(read_jsonl(out))
    ids, _ = render(AutoTokenizer.from_pretrained(tiny_target_dir), prompts[0].messages)
    assert rec["id"] == "p0" and rec["input_ids"] == ids and rec["loss_mask"] == [1] * len(ids)
    assert rec["generation"] == {"teacher_forced": True}
    summary = extract_file(tiny_target_dir, out, tmp_path / "feats", FeatureConfig(4, 512, 0, target_dtype="float32"))
    assert summary["samples"] == 1 and summary["rejected"] == 0 and summary["tokens"] == len(ids)
