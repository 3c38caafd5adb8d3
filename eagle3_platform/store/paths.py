"""Where the platform keeps things it can rebuild (converted targets, source hashes, scratch files, the
GCS working copy). The one place that knows the cache root; torch-free. EAGLE3_CACHE moves all of it."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))


def scratch_dir() -> Path:
    """Short-lived local files (uploads/downloads in flight); EAGLE3_SCRATCH overrides."""
    d = Path(os.environ.get("EAGLE3_SCRATCH", cache_root() / "scratch"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def work_dir() -> Path:
    """Local working copies of remote (GCS) artifacts; EAGLE3_WORK_DIR overrides."""
    return Path(os.environ.get("EAGLE3_WORK_DIR", cache_root() / "work"))
