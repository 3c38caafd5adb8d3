"""Sharded extraction (a `device_map` split, accelerate's dispatch hooks) writes the shards that a
single-device extraction writes, within fp32 tolerance, under the same header and record checks."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from eagle3_platform.features.extract import PRESETS, FeatureConfig, extract_file, parse_device_map
from eagle3_platform.features.shards import read_header, verify_shards
from eagle3_platform.model.target import load_target
from eagle3_platform.store.records import ConversationRecord, write_jsonl_atomic

SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu",
         **{f"model.layers.{i}": "cpu" for i in range(3)},
         **{f"model.layers.{i}": "disk" for i in range(3, 8)},
         "model.norm": "disk", "lm_head": "cpu"}


def _records(target, n: int) -> list[ConversationRecord]:
    from eagle3_platform.data.chat import render, template_hash

    words = "the quick brown fox jumps over lazy dog what is x answer four step by step".split()
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": " ".join(words[(i + j) % len(words)] for j in range(3 + i))},
                {"role": "assistant", "content": " ".join(words[(2 * i + j) % len(words)] for j in range(4 + i))}]
        ids, mask = render(target.tokenizer, msgs)
        out.append(ConversationRecord(id=f"c{i}", workload="chat", source="test", license="none", messages=msgs,
                                      input_ids=ids, loss_mask=mask, template_hash=template_hash(target.tokenizer),
                                      target_id=target.meta["target_id"]))
    return out


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_sharded_extraction_equals_single_device(tiny_target, tiny_target_dir, tmp_path):
    conv = tmp_path / "conv.jsonl"
    write_jsonl_atomic(conv, _records(tiny_target, 5))
    cfg = replace(PRESETS["tiny"], samples_per_shard=3, dtype="float32")
    single = extract_file(tiny_target_dir, conv, tmp_path / "single", cfg)
    sharded_cfg = replace(cfg, device_map=json.dumps(SPLIT), offload_folder=str(tmp_path / "offload"))
    sharded = extract_file(tiny_target_dir, conv, tmp_path / "sharded", sharded_cfg)
    assert set(sharded["device_map"].values()) == {"cpu", "disk"}  # the split really took place
    assert sharded["header"] == single["header"] and sharded["shards"] == single["shards"] == 2
    assert verify_shards(tmp_path / "sharded")["bad"] == []
    for k in range(2):
        name = f"shard-{k:05d}.safetensors"
        a, b = _tensors(tmp_path / "single" / name), _tensors(tmp_path / "sharded" / name)
        assert read_header(tmp_path / "single" / name) == read_header(tmp_path / "sharded" / name)
        assert a.keys() == b.keys()
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(a[key], b[key])
        for key in ("aux_hidden", "last_hidden"):
            assert a[key].abs().max() > 0
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5)


def test_sharded_load_skips_fast_path_and_refuses_bad_settings(tiny_target_dir, tmp_path):
    t = load_target(tiny_target_dir, device_map=SPLIT, offload_folder=tmp_path / "off")
    assert t.meta["packed_linears"] == 0 and t.meta["device_map"]["model.layers.7"] == "disk"
    layers = t.model.model.layers
    # disk entries hold no weights in memory (meta tensors, read back by accelerate's hook per forward)
    assert all(p.device.type == "meta" for p in layers[5].parameters())
    assert all(p.device.type == "cpu" for p in layers[0].parameters())
    assert hasattr(layers[5], "_hf_hook")
    with pytest.raises(ValueError, match="device_map"):
        parse_device_map("everywhere")
    with pytest.raises(ValueError, match="max_memory"):
        FeatureConfig(4, 512, 0, max_memory="[1]")
    with pytest.raises(ValueError, match="batch_tokens"):
        FeatureConfig(4, 512, -2)
    assert parse_device_map("auto") == "auto" and parse_device_map("") is None


def test_cli_extract_device_map_reaches_the_loader(tiny_target, tiny_target_dir, tmp_path, capsys):
    from eagle3_platform.cli import main

    conv = tmp_path / "conv.jsonl"
    write_jsonl_atomic(conv, _records(tiny_target, 2))
    argv = ["extract", "--target", str(tiny_target_dir), "--in", str(conv), "--preset", "tiny",
            "--device-map", json.dumps(SPLIT), "--offload-folder", str(tmp_path / "off")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["samples"] == 2 and last["device_map"]["model.layers.0"] == "cpu"
    assert main([*argv, "--out", str(tmp_path / "bad"), "--max-memory", "nope"]) == 2
    assert "max_memory" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]


def test_memory_budget_from_free_gpu_memory(tiny_target, monkeypatch):
    from eagle3_platform.features import extract

    cfg = FeatureConfig(4, 512, extract.MEMORY_BUDGET)
    assert extract.batch_budget(tiny_target, cfg) == 0  # no GPU: one conversation per forward, as before
    assert extract.batch_budget(tiny_target, replace(cfg, batch_tokens=777)) == 777
    monkeypatch.setattr(extract, "_gpus", lambda model: [torch.device("cuda:0"), torch.device("cuda:1")])
    free = {"cuda:0": 8 << 30, "cuda:1": 2 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[str(d)], 80 << 30))
    H, inter = 64, 128  # the tiny target: fp32, 3 captured layers + the final state
    per_token = 4 * (8 * H + 3 * inter + 4 * H)
    assert extract.batch_budget(tiny_target, cfg) == int(0.5 * (2 << 30) / per_token)  # the fuller GPU bounds it


def test_background_writer_error_surfaces_and_manifest_lists_finished_shards(tiny_target, tiny_target_dir,
                                                                             tmp_path, monkeypatch):
    from eagle3_platform.features import extract
    from eagle3_platform.features.shards import read_manifest

    conv = tmp_path / "conv.jsonl"
    write_jsonl_atomic(conv, _records(tiny_target, 5))
    real = extract.write_shard

    def failing(path, samples, header):
        if path.name == "shard-00001.safetensors":
            raise OSError("disk full")
        return real(path, samples, header)

    monkeypatch.setattr(extract, "write_shard", failing)
    cfg = replace(PRESETS["tiny"], samples_per_shard=2)
    with pytest.raises(OSError, match="disk full"):
        extract_file(tiny_target_dir, conv, tmp_path / "out", cfg, target=tiny_target)
    assert read_manifest(tmp_path / "out")["shard"].to_list() == ["shard-00000.safetensors"]
    monkeypatch.setattr(extract, "write_shard", real)  # the rerun keeps shard 0 and writes the rest
    summary = extract_file(tiny_target_dir, conv, tmp_path / "out", cfg, target=tiny_target)
    assert (summary["shards_skipped"], summary["shards_written"], summary["samples"]) == (1, 2, 5)


def test_feature_shards_asset_extracts_through_the_device_map(tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    """Dagster: EAGLE3_EXTRACT_DEVICE_MAP reaches the target resource, and the asset's extraction loads
    the target sharded (the device map it used is in the materialization's metadata)."""
    from dagster import DagsterInstance

    from assets.partitions import SPLITS, Keys
    from dagster_helpers import meta, run, tiny_resources
    from resources import StorageResource, TargetResource, build_resources

    monkeypatch.setenv("EAGLE3_EXTRACT_DEVICE_MAP", "auto")
    # ~600 KB of the CPU holds the embeddings and two layers of the tiny target: the rest is offloaded
    monkeypatch.setenv("EAGLE3_EXTRACT_MAX_MEMORY", '{"cpu": "600KB"}')
    built = build_resources(env="local", target=str(tiny_target_dir))["target"]
    assert (built.device_map, built.max_memory) == ("auto", '{"cpu": "600KB"}')
    storage = StorageResource(root=str(tmp_path / "data"))
    for split in SPLITS:
        write_jsonl_atomic(storage.local_path(Keys.conversations("chat", split)), _records(tiny_target, 3))
    resources = tiny_resources(storage, tiny_target_dir)
    resources["target"] = TargetResource(model=str(tiny_target_dir), prepared_dir=str(tiny_target_dir),
                                         device_map=built.device_map, max_memory=built.max_memory)
    with DagsterInstance.ephemeral() as instance:
        result = run(["feature_shards"], resources, instance, partition="chat")
    m = meta(result, "feature_shards")
    assert m["samples"] == m["eval_samples"] == 3 and m["shards"] == 1
    assert "device_map" in m and "eval_device_map" in m  # extraction reported the placement it used
