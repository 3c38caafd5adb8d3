"""Offline feature extraction: conversation records -> feature shards + manifest
(docs/ARCHITECTURE.md §4, §5).

One target forward per conversation (decoder stack only: the teacher logits are recomputed from
`last_hidden` with the frozen lm_head at training time, so the lm_head matmul is skipped here).

Resume without recompute: the accepted records are cut into fixed slices, shard i = accepted records
[i*n, (i+1)*n). The manifest is rewritten (atomically) after every finished shard, so after a kill it
lists exactly the shards that are complete; a rerun re-hashes each listed shard, checks its header and
record ids against what it would write, skips it when everything matches, and recomputes it otherwise.

Shard files and the manifest are written by one background thread in shard order while the next
shard's forwards run (_Writer, at most one shard waiting).

A target no single device holds loads sharded (FeatureConfig.device_map: transformers' device_map,
accelerate's dispatch hooks); the captured states are gathered to the CPU and the shards are those a
single-device run writes.

Accounting: read = samples in shards + rejected (rejected.jsonl, each with a reason).

Hidden states an inference engine captured (engine_import.py) go through the same writer
(write_features), with their file reads in place of the forwards.
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open

from eagle3_platform.features.capture import forward_capture
from eagle3_platform.features.shards import (MANIFEST, ShardError, check_shard, read_header,
                                             read_manifest, rows_from_shards, shard_name,
                                             write_manifest, write_shard)
from eagle3_platform.model.compute import resolve_device, resolve_dtype
from eagle3_platform.model.target import Target, load_target
from eagle3_platform.progress import report as report_progress
from eagle3_platform.store.records import (ConversationRecord, Rejection, remove_stale_tmp, top_reasons,
                                     write_jsonl_atomic)
from eagle3_platform.store.storage import Mirror, Storage, storage_from_uri

REJECTED = "rejected.jsonl"
STAGE = "features"


MEMORY_BUDGET = -1  # FeatureConfig.batch_tokens: a token budget from free device memory
MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_device_map(text: str) -> str | dict | None:
    """"" -> None (one device); a strategy name; or a JSON object {module name: device}, devices as
    GPU indices, "cuda:N", "cpu" or "disk"."""
    text = text.strip()
    if not text:
        return None
    if text in MAP_STRATEGIES:
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"device_map {text!r}: expected one of {MAP_STRATEGIES} or a JSON object ({e})") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"device_map {text!r}: expected a non-empty JSON object {{module: device}}")
    return value


def parse_max_memory(text: str) -> dict | None:
    """"" -> None; a JSON object {device: size}; GPU index keys ("0") become ints, as accelerate wants."""
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"max_memory {text!r}: expected a JSON object like {{\"0\": \"70GiB\"}} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"max_memory {text!r}: expected a JSON object {{device: size}}")
    return {int(k) if str(k).isdigit() else k: v for k, v in value.items()}


@dataclass(frozen=True)
class FeatureConfig:
    samples_per_shard: int  # conversations per shard file (also the resume granularity)
    max_length: int  # longer conversations are truncated to this many tokens (and counted)
    batch_tokens: int  # padded tokens (B * longest) per target forward; <= longest => one at a time;
    # MEMORY_BUDGET = sized from the free memory of the GPUs the target sits on (batch_budget)
    dtype: str = "bfloat16"  # stored feature dtype
    target_dtype: str = "auto"  # dtype the target runs in (compute.resolve_dtype, dense work)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    # sharded loading (target.load_sharded): "" = the whole target on `device`; "auto" | "balanced" |
    # "sequential" | a JSON {module: device} map; max_memory: JSON {"0": "70GiB", "cpu": "200GiB"}
    device_map: str = ""
    max_memory: str = ""
    offload_folder: str = ""  # where "disk" entries of the map are kept

    def __post_init__(self):
        if self.samples_per_shard < 1 or self.max_length < 1:
            raise ValueError(f"samples_per_shard and max_length must be >= 1: {self}")
        if self.batch_tokens < MEMORY_BUDGET:
            raise ValueError(f"batch_tokens {self.batch_tokens}: expected >= 0, or {MEMORY_BUDGET} (from free memory)")
        parse_device_map(self.device_map), parse_max_memory(self.max_memory)  # bad settings fail here
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"feature dtype {self.dtype!r}: expected bfloat16, float16 or float32")


PRESETS: dict[str, FeatureConfig] = {
    "tiny": FeatureConfig(samples_per_shard=4, max_length=512, batch_tokens=0,  # = regen tiny max_length
                          target_dtype="float32"),  # tests compare against fp32 forwards
    # CPU: one conversation per forward measured faster than padded batches (bench_extract.py)
    "demo": FeatureConfig(samples_per_shard=64, max_length=2048, batch_tokens=0),
    "cpu": FeatureConfig(samples_per_shard=128, max_length=2048, batch_tokens=0),
    "full": FeatureConfig(samples_per_shard=512, max_length=4096, batch_tokens=32768),
}


def _log(msg: str) -> None:
    print(f"[extract] {msg}", file=sys.stderr, flush=True)


def target_header(target: Target, cfg: FeatureConfig) -> dict:
    """The header every shard of this target/config carries (and that resume and readers check)."""
    return feature_header(target.meta, target.tokenizer, cfg, target.meta["dtype"])


def feature_header(meta: dict, tokenizer, cfg: FeatureConfig, compute_dtype: str) -> dict:
    """The shard header of a prepared target's meta and tokenizer; compute_dtype: the dtype the
    states were computed in (the target's here, the engine's for imported states)."""
    from eagle3_platform.data.chat import template_hash, tokenizer_hash

    return {"target_id": meta["target_id"], "weights_hash": meta["weights_hash"],
            "capture_layer_ids": list(meta["capture_layer_ids"]),
            "template_hash": template_hash(tokenizer), "tokenizer_hash": tokenizer_hash(tokenizer),
            "max_length": cfg.max_length, "dtype": cfg.dtype, "compute_dtype": compute_dtype}


# ---------------------------------------------------------------- reading + accounting

def load_records(conv_path: str | Path, header: dict, max_length: int, vocab_size: int | None = None,
                 keep_full: bool = False) -> tuple[list[dict], list[Rejection], dict]:
    """Accepted samples {id, input_ids, loss_mask} (truncated to max_length), rejections, counters.
    keep_full: each sample also keeps its untruncated ids (`full_input_ids`: engine import matches
    captured token ids against them), workload and source (for its rejections)."""
    samples, rejected, stats = [], [], {"read": 0, "truncated": 0}
    seen: set[str] = set()
    with open(conv_path, "rb") as f:
        lines = f.read().split(b"\n")
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        stats["read"] += 1
        rec, reason = _parse(line, header, vocab_size)
        if not reason and rec.id in seen:
            reason = "dup"  # one sample per record id: ids name samples in shards and manifests
        full = rec.input_ids if rec else []
        if not reason and len(rec.input_ids) > max_length:
            stats["truncated"] += 1
            rec.input_ids, rec.loss_mask = rec.input_ids[:max_length], rec.loss_mask[:max_length]
            if not any(rec.loss_mask):
                reason = "bad:too_long"  # no response token left inside the window
        if reason:
            rid, wl, src = (rec.id, rec.workload, rec.source) if rec else (f"line{n + 1}", "", str(conv_path))
            rejected.append(Rejection(id=rid, workload=wl, source=src, stage=STAGE, reason=reason))
            continue
        seen.add(rec.id)
        samples.append({"id": rec.id, "input_ids": rec.input_ids, "loss_mask": rec.loss_mask,
                        **({"full_input_ids": full, "workload": rec.workload, "source": rec.source}
                           if keep_full else {})})
    return samples, rejected, stats


def _parse(line: bytes, header: dict, vocab_size: int | None) -> tuple[ConversationRecord | None, str]:
    try:
        rec = ConversationRecord.model_validate_json(line)
    except ValidationError as e:
        kind = "json" if any(err["type"] == "json_invalid" for err in e.errors()) else "schema"
        return None, f"bad:{kind}"
    if rec.target_id != header["target_id"]:
        return rec, "mismatch:target_id"
    if rec.template_hash != header["template_hash"]:
        return rec, "mismatch:template_hash"
    if not rec.input_ids:
        return rec, "bad:empty"
    if len(rec.loss_mask) != len(rec.input_ids):
        return rec, "bad:mask_length"
    if any(m not in (0, 1) for m in rec.loss_mask):
        return rec, "bad:mask_value"  # shards store the mask as uint8: -1 would become 255
    if not any(rec.loss_mask):
        return rec, "bad:no_response"
    if vocab_size and not all(0 <= t < vocab_size for t in rec.input_ids):
        return rec, "bad:token_id"  # not this target's vocabulary
    return rec, ""


# ---------------------------------------------------------------- the forward

def length_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped longest-first so that len(batch) * longest <= budget (>= 1 per batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def input_device(model) -> torch.device:
    """Where the token ids go: the device of the first placed module of a sharded target (accelerate's
    hooks move them on from there; "cpu"/"disk" offload computes on the CPU), else the parameters'."""
    placed = getattr(model, "hf_device_map", None)
    if placed:
        first = next(iter(placed.values()))
        return torch.device(f"cuda:{first}" if isinstance(first, int) else
                            "cpu" if first in ("cpu", "disk") else first)
    return next(model.parameters()).device


def _gpus(model) -> list[torch.device]:
    placed = getattr(model, "hf_device_map", None)
    devices = ({torch.device(f"cuda:{d}" if isinstance(d, int) else d) for d in placed.values()
                if d not in ("cpu", "disk")} if placed else {next(model.parameters()).device})
    return sorted((d for d in devices if d.type == "cuda"), key=str)


def batch_budget(target: Target, cfg: FeatureConfig) -> int:
    """cfg.batch_tokens, or for MEMORY_BUDGET half the free memory of the fullest GPU the target sits
    on over an estimate of one token's live activations (one layer's hidden/attention/MLP states, the
    captured states kept until the forward ends). Without a GPU: 0, one conversation per forward."""
    if cfg.batch_tokens != MEMORY_BUDGET:
        return cfg.batch_tokens
    gpus = _gpus(target.model)
    if not gpus:
        return 0
    free = min(torch.cuda.mem_get_info(d)[0] for d in gpus)
    c = target.model.config.get_text_config()
    itemsize = torch.empty(0, dtype=getattr(torch, target.meta["dtype"])).element_size()
    per_token = itemsize * (8 * c.hidden_size + 3 * c.intermediate_size
                            + (len(target.layer_ids) + 1) * c.hidden_size)
    return int(0.5 * free / per_token)


@torch.inference_mode()
def compute_features(target: Target, samples: list[dict], cfg: FeatureConfig) -> list[dict]:
    """samples + aux_hidden [T,3H] / last_hidden [T,H] in cfg.dtype, input order kept."""
    model, layers = target.model, target.layer_ids
    device, dtype = input_device(model), getattr(torch, cfg.dtype)
    out: list[dict | None] = [None] * len(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    for batch in length_batches(lengths, batch_budget(target, cfg)):
        T = lengths[batch[0]]  # longest first
        ids = torch.full((len(batch), T), target.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros(len(batch), T, dtype=torch.long)
        for r, i in enumerate(batch):  # right padding: positions of real tokens are unchanged
            ids[r, :lengths[i]] = torch.tensor(samples[i]["input_ids"])
            mask[r, :lengths[i]] = 1
        padded = bool((mask == 0).any())
        cap = forward_capture(model, ids.to(device), layers, compute_logits=False,
                              attention_mask=mask.to(device) if padded else None)
        aux, last = cap.aux_hidden.to(dtype).cpu(), cap.last_hidden.to(dtype).cpu()  # [B,T,3H], [B,T,H]
        for r, i in enumerate(batch):
            out[i] = {**samples[i], "aux_hidden": aux[r, :lengths[i]], "last_hidden": last[r, :lengths[i]]}
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------- where shards go

class _Sink:
    """The local feature dir, optionally mirrored to a Storage under a key prefix (scratch + upload)."""

    def __init__(self, local: Path, mirror: Mirror | None):
        self.local, self.mirror = local, mirror
        local.mkdir(parents=True, exist_ok=True)
        stale = remove_stale_tmp(local)  # a killed run's half-written shard would stay on disk
        if stale:
            _log(f"removed {len(stale)} temp file(s) a killed run left: {', '.join(stale[:3])}")

    def uri(self, name: str) -> str:
        # local dirs: the key relative to the manifest, so a dir can be moved/copied and stays valid
        return self.mirror.uri(name) if self.mirror else name

    def previous_rows(self) -> dict[str, dict]:
        """Manifest rows of the last run (stored copy wins when mirrored)."""
        if self.mirror and self.mirror.exists(MANIFEST):
            self.mirror.fetch(MANIFEST)
        if not (self.local / MANIFEST).exists():
            return {}
        try:
            manifest = read_manifest(self.local)
        except ShardError as e:  # truncated/corrupt manifest: the shards themselves may be fine
            rows = rows_from_shards(self.local)
            _log(f"{e}; rebuilding it from {len(rows)} shard file(s) (headers and sample ids re-checked)")
            return {r["shard"]: {**r, "uri": self.uri(r["shard"])} for r in rows}
        return {r["shard"]: r for r in manifest.iter_rows(named=True)}

    def fetch(self, name: str, row: dict) -> bool:
        """Make the stored shard available locally; False when it is not stored."""
        path = self.local / name
        if not self.mirror:
            return path.exists()
        if not self.mirror.exists(name):
            return False
        if not (path.exists() and path.stat().st_size == row["bytes"]):
            self.mirror.fetch(name)
        return True

    def publish(self, name: str) -> None:
        if self.mirror:
            self.mirror.publish(name)


def _reusable(sink: _Sink, name: str, row: dict | None, header: dict, chunk: list[dict]) -> bool:
    """A finished shard from an earlier run: sha256 vs manifest, header, record ids and their tokens
    and masks as expected (a conversations file rewritten under the same ids, e.g. after redaction,
    must not keep the old features)."""
    if row is None or not sink.fetch(name, row):
        return False
    path = sink.local / name
    try:
        check_shard(path, row, expect=header)
        if json.loads(read_header(path).get("sample_ids", "[]")) != [s["id"] for s in chunk]:
            return False
        with safe_open(str(path), "pt") as f:
            same = all(f.get_tensor(k).tolist() == [v for s in chunk for v in s[k]]
                       for k in ("input_ids", "loss_mask"))
        if not same:
            _log(f"recomputing {name}: its records' tokens changed")
        return same
    except ShardError as e:
        _log(f"recomputing {name}: {e}")
        return False


# ---------------------------------------------------------------- the job

def open_sink(out_dir: str | Path, storage: Storage | None = None, prefix: str = "") -> _Sink:
    """`gs://bucket/path` → its local working copy, mirrored; a local dir → itself, or mirrored to
    `storage/prefix` when a storage is given (out_dir is then only the scratch copy)."""
    if storage is None and str(out_dir).startswith("gs://"):
        mirror = Mirror(storage_from_uri(str(out_dir)))
        return _Sink(mirror.root, mirror)
    return _Sink(Path(out_dir), Mirror(storage, out_dir, prefix) if storage else None)


def extract_file(target_dir: str | Path, conv_path: str | Path, out_dir: str | Path,
                 cfg: FeatureConfig, storage: Storage | None = None, prefix: str = "",
                 target: Target | None = None) -> dict:
    """Conversation records -> shards + manifest.parquet + rejected.jsonl in out_dir (a local dir, or
    `gs://bucket/path`); with `storage`, out_dir is the local scratch and files go to storage/prefix.
    `target` lets a caller pass an already loaded target (benchmarks, tests). Returns the summary."""
    t0 = time.perf_counter()
    if target is None:
        device = resolve_device(cfg.device)
        # whole conversations per forward: dense work (model/compute.py), where bf16 may not pay
        target = load_target(target_dir, dtype=resolve_dtype(cfg.target_dtype, device, "dense"), device=device,
                             device_map=parse_device_map(cfg.device_map), max_memory=parse_max_memory(cfg.max_memory),
                             offload_folder=cfg.offload_folder or None)
    header = target_header(target, cfg)
    sink = open_sink(out_dir, storage, prefix)
    samples, rejected, stats = load_records(conv_path, header, cfg.max_length, target.meta["vocab_size"])
    summary = write_features(sink, conv_path, header, samples, rejected, stats, cfg.samples_per_shard,
                             lambda chunk: compute_features(target, chunk, cfg), t0)
    # budget: aux 3H + last H states per token; in bf16 that is 8H bytes (+ ids/mask/offsets/header)
    itemsize = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    if target.meta.get("device_map"):
        summary["device_map"] = target.meta["device_map"]
    summary["budget_bytes_per_token"] = itemsize * (len(header["capture_layer_ids"]) + 1) * target.meta["hidden_size"]
    return summary


def write_features(sink: _Sink, conv_path, header: dict, samples: list[dict], rejected: list[Rejection],
                   stats: dict, samples_per_shard: int, compute, t0: float) -> dict:
    """The one shard writer of every feature source: rejected.jsonl, then shard i = samples
    [i*n, (i+1)*n) (kept when an earlier run finished it, else `compute(chunk)` -> the chunk's samples
    with aux_hidden/last_hidden), the manifest after every shard. Returns the summary."""
    write_jsonl_atomic(sink.local / REJECTED, rejected)
    sink.publish(REJECTED)
    if not samples:  # an empty feature dir would train an untrained head downstream: fail here
        raise ValueError(_nothing_usable(conv_path, stats["read"], rejected, sink.local / REJECTED))
    n = samples_per_shard
    slices = [samples[i:i + n] for i in range(0, len(samples), n)]
    rows, written, skipped = _run_shards(compute, header, sink, slices)
    _remove_stale(sink.local, len(slices))
    _commit_manifest(sink, rows, {}, len(slices))
    return _summary(sink, header, stats, rows, rejected, written, skipped, time.perf_counter() - t0)


def _nothing_usable(conv_path, read: int, rejected: list[Rejection], rejected_path: Path) -> str:
    if not read:
        return f"no conversation records in {conv_path}: nothing to extract"
    reasons = Counter(r.reason for r in rejected)
    hint = " (records made for another target: regenerate them with this one)" \
        if "mismatch:target_id" in reasons or "mismatch:template_hash" in reasons else ""
    return f"all {read} records of {conv_path} rejected: {top_reasons(reasons)}{hint}; details in {rejected_path}"


def _run_shards(compute, header, sink, slices) -> tuple[list[dict], list[str], list[str]]:
    """Shard k = slices[k]: kept when an earlier run finished it, computed otherwise. The forwards run
    here; writing, publishing and the manifest run on one writer thread in shard order (at most one
    computed shard waits for it), so a GPU never idles on the disk or the bucket and the manifest still
    lists only shards that are complete on disk."""
    previous = sink.previous_rows()
    rows, written, skipped = [], [], []
    todo_tokens = sum(len(s["input_ids"]) for chunk in slices for s in chunk)
    clock = {"done_tokens": 0, "start": 0.0}
    total = len(slices)

    def keep(k: int, name: str, chunk_tokens: int) -> None:
        nonlocal todo_tokens
        rows.append(previous[name])
        skipped.append(name)
        todo_tokens -= chunk_tokens
        report_progress("extract", k + 1, total, "shards", f"{name}: verified, kept")

    def write(k: int, name: str, features: list[dict], chunk_tokens: int, t: float) -> None:
        row = write_shard(sink.local / name, features, header)
        sink.publish(name)
        rows.append({**row, "uri": sink.uri(name)})
        written.append(name)
        _commit_manifest(sink, rows, previous, k)
        clock["done_tokens"] += chunk_tokens  # forwards and writes overlap: the rate is over wall time
        rate = clock["done_tokens"] / max(time.perf_counter() - clock["start"], 1e-9)
        report_progress("extract", k + 1, total, "shards",
                        f"{name}: {row['samples']} samples, {row['tokens']} tokens, {time.perf_counter() - t:.1f}s, "
                        f"{rate:.0f} tok/s, eta {(todo_tokens - clock['done_tokens']) / rate:.0f}s")

    with _Writer() as writer:
        for k, chunk in enumerate(slices):
            name = shard_name(k)
            chunk_tokens = sum(len(s["input_ids"]) for s in chunk)
            if _reusable(sink, name, previous.get(name), header, chunk):
                writer.submit(keep, k, name, chunk_tokens)
                continue
            t = time.perf_counter()
            clock["start"] = clock["start"] or t  # the first forward
            writer.submit(write, k, name, compute(chunk), chunk_tokens, t)
    return rows, written, skipped


class _Writer:
    """One background thread running jobs in submission order, with at most `depth` jobs waiting (a
    bounded queue: computed shards do not pile up in memory). A job's error is raised in the caller
    at the next submit or on exit, and the jobs after it are dropped; on exit every submitted job has
    finished (a failed forward still leaves the shards before it written and listed)."""

    def __init__(self, depth: int = 1):
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.depth, self.pending = ThreadPoolExecutor(1, thread_name_prefix="shard-writer"), depth, []
        self.failed = False

    def submit(self, fn, *args) -> None:
        self.pending.append(self.pool.submit(self._run, fn, *args))
        while len(self.pending) > self.depth:
            self.pending.pop(0).result()

    def _run(self, fn, *args) -> None:
        if self.failed:  # a later shard must not be listed while an earlier one is missing
            return
        try:
            fn(*args)
        except BaseException:
            self.failed = True
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)
        if exc[0] is None:
            for f in self.pending:
                f.result()


def _commit_manifest(sink: _Sink, rows: list[dict], previous: dict, upto: int) -> None:
    """Finished rows plus the earlier run's rows for shards not reached yet (still valid, and
    re-verified when reached), so a kill never forgets work already done."""
    done = {r["shard"] for r in rows}
    later = [r for name, r in previous.items()
             if name not in done and name > shard_name(upto)]
    write_manifest(sink.local, rows + later)
    sink.publish(MANIFEST)


def _remove_stale(local: Path, n_shards: int) -> None:
    """Shards past the end (an earlier run over a longer input) must not look like data."""
    for p in local.glob("shard-*.safetensors"):
        if p.name >= shard_name(n_shards):
            p.unlink()


def _summary(sink, header, stats, rows, rejected, written, skipped, seconds) -> dict:
    by_reason: dict[str, int] = {}
    for r in rejected:
        by_reason[r.reason] = by_reason.get(r.reason, 0) + 1
    samples = sum(r["samples"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    if stats["read"] != samples + len(rejected):
        raise RuntimeError(f"accounting broken: read {stats['read']} != {samples} + {len(rejected)}")
    return {"read": stats["read"], "samples": samples, "rejected": len(rejected),
            "by_reason": by_reason, "truncated": stats["truncated"], "shards": len(rows),
            "shards_written": len(written), "shards_skipped": len(skipped), "tokens": tokens,
            "bytes": nbytes, "bytes_per_token": round(nbytes / tokens, 1) if tokens else None,
            "manifest": sink.uri(MANIFEST) if sink.mirror else str(sink.local / MANIFEST),
            "out": sink.uri("") if sink.mirror else str(sink.local),
            "header": header, "seconds": round(seconds, 2)}
