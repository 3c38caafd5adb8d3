"""Artifact storage: one interface, a local-filesystem and a GCS implementation, and `Mirror`, the
local working copy heavy steps read and write. The ONE storage implementation: the Dagster `storage`
resource and feature extraction both go through it.

Keys are '/'-separated relative paths ("features/chat/shard-00000.safetensors"). Heavy steps work on
local files; the storage moves whole files in and out, atomically on both sides (local: tmp + rename;
GCS: an object appears only when its upload completes).
"""
from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path

from eagle3_platform.store.paths import scratch_dir, work_dir
from eagle3_platform.store.records import atomic_write


class Storage(ABC):
    @abstractmethod
    def uri(self, key: str) -> str: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under prefix, sorted."""

    @abstractmethod
    def put_file(self, local: str | Path, key: str) -> str:
        """Store a local file under key; returns its URI."""

    @abstractmethod
    def get_file(self, key: str, local: str | Path) -> Path: ...

    def put_bytes(self, key: str, data: bytes) -> str:
        tmp = scratch_dir() / key.replace("/", "__")
        tmp.write_bytes(data)
        try:
            return self.put_file(tmp, key)
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        tmp = scratch_dir() / key.replace("/", "__")
        try:
            return self.get_file(key, tmp).read_bytes()
        finally:
            tmp.unlink(missing_ok=True)

    def put_dir(self, local_dir: str | Path, prefix: str) -> list[str]:
        local_dir = Path(local_dir)
        return [self.put_file(p, f"{prefix}/{p.relative_to(local_dir).as_posix()}")
                for p in sorted(local_dir.rglob("*")) if p.is_file() and not p.name.endswith(".tmp")]

    def get_dir(self, prefix: str, local_dir: str | Path) -> Path:
        local_dir = Path(local_dir)
        for key in self.list(prefix):
            dest = local_dir / key[len(prefix):].lstrip("/")
            if not dest.exists():
                self.get_file(key, dest)
        return local_dir


class LocalStorage(Storage):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root not in p.parents and p != self.root:
            raise ValueError(f"key escapes the storage root: {key!r}")
        return p

    def uri(self, key: str) -> str:
        return self.path(key).as_uri()

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        if not base.exists():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*")
                      if p.is_file() and not p.name.endswith(".tmp"))

    def put_file(self, local: str | Path, key: str) -> str:
        dest = self.path(key)
        if Path(local).resolve() != dest:
            atomic_write(dest, lambda tmp: shutil.copyfile(local, tmp))
        return self.uri(key)

    def get_file(self, key: str, local: str | Path) -> Path:
        local = Path(local)
        src = self.path(key)
        if src != local.resolve():
            atomic_write(local, lambda tmp: shutil.copyfile(src, tmp))
        return local


class GCSStorage(Storage):
    """google-cloud-storage client. Against an emulator set STORAGE_EMULATOR_HOST; credentials are
    anonymous there so google-auth never reaches for the metadata server."""

    def __init__(self, bucket: str, prefix: str = "", project: str | None = None):
        from google.cloud import storage as gcs

        if os.environ.get("STORAGE_EMULATOR_HOST"):
            from google.auth.credentials import AnonymousCredentials

            client = gcs.Client(project=project or "local", credentials=AnonymousCredentials())
        else:
            client = gcs.Client(project=project)
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.bucket = client.bucket(bucket)

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"gs://{self.bucket_name}/{self._name(key)}"

    def exists(self, key: str) -> bool:
        return self.bucket.blob(self._name(key)).exists()

    def list(self, prefix: str) -> list[str]:
        skip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(b.name[skip:] for b in self.bucket.client.list_blobs(
            self.bucket, prefix=self._name(prefix)))

    def put_file(self, local: str | Path, key: str) -> str:
        self.bucket.blob(self._name(key)).upload_from_filename(str(local))
        return self.uri(key)

    def get_file(self, key: str, local: str | Path) -> Path:
        local = Path(local)
        atomic_write(local, lambda tmp: self.bucket.blob(self._name(key)).download_to_filename(str(tmp)))
        return local


def storage_from_uri(uri: str, project: str | None = None) -> Storage:
    """'gs://bucket/prefix' → GCSStorage, anything else → LocalStorage rooted there."""
    if uri.startswith("gs://"):
        bucket, _, prefix = uri[5:].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {uri!r}: expected gs://bucket[/prefix]")
        return GCSStorage(bucket, prefix, project)
    return LocalStorage(uri.removeprefix("file://"))


def default_local_root(storage: Storage, base: str | Path | None = None) -> Path:
    """Where a Mirror keeps its local copy: a local storage is its own copy; a bucket gets a cache
    directory per bucket and prefix under `base` (default: the cache root's work dir)."""
    if isinstance(storage, LocalStorage):
        return storage.root
    assert isinstance(storage, GCSStorage)
    return Path(base or work_dir()) / "gcs" / storage.bucket_name / (storage.prefix or "_")


class Mirror:
    """A Storage seen through a local directory, for steps that read and write local files.

    Every key has a local path (`local_root/key`); `fetch` brings a stored object there, `publish`
    stores the local file. Over a LocalStorage rooted at `local_root` the local path IS the stored
    object, so nothing is copied (`in_place`). `prefix` is prepended to keys on the storage side only.
    """

    def __init__(self, storage: Storage, local_root: str | Path | None = None, prefix: str = ""):
        self.storage, self.prefix = storage, prefix.strip("/")
        self.root = Path(local_root).resolve() if local_root else default_local_root(storage)
        self.in_place = isinstance(storage, LocalStorage) and storage.root == self.root and not self.prefix

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def local_path(self, name: str) -> Path:
        return self.root / name

    def uri(self, name: str) -> str:
        return self.storage.uri(self.key(name))

    def exists(self, name: str) -> bool:
        return self.storage.exists(self.key(name))

    def list(self, prefix: str) -> list[str]:
        return self.storage.list(self.key(prefix))

    def fetch(self, name: str) -> Path:
        """Local copy of a stored file (the file itself when in place)."""
        if not self.exists(name):
            raise FileNotFoundError(f"{self.uri(name)} does not exist; materialize its upstream asset")
        return self.storage.get_file(self.key(name), self.local_path(name))

    def fetch_dir(self, prefix: str) -> Path:
        if not self.list(prefix):
            raise FileNotFoundError(f"nothing under {self.uri(prefix)}; materialize its upstream asset")
        if not self.in_place:  # the local copy is a cache: drop it so no stale file survives a re-run
            shutil.rmtree(self.local_path(prefix), ignore_errors=True)
        return self.storage.get_dir(self.key(prefix), self.local_path(prefix))

    def publish(self, name: str) -> str:
        """Store the local file of `name` (nothing to do when in place)."""
        return self.storage.put_file(self.local_path(name), self.key(name))

    def staging(self, key: str, input_hash: str = "") -> Path:
        """A private local directory where a step builds `key` (resumable: same input, same dir)."""
        d = self.root / ".staging" / key / (input_hash[:16] or "_")
        d.mkdir(parents=True, exist_ok=True)
        return d

    def publish_from(self, src: str | Path, key: str) -> str:
        """Store a staged file or directory under `key` and drop the staging copy. In place this is a
        rename on one filesystem; a directory replaces the old one whole, so no stale file survives."""
        src = Path(src)
        if self.in_place:
            _swap_in(src, self.local_path(key))
        elif src.is_dir():
            self.storage.put_dir(src, self.key(key))
        else:
            self.storage.put_file(src, self.key(key))
        if (self.root / ".staging") in src.resolve().parents:
            _remove_staged(src)
        return self.uri(key)


def _swap_in(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        os.replace(src, dest)
        return
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(src, dest)
    shutil.rmtree(old, ignore_errors=True)


def _remove_staged(src: Path) -> None:
    if src.is_dir():
        shutil.rmtree(src, ignore_errors=True)
        return
    src.unlink(missing_ok=True)
    if src.parent.exists() and not any(src.parent.iterdir()):
        src.parent.rmdir()
