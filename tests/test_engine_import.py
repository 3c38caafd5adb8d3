"""Engine capture import (features/engine_import.py): files in vLLM's extract_hidden_states format,
written here by a stand-in for the engine (the tiny target's own transformers forward), become the
shards extract.py writes for the same records; bad files and mismatched records are counted."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_platform.features import engine_import
from eagle3_platform.features.engine_import import SPEC_CONFIG, engine_layer_ids, import_engine_dir
from eagle3_platform.features.extract import PRESETS, extract_file
from eagle3_platform.features.shards import (ShardDataset, normalise_header, read_header, read_manifest,
                                             shard_name, verify_shards)
from eagle3_platform.store.records import ConversationRecord, read_jsonl, write_jsonl_atomic
from tests.test_features import _conversations

TINY = replace(PRESETS["tiny"], max_length=24)  # some conversations are longer: truncated on import too


@pytest.fixture(scope="module")
def engine_model(tiny_target_dir):
    """The model the stand-in engine runs: plain transformers, fp32 (the extraction preset's dtype)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def engine_standin(model, ids: list[int], path: Path, boundaries: list[int], dtype=torch.float32,
                   metadata: dict | None = None) -> Path:
    """Stand-in for vLLM's ExampleHiddenStatesConnector: one request's file, hidden_states [T,K,H] at
    the boundaries asked for (b = the residual stream after b layers, before the final norm), token_ids
    int64 [T]. transformers' hidden_states[b] is that for b < L; its last entry is post-norm, so the
    last layer's own output is taken with a hook, as the engine holds it."""
    layers = model.model.layers
    seen = {}
    hook = layers[-1].register_forward_hook(lambda _m, _a, out: seen.update(last=out[0] if isinstance(out, tuple) else out))
    try:
        out = model.to(dtype).model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
        model.to(torch.float32)
    states = [seen["last"] if b == len(layers) else out.hidden_states[b] for b in boundaries]  # K x [1,T,H]
    save_file({"hidden_states": torch.stack(states, dim=2)[0].contiguous(),  # [T,K,H]
               "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(path), metadata=metadata)
    return path


def _records(target, n: int) -> list[ConversationRecord]:
    return _conversations(target, n, seed=1)


def _captured(tmp_path: Path, target, model, n: int, **standin) -> tuple[list, Path, Path]:
    """n records in conv.jsonl and the stand-in engine's file for each in a capture dir."""
    recs = _records(target, n)
    conv = tmp_path / "conv.jsonl"
    write_jsonl_atomic(conv, recs)
    eng = _capture_dir(tmp_path, target.meta)
    for r in recs:
        engine_standin(model, r.input_ids, eng / f"{r.id}.safetensors", engine_layer_ids(target.meta), **standin)
    return recs, conv, eng


def _capture_dir(tmp_path: Path, meta: dict, spec_config: bool = True) -> Path:
    d = tmp_path / "engine"
    d.mkdir()
    if spec_config:  # what `vllm serve --speculative-config` was given
        (d / SPEC_CONFIG).write_text(engine_import.spec_config_json(meta))
    return d


def test_imported_shards_equal_extracted_ones(tiny_target, tiny_target_dir, engine_model, tmp_path):
    recs = _records(tiny_target, 9)
    conv = tmp_path / "conv.jsonl"
    write_jsonl_atomic(conv, recs)
    meta, eng = tiny_target.meta, _capture_dir(tmp_path, tiny_target.meta)
    bounds = engine_layer_ids(meta)
    assert bounds == [i + 1 for i in meta["capture_layer_ids"]] + [meta["num_hidden_layers"]]
    long = [r for r in recs if len(r.input_ids) > TINY.max_length]
    assert long, "some records must be longer than max_length"
    for i, r in enumerate(recs):  # named by record id or by request index; whole or already truncated
        ids = r.input_ids[:TINY.max_length] if i % 3 == 2 else r.input_ids
        engine_standin(engine_model, ids, eng / (f"{r.id}.safetensors" if i % 2 else f"hs_{i}.safetensors"), bounds)
    got = import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "imported", TINY)
    ref = extract_file(tiny_target_dir, conv, tmp_path / "extracted", TINY, target=tiny_target)
    assert got["read"] == got["samples"] == 9 and got["rejected"] == 0 and got["truncated"] == ref["truncated"] == len(long)
    assert got["engine"]["matched"] == 9 and got["engine"]["unmatched_files"] == 0 and got["engine"]["files"] == 9
    assert got["shards"] == ref["shards"] == 3
    for k in range(3):
        assert normalise_header(read_header(tmp_path / "imported" / shard_name(k))) == \
            normalise_header(read_header(tmp_path / "extracted" / shard_name(k)))
    assert verify_shards(tmp_path / "imported")["bad"] == []
    a, b = ShardDataset(tmp_path / "imported"), ShardDataset(tmp_path / "extracted")
    assert len(a) == len(b) == 9
    for i in range(9):
        x, y = a[i], b[i]
        assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in ("aux_hidden", "last_hidden"):  # both stored bf16 from fp32 states: within bf16 rounding
            assert x[key].dtype == torch.bfloat16 and x[key].shape == y[key].shape
            torch.testing.assert_close(x[key].float(), y[key].float(), rtol=1e-2, atol=1e-3)


def test_bf16_capture_matches_the_bf16_forward(tiny_target, tiny_target_dir, engine_model, tmp_path):
    """Captured bf16 states are stored as they are; the post-norm state recomputed with the target's
    final norm (over [T,H], the forward's over [1,T,H]) is what the bf16 forward hands its lm_head, within
    one bf16 rounding."""
    recs, conv, eng = _captured(tmp_path, tiny_target, engine_model, 2, dtype=torch.bfloat16)
    s = import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "out", replace(TINY, max_length=512))
    assert s["samples"] == 2 and s["header"]["compute_dtype"] == "bfloat16"
    ds = ShardDataset(tmp_path / "out")
    bf16 = engine_model.to(torch.bfloat16)
    try:
        for i, r in enumerate(recs):
            with torch.inference_mode():
                out = bf16.model(input_ids=torch.tensor([r.input_ids]), output_hidden_states=True)
            want_aux = torch.cat([out.hidden_states[l + 1][0] for l in tiny_target.meta["capture_layer_ids"]], -1)
            torch.testing.assert_close(ds[i]["aux_hidden"], want_aux, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(ds[i]["last_hidden"], out.last_hidden_state[0], rtol=1e-2, atol=1e-2)
    finally:
        engine_model.to(torch.float32)


def test_bad_files_and_mismatched_records_are_counted(tiny_target, tiny_target_dir, engine_model, tmp_path):
    recs = _records(tiny_target, 8)
    conv = tmp_path / "conv.jsonl"
    write_jsonl_atomic(conv, recs)
    meta, eng = tiny_target.meta, _capture_dir(tmp_path, tiny_target.meta)
    bounds, name = engine_layer_ids(meta), lambda i: eng / f"{recs[i].id}.safetensors"
    engine_standin(engine_model, recs[1].input_ids, name(0), bounds)  # another record's tokens
    h = engine_standin(engine_model, recs[1].input_ids, tmp_path / "h.safetensors", bounds)
    from safetensors.torch import load_file
    t = load_file(str(h))
    save_file({"hidden_states": t["hidden_states"][..., :32].contiguous(), "token_ids": t["token_ids"]}, str(name(1)))
    engine_standin(engine_model, recs[2].input_ids, name(2), bounds,
                   metadata={"eagle_aux_hidden_state_layer_ids": json.dumps([1, 2, 3, 8])})  # wrong layers
    full = engine_standin(engine_model, recs[3].input_ids, name(3), bounds).read_bytes()
    name(3).write_bytes(full[:len(full) // 2])  # truncated mid-write
    engine_standin(engine_model, recs[5].input_ids, name(5), bounds[:3])  # no final layer
    engine_standin(engine_model, recs[6].input_ids, name(6), bounds)
    engine_standin(engine_model, recs[7].input_ids, eng / "hs_7.safetensors", bounds)  # found by its tokens
    engine_standin(engine_model, [5, 6, 7, 8], eng / "hs_99.safetensors", bounds)  # no such record
    (eng / "hs_98.safetensors").write_bytes(b"\x00" * 40)  # garbage, named after no record
    s = import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "out", TINY)  # record 4 has no file
    assert s["by_reason"] == {"engine:token_ids": 1, "engine:hidden_size": 1, "engine:layer_ids": 1,
                              "engine:unreadable": 1, "engine:no_file": 1, "engine:layer_count": 1}
    assert s["read"] == 8 and s["samples"] == 2 and s["rejected"] == 6
    assert s["engine"]["files"] == 9 and s["engine"]["matched"] == 2 and s["engine"]["unmatched_files"] == 2
    assert s["engine"]["bad_by_reason"] == {"engine:hidden_size": 1, "engine:layer_ids": 1,
                                            "engine:unreadable": 2, "engine:layer_count": 1}
    rejected = {r["id"]: r["reason"] for r in read_jsonl(tmp_path / "out" / "rejected.jsonl")}
    assert rejected[recs[0].id] == "engine:token_ids" and rejected[recs[4].id] == "engine:no_file"
    assert [ShardDataset(tmp_path / "out")[i]["id"] for i in range(2)] == [recs[6].id, recs[7].id]


def test_directory_refusals_name_the_fix(tiny_target, tiny_target_dir, engine_model, tmp_path):
    recs = _records(tiny_target, 1)
    conv = tmp_path / "conv.jsonl"
    write_jsonl_atomic(conv, recs)
    meta = tiny_target.meta
    eng = _capture_dir(tmp_path, meta, spec_config=False)
    engine_standin(engine_model, recs[0].input_ids, eng / "a.safetensors", engine_layer_ids(meta))
    with pytest.raises(ValueError, match=SPEC_CONFIG):  # nothing says which layers the file holds
        import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "o1", TINY)
    (eng / SPEC_CONFIG).write_text(json.dumps({"method": "extract_hidden_states", "draft_model_config": {
        "hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6, 8]}}}))  # speculators' default: another depth
    with pytest.raises(ValueError, match=r"needs \[2, 4, 5, 8\]"):
        import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "o2", TINY)
    (eng / SPEC_CONFIG).write_text(engine_import.spec_config_json(meta))
    (eng / "req.ckpt").write_bytes(b"\x80\x04not loaded")  # SpecForge's format: a torch pickle
    with pytest.raises(ValueError, match="pickle"):
        import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "o3", TINY)
    (eng / "req.ckpt").unlink()
    engine_standin(engine_model, recs[0].input_ids[:5], eng / "a.safetensors", engine_layer_ids(meta))
    with pytest.raises(ValueError, match="engine:token_ids|engine:no_file"):  # all records rejected
        import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "o4", TINY)


def test_resume_after_a_crash_keeps_finished_shards(tiny_target, tiny_target_dir, engine_model, tmp_path,
                                                      monkeypatch):
    recs, conv, eng = _captured(tmp_path, tiny_target, engine_model, 10)
    clean = import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "clean", TINY)
    assert clean["shards"] == 3
    real, calls = engine_import.read_features, []

    def crash_on_second(chunk, norm, dtype):
        calls.append(len(chunk))
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(chunk, norm, dtype)

    monkeypatch.setattr(engine_import, "read_features", crash_on_second)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated crash"):
        import_engine_dir(tiny_target_dir, eng, conv, out, TINY)
    assert read_manifest(out)["shard"].to_list() == [shard_name(0)]  # only the finished shard is listed
    first = (out / shard_name(0)).stat().st_mtime_ns
    monkeypatch.setattr(engine_import, "read_features", real)
    again = import_engine_dir(tiny_target_dir, eng, conv, out, TINY)
    assert again["shards_skipped"] == 1 and again["shards_written"] == 2
    assert (out / shard_name(0)).stat().st_mtime_ns == first
    for k in range(3):
        assert (out / shard_name(k)).read_bytes() == (tmp_path / "clean" / shard_name(k)).read_bytes()
    assert (out / "manifest.parquet").read_bytes() == (tmp_path / "clean" / "manifest.parquet").read_bytes()


def test_cli_extract_from_engine(tiny_target, tiny_target_dir, engine_model, tmp_path, capsys):
    from eagle3_platform.cli import main

    recs, conv, eng = _captured(tmp_path, tiny_target, engine_model, 3)
    rc = main(["extract", "--target", str(tiny_target_dir), "--in", str(conv), "--out", str(tmp_path / "out"),
               "--preset", "tiny", "--from-engine", str(eng)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["ok"] and summary["samples"] == 3 and summary["engine"]["matched"] == 3
    rc = main(["extract", "--target", str(tiny_target_dir), "--in", str(conv), "--out", str(tmp_path / "o2"),
               "--preset", "tiny", "--from-engine", str(tmp_path / "nowhere")])
    assert rc == 2 and "not a local directory" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]


def test_feature_shards_asset_imports_from_the_engine_dir(tiny_target, tiny_target_dir, engine_model, tmp_path,
                                                          monkeypatch):
    """Dagster: EAGLE3_EXTRACT_FROM_ENGINE reaches the target resource, and feature_shards imports every
    partition's records from that one capture directory (files of other splits match no record there)."""
    from dagster import DagsterInstance

    from assets.partitions import SPLITS, Keys
    from dagster_helpers import meta, run, tiny_resources
    from resources import StorageResource, TargetResource, build_resources

    eng = _capture_dir(tmp_path, tiny_target.meta)
    monkeypatch.setenv("EAGLE3_EXTRACT_FROM_ENGINE", str(eng))
    assert build_resources(env="local", target=str(tiny_target_dir))["target"].engine_dir == str(eng)
    storage = StorageResource(root=str(tmp_path / "data"))
    recs = _records(tiny_target, 5)
    for split, part in zip(SPLITS, (recs[:3], recs[3:])):
        write_jsonl_atomic(storage.local_path(Keys.conversations("chat", split)), part)
    for r in recs:
        engine_standin(engine_model, r.input_ids, eng / f"{r.id}.safetensors", engine_layer_ids(tiny_target.meta))
    resources = tiny_resources(storage, tiny_target_dir)
    resources["target"] = TargetResource(model=str(tiny_target_dir), prepared_dir=str(tiny_target_dir),
                                         engine_dir=str(eng))
    with DagsterInstance.ephemeral() as instance:
        result = run(["feature_shards"], resources, instance, partition="chat")
    m = meta(result, "feature_shards")
    assert m["samples"] == 3 and m["eval_samples"] == 2 and m["rejected"] == m["eval_rejected"] == 0
    assert (m["engine"]["matched"], m["engine"]["unmatched_files"]) == (3, 2)
    assert (m["eval_engine"]["matched"], m["eval_engine"]["unmatched_files"]) == (2, 3)


def test_non_finite_states_stop_the_import_naming_the_file(tiny_target, tiny_target_dir, engine_model, tmp_path):
    """A NaN in a capture is not silently trained on: the import stops naming the file, the shards
    before it stay written and listed, and removing the file turns its record into a rejection."""
    from safetensors.torch import load_file

    recs, conv, eng = _captured(tmp_path, tiny_target, engine_model, 6)
    bad = eng / f"{recs[5].id}.safetensors"
    t = load_file(str(bad))
    t["hidden_states"][0, 1, 0] = float("nan")
    save_file(t, str(bad))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=f"{recs[5].id}.safetensors: non-finite"):
        import_engine_dir(tiny_target_dir, eng, conv, out, TINY)
    assert read_manifest(out)["shard"].to_list() == [shard_name(0)]
    bad.unlink()
    s = import_engine_dir(tiny_target_dir, eng, conv, out, TINY)
    assert s["samples"] == 5 and s["by_reason"] == {"engine:no_file": 1} and s["shards_skipped"] == 1


def test_a_file_vllm_is_still_writing_is_refused(tiny_target, tiny_target_dir, engine_model, tmp_path):
    """vLLM holds an exclusive flock on <file>.lock while it writes <file>: such a file is not read."""
    import fcntl

    recs, conv, eng = _captured(tmp_path, tiny_target, engine_model, 2)
    (eng / f"{recs[1].id}.safetensors.lock").write_text("")
    (eng / f"{recs[0].id}.safetensors.lock").write_text("")  # released: the write finished
    with open(eng / f"{recs[1].id}.safetensors.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        s = import_engine_dir(tiny_target_dir, eng, conv, tmp_path / "out", TINY)
    assert s["samples"] == 1 and s["by_reason"] == {"engine:being_written": 1}
