"""Decontamination keys and the small caches that keep observation / eval_keys() cheap.

decontam_key(text) = sha256 of the normalised text: NFKC, casefold, punctuation and ASCII symbols
removed, whitespace runs collapsed to one space, ends stripped. Two prompts that differ only in case,
spacing, punctuation or Unicode compatibility forms get the same key.
"""
from __future__ import annotations

import functools
import hashlib
import json
import string
import sys
import unicodedata
from pathlib import Path
from typing import Callable

from eagle3_platform.store.paths import cache_root
from eagle3_platform.store.records import sha256_file, write_json_atomic


@functools.cache
def _punct_table() -> dict[int, None]:
    # every Unicode punctuation code point (category P*) plus ASCII symbols such as $ + < = > ^ ` | ~
    table = {cp: None for cp in range(sys.maxunicode + 1) if unicodedata.category(chr(cp)).startswith("P")}
    table.update({ord(c): None for c in string.punctuation})
    return table


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold().translate(_punct_table())
    return " ".join(text.split())


def decontam_key(text: str) -> str:
    return hashlib.sha256(normalise(text).encode("utf-8")).hexdigest()


def cache_dir() -> Path:
    return cache_root() / "sources"


_HASHES: dict[str, str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, cached in-process and on disk by (path, size, mtime_ns): the 125 MB
    ShareGPT file is hashed once per version, not on every observation."""
    st = Path(path).stat()
    key = f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if key in _HASHES:
        return _HASHES[key]
    disk = cache_dir() / "file_hashes.json"
    try:
        stored = json.loads(disk.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stored = {}
    if key not in stored:
        prefix = key.rsplit("|", 2)[0] + "|"
        stored = {k: v for k, v in stored.items() if not k.startswith(prefix)}  # stale versions
        stored[key] = sha256_file(path)
        try:  # a cache, not a record: losing a race with another process only costs a re-hash
            write_json_atomic(disk, stored)
        except OSError:
            pass
    _HASHES[key] = stored[key]
    return stored[key]


_EVAL_KEYS: dict[str, frozenset] = {}


def cached_eval_keys(fingerprint: str, compute: Callable[[], set[str]]) -> frozenset:
    """Eval keys for one combined source fingerprint: memory, then disk, then compute()."""
    if fingerprint in _EVAL_KEYS:
        return _EVAL_KEYS[fingerprint]
    disk = cache_dir() / f"eval_keys-{fingerprint[:32]}.json"
    try:
        keys = frozenset(json.loads(disk.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        keys = frozenset(compute())
        try:
            write_json_atomic(disk, sorted(keys))
        except OSError:
            pass
    _EVAL_KEYS[fingerprint] = keys
    return keys
