"""Feature shards: format round trip, manifest, validation, lazy reading; extraction + resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_platform.features import shards as sh
from eagle3_platform.features.shards import (ShardDataset, ShardError, read_header, read_manifest,
                                             shard_name, verify_shards, write_manifest, write_shard)
from eagle3_platform.records import sha256_file

H = 4
META = dict(target_id="t", weights_hash="w" * 8, capture_layer_ids=[1, 2, 5], template_hash="th",
            tokenizer_hash="tk", max_length=64, dtype="bfloat16")


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
                                     ("template_hash", "th2")])
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


def test_write_shard_validates_samples(tmp_path):
    g = torch.Generator().manual_seed(0)
    s = _sample(4, 0, g)
    with pytest.raises(ValueError, match="lengths"):
        write_shard(tmp_path / "x.safetensors", [{**s, "loss_mask": [1]}], META)
    with pytest.raises(ValueError, match="lacks"):
        write_shard(tmp_path / "x.safetensors", [s], {"target_id": "t"})
    assert not (tmp_path / "x.safetensors").exists()
