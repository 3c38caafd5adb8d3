"""User-supplied prompt files: `<extra_dir>/<workload>/*.jsonl` join that workload.

Each line is {"messages": [{"role", "content"}, ...]} or {"prompt": "..."}; optional "split":
"train"|"eval" pins the record to a split (otherwise the group hash decides, like every source).
Only system (first turn) and user turns are kept. A line whose structure cannot be read (broken JSON,
bad encoding, neither field, non-text content, unknown role) still becomes a record, with no messages,
so the filter rejects it (`bad:empty`) and kept + rejected == read holds; the reason goes to stderr
without content.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

from eagle3_platform.data.sources.pkg import Item
from eagle3_platform.store.records import BadRecord, parse_line, read_lines

EXTRA_ENV = "EAGLE3_EXTRA_SOURCES"
EXTRA_LICENSE = "user-supplied"
EXTRA_PREFIX = "extra/"
SPLITS = ("train", "eval")
KNOWN_ROLES = ("system", "user", "assistant")


def resolve_extra_dir(extra_dir: str | Path | None) -> Path | None:
    """The explicit argument, else $EAGLE3_EXTRA_SOURCES, else none."""
    value = extra_dir if extra_dir is not None else os.environ.get(EXTRA_ENV) or None
    return Path(value) if value is not None else None


def extra_files(workload: str, extra_dir: str | Path | None) -> list[Path]:
    root = resolve_extra_dir(extra_dir)
    if root is None or not (root / workload).is_dir():
        return []
    return sorted((root / workload).glob("*.jsonl"))


def extra_source(workload: str, path: Path) -> str:
    return f"{EXTRA_PREFIX}{workload}/{path.name}"


def parse_messages(row: object) -> tuple | str:
    """-> ((role, content), ...) with system (first only) + user turns, or a structural reason."""
    if not isinstance(row, dict):
        return "not_an_object"
    if "messages" not in row:
        prompt = row.get("prompt")
        return (("user", prompt),) if isinstance(prompt, str) else "no_messages_or_prompt"
    msgs = row["messages"]
    if not isinstance(msgs, list):
        return "messages_not_a_list"
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return "non_text_content"
        if m.get("role") not in KNOWN_ROLES:
            return "unknown_role"
        if m["role"] == "user" or (m["role"] == "system" and i == 0):
            out.append((m["role"], m["content"]))
    return tuple(out)


def iter_extra_file(workload: str, path: Path) -> Iterator[Item]:
    source = extra_source(workload, path)
    for n, line in enumerate(read_lines(path), start=1):  # bounded: a huge line is never held whole
        if not line.strip():
            continue
        try:
            row = parse_line(line)
        except BadRecord as e:  # broken JSON or encoding, a line too long, huge ints, deep nesting, lone surrogates
            row = e.reason
        parsed = parse_messages(row) if isinstance(row, dict) else row.replace("bad:", "broken_")
        split = row.get("split") if isinstance(row, dict) else None
        if isinstance(parsed, str):
            print(f"[sources] {source}:{n}: unreadable record ({parsed}); kept empty for the "
                  f"filter to reject", file=sys.stderr)
            parsed = ()
        key = str(n)
        yield Item(source, key, key, parsed, split if split in SPLITS else None)
