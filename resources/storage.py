"""The `storage` resource: one code path for local disk and GCS.

Heavy library steps read and write local files. The resource maps every storage key to a local
working path, `fetch`es upstream artifacts there before a step and `publish`es outputs after it.
For `LocalStorageResource` the working path *is* the stored object (no copies); for
`GCSStorageResource` it is a per-bucket cache directory and objects move through
`eagle3_platform.storage.GCSStorage` (anonymous credentials against an emulator).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import PrivateAttr

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def default_data_dir() -> str:
    return os.environ.get("EAGLE3_DATA_DIR", str(PROJECT_ROOT / "data"))


def default_work_dir() -> str:
    return os.environ.get("EAGLE3_WORK_DIR", str(Path.home() / ".cache" / "eagle3" / "work"))


class StorageResource(ConfigurableResource):
    """Interface; use LocalStorageResource or GCSStorageResource."""

    def storage(self):  # -> eagle3_platform.storage.Storage
        raise NotImplementedError

    def work_root(self) -> Path:
        raise NotImplementedError

    # -- one code path for both backends -------------------------------------------------------
    def local_path(self, key: str) -> Path:
        return self.work_root() / key

    def uri(self, key: str) -> str:
        return self.storage().uri(key)

    def exists(self, key: str) -> bool:
        return self.storage().exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.storage().list(prefix)

    def fetch(self, key: str) -> Path:
        """Local copy of a stored file (no copy for local storage)."""
        if not self.storage().exists(key):
            raise FileNotFoundError(f"{self.uri(key)} does not exist; materialize its upstream asset")
        return self.storage().get_file(key, self.local_path(key))

    def fetch_dir(self, prefix: str) -> Path:
        if not self.storage().list(prefix):
            raise FileNotFoundError(f"nothing under {self.uri(prefix)}; materialize its upstream asset")
        return self.storage().get_dir(prefix, self.local_path(prefix))

    def staging(self, key: str, input_hash: str = "") -> Path:
        """A private local directory where a step builds `key` (resumable: same input, same dir)."""
        d = self.work_root() / ".staging" / key / (input_hash[:16] or "_")
        d.mkdir(parents=True, exist_ok=True)
        return d

    def publish_from(self, src: Path, key: str) -> str:
        """Store a staged file or directory under `key` and drop the staging copy."""
        src = Path(src)
        if src.is_dir():
            self._publish_dir(src, key)
        else:
            self._publish_file(src, key)
        if (self.work_root() / ".staging") in src.resolve().parents:
            if src.is_dir():
                shutil.rmtree(src, ignore_errors=True)
            else:
                src.unlink(missing_ok=True)
                if not any(src.parent.iterdir()):
                    src.parent.rmdir()
        return self.uri(key)

    def _publish_file(self, src: Path, key: str) -> None:
        self.storage().put_file(src, key)

    def _publish_dir(self, src: Path, key: str) -> None:
        self.storage().put_dir(src, key)

    def publish(self, key: str) -> str:
        return self.storage().put_file(self.local_path(key), key)

    def publish_dir(self, prefix: str) -> str:
        self.storage().put_dir(self.local_path(prefix), prefix)
        return self.uri(prefix)


class LocalStorageResource(StorageResource):
    root: str = default_data_dir()

    def storage(self):
        from eagle3_platform.storage import LocalStorage

        return LocalStorage(self.root)

    def work_root(self) -> Path:
        return Path(self.root).resolve()

    def _publish_file(self, src: Path, key: str) -> None:
        dest = self.local_path(key)  # same filesystem: an atomic rename, no copy
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dest)

    def _publish_dir(self, src: Path, key: str) -> None:
        """Swap the whole directory, so no stale file from an older run survives beside the new."""
        dest = self.local_path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        old = dest.with_name(dest.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            os.replace(dest, old)
        os.replace(src, dest)
        shutil.rmtree(old, ignore_errors=True)


class GCSStorageResource(StorageResource):
    """GCS bucket (+ prefix). Against an emulator export STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT."""

    bucket: str
    prefix: str = "eagle3"
    project: str | None = None
    work_dir: str = default_work_dir()

    _client = PrivateAttr(default=None)

    def storage(self):
        from eagle3_platform.storage import GCSStorage

        if self._client is None:  # one client per resource instance, not per call
            self._client = GCSStorage(self.bucket, self.prefix, self.project)
        return self._client

    def fetch_dir(self, prefix: str) -> Path:
        # The local copy is a cache of the bucket: drop it so no stale shard survives a re-run.
        shutil.rmtree(self.local_path(prefix), ignore_errors=True)
        return super().fetch_dir(prefix)

    def work_root(self) -> Path:
        return Path(self.work_dir) / "gcs" / self.bucket / (self.prefix or "_")
