"""The feature shard format (docs/ARCHITECTURE.md §4): writer, manifest, lazy validating reader.

A shard is one safetensors file holding many samples, concatenated along the token axis:
    input_ids int32 [N], loss_mask uint8 [N], aux_hidden bf16 [N,3H], last_hidden bf16 [N,H],
    offsets int64 [S+1]   (sample s = rows offsets[s]:offsets[s+1]; offsets[0]=0, offsets[S]=N)
plus string header metadata (target, layers, template, tokenizer, max length, dtype, format version,
sample ids). Each feature directory has `manifest.parquet`: one row per shard with its sha256, so a
corrupt, truncated or swapped shard is detected before a single sample is used.

The reader never deserialises a shard up front: it hashes files (streaming) and reads headers, then
`safe_open` (mmap) slices one sample at a time.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import polars as pl
import torch
from safetensors import safe_open

from eagle3_platform.store.records import atomic_write, sha256_file

FORMAT_VERSION = "2"  # 2: compute_dtype (the dtype the target ran in) joined the header
MANIFEST = "manifest.parquet"
SHARD_PREFIX, SHARD_SUFFIX = "shard-", ".safetensors"
# Keys every shard header carries; all but max_length must agree across the shards one dataset reads.
HEADER_KEYS = ("target_id", "weights_hash", "capture_layer_ids", "template_hash", "tokenizer_hash",
               "max_length", "dtype", "compute_dtype", "format_version")
COMPAT_KEYS = tuple(k for k in HEADER_KEYS if k != "max_length")
IDS_KEY = "sample_ids"  # header: JSON list of record ids, one per sample


class ShardError(ValueError):
    """A shard that must not be used: corrupt, missing, or produced for another target/template."""


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"


def _header_strings(metadata: dict) -> dict[str, str]:
    meta = {**metadata, "format_version": FORMAT_VERSION}
    missing = [k for k in HEADER_KEYS if k not in meta]
    if missing:
        raise ValueError(f"shard metadata lacks {missing}")
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def normalise_header(header: dict) -> dict:
    """Header strings -> comparable values (capture_layer_ids a list, max_length an int)."""
    out = dict(header)
    if isinstance(out.get("capture_layer_ids"), str):
        out["capture_layer_ids"] = json.loads(out["capture_layer_ids"])
    if "max_length" in out:
        out["max_length"] = int(out["max_length"])
    out.pop(IDS_KEY, None)
    return out


def pack_samples(samples: Sequence[dict], dtype: torch.dtype, n_layers: int | None = None) -> dict:
    """list of per-sample dicts -> the shard's concatenated tensors."""
    if not samples:
        raise ValueError("a shard needs at least one sample")
    lengths = []
    for s in samples:
        T = len(s["input_ids"])
        if len(s["loss_mask"]) != T or s["aux_hidden"].shape[0] != T or s["last_hidden"].shape[0] != T:
            raise ValueError(f"sample {s.get('id', '?')}: ids/mask/hidden lengths differ")
        if n_layers and s["aux_hidden"].shape[1] != n_layers * s["last_hidden"].shape[1]:
            raise ValueError(f"sample {s.get('id', '?')}: aux_hidden width is not {n_layers}*H")
        lengths.append(T)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cat = lambda k, dt: torch.cat([torch.as_tensor(s[k]).to(dt).reshape(len(s["input_ids"]), -1)
                                   for s in samples]).contiguous()
    return {
        "input_ids": cat("input_ids", torch.int32).reshape(-1),  # [N]
        "loss_mask": cat("loss_mask", torch.uint8).reshape(-1),  # [N]
        "aux_hidden": cat("aux_hidden", dtype),  # [N,3H]
        "last_hidden": cat("last_hidden", dtype),  # [N,H]
        "offsets": offsets,  # [S+1]
    }


def write_shard(path: str | Path, samples: list[dict], metadata: dict) -> dict:
    """Write samples as one shard, atomically (tmp + fsync + rename). Returns its manifest row."""
    path = Path(path)
    header = _header_strings(metadata)
    n_layers = len(json.loads(header["capture_layer_ids"]))
    tensors = pack_samples(samples, getattr(torch, header["dtype"]), n_layers)
    ids = [str(s.get("id", "")) for s in samples]
    header[IDS_KEY] = json.dumps(ids)
    atomic_write(path, lambda tmp: _save_deterministic(tensors, tmp, header))
    return {"shard": path.name, "samples": len(samples), "tokens": int(tensors["offsets"][-1]),
            "sha256": sha256_file(path), "bytes": path.stat().st_size, "ids": ids}


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def _save_deterministic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a standard safetensors file whose bytes depend only on its content.

    safetensors' own writer emits the metadata in hash-map order, so the same shard written twice
    would get a different sha256 and a resumed run could never be byte-identical to an uninterrupted
    one. Layout (the safetensors spec): u64 little-endian header size, JSON header padded with spaces
    to 8 bytes, then the tensors' little-endian bytes back to back.
    """
    assert sys.byteorder == "little", "safetensors stores little-endian data"
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # keeps every tensor aligned
    entries, start = {}, 0
    for k in names:
        n = tensors[k].numel() * tensors[k].element_size()
        entries[k] = {"dtype": _ST_DTYPES[tensors[k].dtype], "shape": list(tensors[k].shape),
                      "data_offsets": [start, start + n]}
        start += n
    head = json.dumps({"__metadata__": dict(sorted(metadata.items())), **entries},
                      separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for k in names:  # [numel] -> raw bytes, no copy beyond contiguity
            f.write(tensors[k].contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: str | Path, rows: list[dict]) -> Path:
    """Atomically (re)write the directory's manifest, rows sorted by shard name."""
    path = Path(directory) / MANIFEST
    schema = {"shard": pl.String, "uri": pl.String, "samples": pl.Int64, "tokens": pl.Int64,
              "sha256": pl.String, "bytes": pl.Int64, "ids": pl.List(pl.String)}
    rows = sorted(rows, key=lambda r: r["shard"])
    # uri: where the shard was published (storage URI), else its key relative to this manifest
    df = pl.DataFrame([{k: r.get(k, r["shard"] if k == "uri" else None) for k in schema} for r in rows],
                      schema=schema)

    def write(tmp: Path) -> None:
        df.write_parquet(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())

    atomic_write(path, write)
    return path


MANIFEST_COLUMNS = ("shard", "samples", "tokens", "sha256", "bytes")


def read_manifest(directory: str | Path) -> pl.DataFrame:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"no feature manifest at {path} (run `eagle3 extract` first)")
    try:
        df = pl.read_parquet(path)
    except Exception as e:  # polars raises several types for a truncated/garbled parquet file
        raise ShardError(f"manifest {path} is unreadable (truncated or corrupt: {type(e).__name__}); "
                         "rerun `eagle3 extract` with the same --in/--out: it rebuilds the manifest "
                         "from the shards") from None
    if missing := [c for c in MANIFEST_COLUMNS if c not in df.columns]:
        raise ShardError(f"manifest {path} lacks columns {missing}: not a feature manifest")
    return df


def rows_from_shards(directory: str | Path) -> list[dict]:
    """Manifest rows rebuilt from the shard files of a directory whose manifest is lost. Shards are
    written atomically (tmp + rename), so a file with a readable header and consistent offsets is a
    finished shard; unreadable ones are left out (and recomputed by extract)."""
    rows = []
    for path in sorted(Path(directory).glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}")):
        try:
            with safe_open(str(path), framework="pt") as f:
                ids = json.loads((f.metadata() or {}).get(IDS_KEY, "[]"))
                offsets = f.get_tensor("offsets")  # [S+1]
        except Exception:  # a damaged file is simply not listed
            continue
        if len(offsets) != len(ids) + 1:
            continue
        rows.append({"shard": path.name, "samples": len(ids), "tokens": int(offsets[-1]),
                     "sha256": sha256_file(path), "bytes": path.stat().st_size, "ids": ids})
    return rows


def read_header(path: str | Path) -> dict:
    """A shard's header metadata (strings), without touching its tensors."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def check_shard(path: Path, row: dict | None, expect: dict | None = None,
                hash_file: bool = True) -> dict:
    """Validate one shard against its manifest row and `expect`; returns its header.
    Raises ShardError naming the shard and the first mismatch."""
    if not path.exists():
        raise ShardError(f"shard {path}: missing (listed in the manifest)")
    if row is not None:
        if path.stat().st_size != row["bytes"]:
            raise ShardError(f"shard {path}: corrupt: {path.stat().st_size} bytes, manifest says "
                             f"{row['bytes']}")
        if hash_file and (got := sha256_file(path)) != row["sha256"]:
            raise ShardError(f"shard {path}: corrupt: sha256 {got[:12]}… != manifest "
                             f"{row['sha256'][:12]}…")
    try:
        header = read_header(path)
    except Exception as e:  # a safetensors parse error means a damaged file
        raise ShardError(f"shard {path}: unreadable header: {e}") from None
    missing = [k for k in HEADER_KEYS if k not in header]
    if missing:
        raise ShardError(f"shard {path}: header lacks {missing}")
    got = normalise_header(header)
    for key, want in normalise_header(dict(expect or {})).items():
        if got.get(key) != want:
            raise ShardError(f"shard {path}: {key} is {got.get(key)!r}, expected {want!r}")
    return got


def verify_shards(directory: str | Path, expect: dict | None = None) -> dict:
    """Check every shard of a feature dir (sha256 vs manifest, header vs expect). Never raises for a
    bad shard: returns {"ok": [names], "bad": [{"shard", "reason"}], "unlisted": [names], ...}."""
    directory = Path(directory)
    ok, bad = [], []
    manifest = read_manifest(directory)
    for row in manifest.iter_rows(named=True):
        try:
            check_shard(directory / row["shard"], row, expect)
            ok.append(row["shard"])
        except ShardError as e:
            bad.append({"shard": row["shard"], "reason": str(e)})
    listed = set(manifest["shard"].to_list())
    unlisted = sorted(p.name for p in directory.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}")
                      if p.name not in listed)
    return {"dir": str(directory), "ok": ok, "bad": bad, "unlisted": unlisted,
            "samples": int(manifest["samples"].sum()), "tokens": int(manifest["tokens"].sum())}


def check_distinct(dirs: Sequence[str | Path]) -> list:
    """dirs, refused when one directory is listed twice: its samples would silently count double."""
    seen: dict[str, str | Path] = {}
    for d in dirs:
        if (real := os.path.realpath(d)) in seen:
            raise ValueError(f"feature dir {d} is listed twice (as {seen[real]} and {d})")
        seen[real] = d
    return list(dirs)


class ShardDataset(torch.utils.data.Dataset):
    """Samples of one or more feature dirs, read lazily through mmap.

    Construction validates every shard (sha256 vs manifest, header vs `expect`, headers agree with
    each other) and raises ShardError naming the bad shard; with verify="lazy" the sha256 of a shard
    is checked when it is first opened instead (for very large datasets).
    """

    def __init__(self, dirs: Sequence[str | Path] | str | Path, expect: dict | None = None,
                 verify: str = "eager"):
        if verify not in ("eager", "lazy"):
            raise ValueError(f"verify must be 'eager' or 'lazy', not {verify!r}")
        dirs = check_distinct([dirs] if isinstance(dirs, (str, Path)) else list(dirs))
        self.verify = verify
        self._shards: list[tuple[Path, dict]] = []  # (path, manifest row)
        self._starts: list[int] = [0]  # global index of each shard's first sample
        self.header: dict[str, Any] = {}
        for d in dirs:
            for row in read_manifest(d).iter_rows(named=True):
                path = Path(d) / row["shard"]
                got = check_shard(path, row, expect, hash_file=verify == "eager")
                self._agree(path, got)
                self._shards.append((path, row))
                self._starts.append(self._starts[-1] + row["samples"])
        self._verified = {i for i in range(len(self._shards)) if verify == "eager"}
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        # DataLoader workers (spawn) receive a copy: mmap handles are reopened there, never sent
        return {**self.__dict__, "_open": {}, "_offsets": {}}

    def _agree(self, path: Path, got: dict) -> None:
        if not self.header:
            self.header = {k: got[k] for k in HEADER_KEYS}
            return
        for key in COMPAT_KEYS:
            if got[key] != self.header[key]:
                raise ShardError(f"shard {path}: {key} is {got[key]!r} but earlier shards have "
                                 f"{self.header[key]!r}")
        self.header["max_length"] = max(self.header["max_length"], got["max_length"])

    @classmethod
    def from_storage(cls, storage, prefix: str, cache_dir: str | Path, expect: dict | None = None,
                     verify: str = "eager") -> "ShardDataset":
        """Download a stored feature dir into cache_dir (skipping files already cached with the right
        sha256), then read it locally through mmap."""
        cache_dir = Path(cache_dir)
        storage.get_file(f"{prefix}/{MANIFEST}", cache_dir / MANIFEST)
        for row in read_manifest(cache_dir).iter_rows(named=True):
            local = cache_dir / row["shard"]
            if local.exists() and local.stat().st_size == row["bytes"] \
                    and sha256_file(local) == row["sha256"]:
                continue
            print(f"[features] fetching {row['shard']} ({row['bytes']} bytes)", file=sys.stderr)
            storage.get_file(f"{prefix}/{row['shard']}", local)
        return cls([cache_dir], expect=expect, verify=verify)

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def shard_paths(self) -> list[Path]:
        return [p for p, _ in self._shards]

    def content_sha256(self) -> str:
        """One digest of every shard's manifest sha256, in order: what the dataset holds."""
        return hashlib.sha256("\n".join(row["sha256"] for _, row in self._shards).encode()).hexdigest()

    def _handle(self, k: int):
        if os.getpid() != self._pid:  # forked DataLoader worker: mmap handles are per process
            self._open, self._pid = {}, os.getpid()
        if k not in self._open:
            path, row = self._shards[k]
            if k not in self._verified:
                check_shard(path, row)
                self._verified.add(k)
            f = safe_open(str(path), framework="pt")
            offsets = f.get_tensor("offsets")  # [S+1]
            if len(offsets) != row["samples"] + 1 or int(offsets[-1]) != row["tokens"]:
                raise ShardError(f"shard {path}: offsets give {len(offsets) - 1} samples / "
                                 f"{int(offsets[-1])} tokens, manifest says {row['samples']} / {row['tokens']}")
            self._open[k], self._offsets[k] = f, offsets
        return self._open[k]

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        lo, hi = 0, len(self._shards) - 1
        while lo < hi:  # last shard whose start <= i
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._starts[mid] <= i else (lo, mid - 1)
        return lo, i - self._starts[lo]

    def __getitem__(self, i: int) -> dict:
        k, s = self._locate(int(i))
        f = self._handle(k)
        a, b = (int(x) for x in self._offsets[k][s:s + 2])
        ids = self._shards[k][1].get("ids")
        return {
            "input_ids": f.get_slice("input_ids")[a:b].long(),  # [T]
            "loss_mask": f.get_slice("loss_mask")[a:b].long(),  # [T]
            "aux_hidden": f.get_slice("aux_hidden")[a:b],  # [T,3H]
            "last_hidden": f.get_slice("last_hidden")[a:b],  # [T,H]
            "id": ids[s] if ids else "",
        }

    def sample_lengths(self) -> list[int]:
        """Token count of every sample (reads only the small offsets tensors)."""
        out = []
        for k in range(len(self._shards)):
            self._handle(k)
            out += torch.diff(self._offsets[k]).tolist()
        return out

    def response_spans(self, lead: int = 0) -> Iterator[list[int]]:
        """Every run of loss-masked tokens (a regenerated answer), with the `lead` tokens before it (its
        turn header); reads only input_ids and loss_mask, one shard at a time."""
        zero = torch.zeros(1, dtype=torch.int)
        for k in range(len(self._shards)):
            f, bounds = self._handle(k), self._offsets[k].tolist()
            ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()  # [N] each
            for a, b in zip(bounds[:-1], bounds[1:]):  # one sample: runs never cross samples
                edges = torch.diff(mask[a:b].int(), prepend=zero, append=zero)  # +1 where a run starts, -1 after it
                starts, stops = (edges == 1).nonzero()[:, 0].tolist(), (edges == -1).nonzero()[:, 0].tolist()
                for start, stop in zip(starts, stops):
                    yield ids[a + max(0, start - lead):a + stop].tolist()

    def loss_masks(self) -> Iterator[torch.Tensor]:
        """Every sample's loss_mask (uint8 [T]), in order; reads one small tensor per shard."""
        for k in range(len(self._shards)):
            mask = self._handle(k).get_tensor("loss_mask")  # [N]
            yield from torch.tensor_split(mask, self._offsets[k][1:-1])
