"""Feature shards: format round trip, manifest, validation, lazy reading; extraction + resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_platform.features import shards as sh
from eagle3_platform.features.shards import (ShardDataset, ShardError, read_header, read_manifest,
                                             shard_name, verify_shards, write_manifest, write_shard)
from eagle3_platform.store.records import sha256_file

H = 4
META = dict(target_id="t", weights_hash="w" * 8, capture_layer_ids=[1, 2, 5], template_hash="th",
            tokenizer_hash="tk", max_length=64, dtype="bfloat16", compute_dtype="bfloat16")


def _sample(T: int, i: int, g: torch.Generator) -> dict:
    return {"id": f"rec{i}", "input_ids": torch.randint(0, 1000, (T,), generator=g).tolist(),
            "loss_mask": [0] * (T // 2) + [1] * (T - T // 2),
            "aux_hidden": torch.randn(T, 3 * H, generator=g), "last_hidden": torch.randn(T, H, generator=g)}


def _write_dir(d: Path, per_shard=((3, 5), (2,), (4, 1, 6)), meta=META) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    samples, rows, i = [], [], 0
    for k, lengths in enumerate(per_shard):
        batch = []
        for T in lengths:
            batch.append(_sample(T, i, g))
            i += 1
        rows.append(write_shard(d / shard_name(k), batch, meta))
        samples += batch
    write_manifest(d, rows)
    return samples


def test_shard_round_trip_dtypes_offsets_header(tmp_path):
    samples = _write_dir(tmp_path)
    ds = ShardDataset([tmp_path])
    assert len(ds) == len(samples) == 6
    for i, s in enumerate(samples):
        got = ds[i]
        assert got["id"] == s["id"]
        assert got["input_ids"].tolist() == s["input_ids"]
        assert got["loss_mask"].tolist() == s["loss_mask"]
        assert got["aux_hidden"].dtype == torch.bfloat16 and got["aux_hidden"].shape == (len(s["input_ids"]), 3 * H)
        assert torch.equal(got["aux_hidden"], s["aux_hidden"].bfloat16())
        assert torch.equal(got["last_hidden"], s["last_hidden"].bfloat16())
    assert ds.sample_lengths() == [3, 5, 2, 4, 1, 6]
    from safetensors.torch import load_file
    raw = load_file(tmp_path / shard_name(2))
    assert raw["input_ids"].dtype == torch.int32 and raw["loss_mask"].dtype == torch.uint8
    assert raw["offsets"].tolist() == [0, 4, 5, 11] and raw["aux_hidden"].shape == (11, 3 * H)
    header = read_header(tmp_path / shard_name(0))
    assert json.loads(header["capture_layer_ids"]) == [1, 2, 5]
    assert header["weights_hash"] == META["weights_hash"] and header["format_version"] == sh.FORMAT_VERSION
    assert json.loads(header["sample_ids"]) == ["rec0", "rec1"]
    assert ds.header["max_length"] == 64 and ds.header["template_hash"] == "th"


def test_shard_bytes_are_deterministic(tmp_path):
    _write_dir(tmp_path / "a")
    _write_dir(tmp_path / "b")
    for k in range(3):  # same content -> same bytes -> same sha256 (resume can be byte-identical)
        assert (tmp_path / "a" / shard_name(k)).read_bytes() == (tmp_path / "b" / shard_name(k)).read_bytes()


def test_manifest_rows_match_files(tmp_path):
    _write_dir(tmp_path)
    m = read_manifest(tmp_path)
    assert m["shard"].to_list() == [shard_name(k) for k in range(3)]
    assert m["samples"].to_list() == [2, 1, 3] and m["tokens"].to_list() == [8, 2, 11]
    for row in m.iter_rows(named=True):
        p = tmp_path / row["shard"]
        assert row["sha256"] == sha256_file(p) and row["bytes"] == p.stat().st_size
    assert m["ids"].to_list()[0] == ["rec0", "rec1"]
    assert not list(tmp_path.glob("*.tmp"))


def _flip_byte(path: Path, pos: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_shard_is_detected_and_named(tmp_path):
    _write_dir(tmp_path)
    _flip_byte(tmp_path / shard_name(1))  # same size, different bytes: only sha256 catches it
    with pytest.raises(ShardError, match=r"shard-00001\.safetensors.*sha256"):
        ShardDataset([tmp_path])
    report = verify_shards(tmp_path)
    assert report["ok"] == [shard_name(0), shard_name(2)]
    assert [b["shard"] for b in report["bad"]] == [shard_name(1)]
    # lazy mode: construction passes, first touch of the bad shard raises, naming it
    ds = ShardDataset([tmp_path], verify="lazy")
    ds[0]
    with pytest.raises(ShardError, match=r"shard-00001"):
        ds[2]


def test_truncated_and_missing_shard_named(tmp_path):
    _write_dir(tmp_path)
    p = tmp_path / shard_name(2)
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(ShardError, match=r"shard-00002.*corrupt"):
        ShardDataset([tmp_path])
    p.unlink()
    with pytest.raises(ShardError, match=r"shard-00002.*missing"):
        ShardDataset([tmp_path])


@pytest.mark.parametrize("key,bad", [("capture_layer_ids", [1, 2, 6]), ("weights_hash", "other"),
                                     ("template_hash", "th2"), ("dtype", "float32"),
                                     ("compute_dtype", "float32")])
def test_mismatched_header_vs_expect_is_named(tmp_path, key, bad):
    _write_dir(tmp_path)
    with pytest.raises(ShardError, match=rf"shard-00000.*{key}"):
        ShardDataset([tmp_path], expect={key: bad})
    assert len(verify_shards(tmp_path, expect={key: bad})["bad"]) == 3
    assert len(ShardDataset([tmp_path], expect={key: META[key]})) == 6


def test_dirs_with_different_targets_refused(tmp_path):
    _write_dir(tmp_path / "a")
    _write_dir(tmp_path / "b", meta={**META, "weights_hash": "x" * 8})
    with pytest.raises(ShardError, match=r"b/shard-00000.*weights_hash"):
        ShardDataset([tmp_path / "a", tmp_path / "b"])


def test_reader_is_lazy(tmp_path, monkeypatch):
    _write_dir(tmp_path)
    reads: list[tuple[str, str]] = []
    real = sh.safe_open

    class Spy:
        def __init__(self, path, framework):
            self._f, self._path = real(path, framework=framework), Path(path).name

        def metadata(self):
            return self._f.metadata()

        def get_tensor(self, name):
            reads.append((self._path, name))
            return self._f.get_tensor(name)

        def get_slice(self, name):
            reads.append((self._path, name))
            return self._f.get_slice(name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self._f.__exit__(*a)

    monkeypatch.setattr(sh, "safe_open", Spy)
    ds = ShardDataset([tmp_path])
    assert len(ds) == 6 and reads == []  # headers only; no tensor deserialised
    ds[3]  # first sample of the last shard
    assert {p for p, _ in reads} == {shard_name(2)}
    assert ("shard-00002.safetensors", "aux_hidden") in reads


def test_dataset_survives_worker_copy(tmp_path):
    import pickle  # what a spawn-started DataLoader worker does to the dataset (in memory only)

    samples = _write_dir(tmp_path)
    ds = ShardDataset([tmp_path])
    ds[0]
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._open == {} and copy[5]["input_ids"].tolist() == samples[5]["input_ids"]
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)))
    assert batch["id"] == "rec0"


def test_write_shard_validates_samples(tmp_path):
    g = torch.Generator().manual_seed(0)
    s = _sample(4, 0, g)
    with pytest.raises(ValueError, match="lengths"):
        write_shard(tmp_path / "x.safetensors", [{**s, "loss_mask": [1]}], META)
    with pytest.raises(ValueError, match="lacks"):
        write_shard(tmp_path / "x.safetensors", [s], {"target_id": "t"})
    assert not (tmp_path / "x.safetensors").exists()


# ---------------------------------------------------------------- extraction

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

from eagle3_platform.features.capture import forward_capture
from eagle3_platform.features.extract import PRESETS, extract_file, target_header
from eagle3_platform.store.records import ConversationRecord, read_jsonl, write_jsonl_atomic
from eagle3_platform.store.storage import LocalStorage

ROOT = Path(__file__).resolve().parents[1]
TINY = PRESETS["tiny"]


def _conversations(target, n: int, seed: int = 0) -> list[ConversationRecord]:
    from eagle3_platform.data.chat import render, template_hash

    words = "the quick brown fox jumps over lazy dog what is x answer four step by step".split()
    g = torch.Generator().manual_seed(seed)
    pick = lambda k: " ".join(words[int(j)] for j in torch.randint(0, len(words), (k,), generator=g))
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": pick(3 + i % 7)}, {"role": "assistant", "content": pick(4 + i % 5)}]
        ids, mask = render(target.tokenizer, msgs)
        out.append(ConversationRecord(id=f"conv{i:03d}", workload="chat", source="test", license="none",
                                      messages=msgs, input_ids=ids, loss_mask=mask,
                                      template_hash=template_hash(target.tokenizer),
                                      target_id=target.meta["target_id"]))
    return out


def _write_conv(path: Path, recs, extra_lines=()) -> Path:
    write_jsonl_atomic(path, recs)
    with open(path, "a") as f:
        for line in extra_lines:
            f.write(line + "\n")
    return path


def test_extract_features_accounting_and_values(tiny_target, tiny_target_dir, tmp_path):
    recs = _conversations(tiny_target, 9)
    bad = [recs[0].model_copy(update={"id": "wrongtpl", "template_hash": "x"}),
           recs[1].model_copy(update={"id": "wrongtgt", "target_id": "other"}),
           recs[2].model_copy(update={"id": "noresp", "loss_mask": [0] * len(recs[2].input_ids)}),
           recs[4].model_copy(update={"id": "longprompt", "loss_mask": [0] * 29 + [1]}),
           recs[5].model_copy(update={"id": "oov", "input_ids": [10_000] + recs[5].input_ids[1:]}),
           recs[6].model_copy(update={"id": "maskval", "loss_mask": [-1] + recs[6].loss_mask[1:]}),
           recs[3]]  # same id again
    conv = _write_conv(tmp_path / "conv.jsonl", recs + bad, ["{not json"])
    cfg = replace(TINY, max_length=24)  # some conversations exceed it: truncated, counted
    s = extract_file(tiny_target_dir, conv, tmp_path / "out", cfg, target=tiny_target)
    assert s["read"] == 17 and s["samples"] == 9 and s["rejected"] == 8
    assert s["read"] == s["samples"] + s["rejected"]
    assert s["by_reason"] == {"mismatch:template_hash": 1, "mismatch:target_id": 1,
                              "bad:no_response": 1, "bad:json": 1, "bad:too_long": 1,
                              "bad:token_id": 1, "bad:mask_value": 1, "dup": 1}
    n_long = sum(len(r.input_ids) > 24 for r in recs + bad[3:4])
    assert s["truncated"] == n_long > 0
    assert s["shards"] == 3 and s["shards_written"] == 3  # 4 + 4 + 1 samples
    rej = list(read_jsonl(tmp_path / "out" / "rejected.jsonl"))
    assert {r["id"] for r in rej} >= {"wrongtpl", "wrongtgt", "noresp", "longprompt"}
    header = target_header(tiny_target, cfg)
    ds = ShardDataset([tmp_path / "out"], expect=header)
    assert len(ds) == 9 and [ds[i]["id"] for i in range(9)] == [r.id for r in recs]
    for i in (0, 5, 8):
        ids = recs[i].input_ids[:24]
        ref = forward_capture(tiny_target.model, torch.tensor([ids]), tiny_target.layer_ids)
        got = ds[i]
        assert got["input_ids"].tolist() == ids and got["loss_mask"].tolist() == recs[i].loss_mask[:24]
        # extraction ran these rows in padded batches, the reference alone: other matmul shapes, so
        # compare within bf16 storage rounding (2^-8 relative) rather than bit for bit
        for key, want in (("aux_hidden", ref.aux_hidden[0]), ("last_hidden", ref.last_hidden[0])):
            assert got[key].dtype == torch.bfloat16
            torch.testing.assert_close(got[key].float(), want.float(), rtol=1e-2, atol=1e-3)
    assert s["bytes_per_token"] > s["budget_bytes_per_token"] == 8 * 64


def test_padded_batches_match_one_at_a_time(tiny_target, tiny_target_dir, tmp_path):
    conv = _write_conv(tmp_path / "conv.jsonl", _conversations(tiny_target, 6))
    extract_file(tiny_target_dir, conv, tmp_path / "a", TINY, target=tiny_target)
    extract_file(tiny_target_dir, conv, tmp_path / "b", replace(TINY, batch_tokens=512), target=tiny_target)
    a, b = ShardDataset([tmp_path / "a"]), ShardDataset([tmp_path / "b"])
    for i in range(len(a)):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
        torch.testing.assert_close(a[i]["aux_hidden"].float(), b[i]["aux_hidden"].float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("speedup,want", [(0.55, "float32"), (2.0, "bfloat16")])
def test_auto_extraction_runs_the_target_in_the_dtype_dense_work_pays_for(tiny_target, tiny_target_dir,
                                                                           tmp_path, monkeypatch,
                                                                           speedup, want):
    from eagle3_platform.model import compute

    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setattr(compute, "dense_bf16_speedup", lambda: speedup)
    conv = _write_conv(tmp_path / "conv.jsonl", _conversations(tiny_target, 3))
    # on the CPU: a GPU machine would pick CUDA, where auto is bf16 whatever the CPU's flags
    s = extract_file(tiny_target_dir, conv, tmp_path / "out", replace(TINY, target_dtype="auto", device="cpu"))
    assert s["samples"] == 3
    assert read_header(tmp_path / "out" / shard_name(0))["compute_dtype"] == want


def _mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.glob("shard-*.safetensors"))}


def test_rerun_skips_verified_shards_and_recomputes_corrupt(tiny_target, tiny_target_dir, tmp_path):
    conv = _write_conv(tmp_path / "conv.jsonl", _conversations(tiny_target, 10))
    out = tmp_path / "out"
    first = extract_file(tiny_target_dir, conv, out, TINY, target=tiny_target)
    before, shas = _mtimes(out), read_manifest(out)["sha256"].to_list()
    again = extract_file(tiny_target_dir, conv, out, TINY, target=tiny_target)
    assert again["shards_written"] == 0 and again["shards_skipped"] == first["shards"] == 3
    assert _mtimes(out) == before
    _flip_byte(out / shard_name(1))
    third = extract_file(tiny_target_dir, conv, out, TINY, target=tiny_target)
    assert third["shards_written"] == 1 and third["shards_skipped"] == 2
    assert read_manifest(out)["sha256"].to_list() == shas  # recomputed bit-identically
    assert verify_shards(out)["bad"] == []
    (out / shard_name(2)).unlink()
    assert extract_file(tiny_target_dir, conv, out, TINY, target=tiny_target)["shards_written"] == 1


def test_a_rerun_removes_the_temp_file_a_killed_writer_left(tiny_target, tiny_target_dir, tmp_path):
    """A run killed between filling a shard's temp file and renaming it leaves NAME.PID.tmp behind
    (a CI run of the SIGKILL test above caught one); the next run into the dir removes it. A live
    writer's temp file and any other *.tmp are left alone."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # exited: no process has that id now (barring reuse within ms)
    conv = _write_conv(tmp_path / "conv.jsonl", _conversations(tiny_target, 4))
    out = tmp_path / "out"
    out.mkdir()
    stale, live = f"{shard_name(1)}.{dead_pid}.tmp", f"elsewhere.parquet.{os.getpid()}.tmp"
    for name in (stale, live, "notes.tmp"):
        (out / name).write_bytes(b"half a shard")
    extract_file(tiny_target_dir, conv, out, TINY, target=tiny_target)
    assert sorted(p.name for p in out.glob("*.tmp")) == sorted([live, "notes.tmp"])
    assert verify_shards(out)["bad"] == []


def test_a_record_rewritten_under_its_id_gets_new_features(tiny_target, tiny_target_dir, tmp_path):
    """Conversations regenerated under the same ids (a redacted prompt, another answer): a rerun into
    the same dir must recompute the shards whose records' tokens changed, not keep the old ones."""
    recs = _conversations(tiny_target, 10)
    out = tmp_path / "out"
    extract_file(tiny_target_dir, _write_conv(tmp_path / "conv.jsonl", recs), out, TINY, target=tiny_target)
    other = _conversations(tiny_target, 11)[10]  # another conversation's tokens under record 5's id
    recs[5] = recs[5].model_copy(update={"input_ids": other.input_ids, "loss_mask": other.loss_mask})
    again = extract_file(tiny_target_dir, _write_conv(tmp_path / "conv2.jsonl", recs), out, TINY,
                         target=tiny_target)
    assert again["shards_written"] == 1 and again["shards_skipped"] == 2  # record 5 is in shard 1
    ds = ShardDataset([out], expect=target_header(tiny_target, TINY))
    assert ds[5]["input_ids"].tolist() == other.input_ids


def test_storage_mirror_and_resume_from_storage(tiny_target, tiny_target_dir, tmp_path):
    conv = _write_conv(tmp_path / "conv.jsonl", _conversations(tiny_target, 7))
    store = LocalStorage(tmp_path / "bucket")
    s = extract_file(tiny_target_dir, conv, tmp_path / "scratch1", TINY, storage=store,
                     prefix="features/chat", target=tiny_target)
    keys = store.list("features/chat")
    assert "features/chat/manifest.parquet" in keys and "features/chat/shard-00001.safetensors" in keys
    assert s["manifest"] == store.uri("features/chat/manifest.parquet")
    ds = ShardDataset.from_storage(store, "features/chat", tmp_path / "cache",
                                   expect=target_header(tiny_target, TINY))
    assert len(ds) == 7 and ds[6]["id"] == "conv006"
    # a fresh scratch dir: what is stored is downloaded, verified and kept, nothing recomputed
    again = extract_file(tiny_target_dir, conv, tmp_path / "scratch2", TINY, storage=store,
                         prefix="features/chat", target=tiny_target)
    assert again["shards_written"] == 0 and again["shards_skipped"] == 2
    _flip_byte(store.path("features/chat/shard-00000.safetensors"))
    third = extract_file(tiny_target_dir, conv, tmp_path / "scratch3", TINY, storage=store,
                         prefix="features/chat", target=tiny_target)
    assert third["shards_written"] == 1
    with pytest.raises(ShardError, match="shard-00000"):  # the stale cached copy is never trusted
        _flip_byte(tmp_path / "cache" / shard_name(0))
        ShardDataset([tmp_path / "cache"])
    assert len(ShardDataset.from_storage(store, "features/chat", tmp_path / "cache")) == 7


def _extract_cmd(target_dir, conv, out) -> list[str]:
    return [sys.executable, "-m", "eagle3_platform.cli", "extract", "--target", str(target_dir),
            "--in", str(conv), "--out", str(out), "--preset", "tiny", "--samples-per-shard", "1"]


def _env() -> dict:
    # same thread count in every run so the kernels (and thus the bytes) are reproducible
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


@pytest.mark.integration
def test_resume_after_sigkill_matches_uninterrupted_run(tiny_target, tiny_target_dir, tmp_path):
    n = 24
    conv = _write_conv(tmp_path / "conv.jsonl", _conversations(tiny_target, n))
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_extract_cmd(tiny_target_dir, conv, killed), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / MANIFEST_NAME).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "extraction finished before it could be killed"
    listed = read_manifest(killed)["shard"].to_list()
    assert 1 <= len(listed) < n
    done_before = {k: v for k, v in _mtimes(killed).items() if k in listed}

    resumed = subprocess.run(_extract_cmd(tiny_target_dir, conv, killed), env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["shards"] == n and summary["shards_skipped"] >= len(listed)
    assert summary["shards_written"] == n - summary["shards_skipped"]
    after = _mtimes(killed)
    assert all(after[k] == v for k, v in done_before.items())  # finished shards not recomputed

    clean = tmp_path / "clean"
    subprocess.run(_extract_cmd(tiny_target_dir, conv, clean), env=_env(), check=True,
                   capture_output=True, timeout=300)
    a, b = read_manifest(killed), read_manifest(clean)
    assert a.equals(b)  # same shards, same sha256, same sizes, same ids
    assert (killed / MANIFEST_NAME).read_bytes() == (clean / MANIFEST_NAME).read_bytes()
    for name in a["shard"]:
        assert (killed / name).read_bytes() == (clean / name).read_bytes()
    assert not list(killed.glob("*.tmp"))


MANIFEST_NAME = sh.MANIFEST


def test_cli_verify_features_names_bad_shard(tmp_path, capsys):
    from eagle3_platform.cli import main

    _write_dir(tmp_path)
    assert main(["verify-features", "--dir", str(tmp_path)]) == 0
    _flip_byte(tmp_path / shard_name(2))
    assert main(["verify-features", "--dir", str(tmp_path)]) == 2
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] is False and "shard-00002.safetensors" in last["error"]


@pytest.mark.e2e
def test_extract_smollm2_bytes_per_token(smollm2_dir, tmp_path):
    from eagle3_platform.model.target import load_target

    target = load_target(smollm2_dir)
    conv = _write_conv(tmp_path / "conv.jsonl", _conversations(target, 3))
    s = extract_file(smollm2_dir, conv, tmp_path / "out", PRESETS["tiny"], target=target)
    H = target.meta["hidden_size"]
    assert s["samples"] == 3 and s["budget_bytes_per_token"] == 8 * H == 4608
    assert 8 * H < s["bytes_per_token"] < 8 * H * 1.2  # states + ids/mask/offsets/header overhead
    ds = ShardDataset([tmp_path / "out"], expect={"capture_layer_ids": [1, 14, 26],
                                                  "weights_hash": target.meta["weights_hash"]})
    item = ds[0]
    assert item["aux_hidden"].shape == (len(item["input_ids"]), 3 * H)
    # last_hidden is the post-norm state: the frozen lm_head on it gives the target's logits
    ids = item["input_ids"][None]
    ref = target.model(ids).logits[0]
    torch.testing.assert_close(target.model.lm_head(item["last_hidden"].float()), ref, atol=0.5, rtol=0.05)
