"""Checks on the paths a stage is given, run before any work (torch-free, tiny).

Unchecked, a bad output path surfaces as a traceback from deep inside a stage (NotADirectoryError,
IsADirectoryError), often after the work is done, and the same path given twice silently loses data
(`filter --out X --rejected X` would keep only the rejections). Each check raises ValueError, which
`eagle3` turns into its one-line error (exit 2, JSON summary with ok: false). Flags name the paths
because the CLI is where they come from; a Dagster asset builds the same request.
"""
from __future__ import annotations

import os
from pathlib import Path


def _remote(path) -> bool:
    return str(path).startswith("gs://")


def _parents_are_dirs(flag: str, p: Path) -> None:
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {p}: {parent} is a file, not a directory")
            return


def output_file(path, flag: str = "--out") -> None:
    """`path` can be written as a file: not a directory, and no file where a parent directory must be."""
    if path is None or _remote(path):
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {p} is a directory; expected a file path")
    _parents_are_dirs(flag, p)


def output_dir(path, flag: str = "--out") -> None:
    """`path` can be a directory: not an existing file, and no file where a parent directory must be."""
    if path is None or _remote(path):
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p} is a file; expected a directory")
    _parents_are_dirs(flag, p)


def distinct_paths(paths: dict[str, object]) -> None:
    """No two of {flag: path} name the same file (an input overwritten, or two outputs in one file)."""
    seen: dict[str, str] = {}
    for flag, path in paths.items():
        if path is None:
            continue
        key = str(path) if _remote(path) else os.path.realpath(path)  # symlinks and ./x vs x alike
        if key in seen:
            raise ValueError(f"{seen[key]} and {flag} are the same file ({path}); give each its own path")
        seen[key] = flag
