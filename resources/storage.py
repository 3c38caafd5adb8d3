"""The `storage` resource: artifacts on local disk or in GCS, behind one interface.

A thin Dagster face on `eagle3_platform.store.storage` (the one storage implementation): `root` is a local
directory (default: the project data dir) or `gs://bucket/prefix`. Heavy library steps read and write
local files; the resource maps every key to a local working path, `fetch`es upstream artifacts there
before a step and `publish`es outputs after it (`eagle3_platform.store.storage.Mirror`). On local disk the
working path *is* the stored object (no copies); for a bucket it is a cache under `work_dir`.
"""
from __future__ import annotations

import os
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import PrivateAttr

from eagle3_platform.store import paths
from eagle3_platform.store.storage import Mirror, Storage, default_local_root, storage_from_uri

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def default_data_dir() -> str:
    return os.environ.get("EAGLE3_DATA_DIR", str(PROJECT_ROOT / "data"))


class StorageResource(ConfigurableResource):
    """Local directory or GCS bucket. Against a GCS emulator export STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT."""

    root: str = default_data_dir()  # a local directory or gs://bucket/prefix
    project: str | None = None  # GCP project of the bucket
    work_dir: str = str(paths.work_dir())  # local working copies of a bucket's objects

    _mirror = PrivateAttr(default=None)

    def mirror(self) -> Mirror:
        if self._mirror is None:  # one client per resource instance, not per call
            storage = storage_from_uri(self.root, self.project)
            self._mirror = Mirror(storage, default_local_root(storage, self.work_dir))
        return self._mirror

    def storage(self) -> Storage:
        return self.mirror().storage

    def local_path(self, key: str) -> Path:
        return self.mirror().local_path(key)

    def uri(self, key: str) -> str:
        return self.mirror().uri(key)

    def exists(self, key: str) -> bool:
        return self.mirror().exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.mirror().list(prefix)

    def fetch(self, key: str) -> Path:
        return self.mirror().fetch(key)

    def fetch_dir(self, prefix: str) -> Path:
        return self.mirror().fetch_dir(prefix)

    def staging(self, key: str, input_hash: str = "") -> Path:
        return self.mirror().staging(key, input_hash)

    def publish_from(self, src: Path, key: str) -> str:
        return self.mirror().publish_from(src, key)
