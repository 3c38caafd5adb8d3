"""Artifact storage: one interface, a local-filesystem and a GCS implementation.

Keys are '/'-separated relative paths ("features/chat/shard-00000.safetensors"). Heavy steps work on
local files; the storage moves whole files in and out, atomically on both sides (local: tmp + rename;
GCS: an object appears only when its upload completes), and verifies sha256 when asked.
"""
from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path

from eagle3_platform.records import sha256_file


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
        tmp = Path(_scratch()) / key.replace("/", "__")
        tmp.write_bytes(data)
        try:
            return self.put_file(tmp, key)
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        tmp = Path(_scratch()) / key.replace("/", "__")
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
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.copyfile(local, tmp)
            os.replace(tmp, dest)
        return self.uri(key)

    def get_file(self, key: str, local: str | Path) -> Path:
        local = Path(local)
        src = self.path(key)
        if src != local.resolve():
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(local.name + ".tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, local)
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
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(local.name + ".tmp")
        self.bucket.blob(self._name(key)).download_to_filename(str(tmp))
        os.replace(tmp, local)
        return local


def verify(local: str | Path, sha256: str) -> None:
    got = sha256_file(local)
    if got != sha256:
        raise ValueError(f"checksum mismatch for {local}: expected {sha256[:12]}…, got {got[:12]}…")


def _scratch() -> str:
    d = Path(os.environ.get("EAGLE3_SCRATCH", Path.home() / ".cache" / "eagle3" / "scratch"))
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def storage_from_uri(uri: str) -> Storage:
    """'gs://bucket/prefix' → GCSStorage, anything else → LocalStorage rooted there."""
    if uri.startswith("gs://"):
        bucket, _, prefix = uri[5:].partition("/")
        return GCSStorage(bucket, prefix)
    return LocalStorage(uri.removeprefix("file://"))
