"""Committed local artifacts, and the destinations the store tests write to: a local folder or a prefix in a fresh
bucket of the SeaweedFS server, each with raw tampering that bypasses blockdraft (plain file writes or a raw boto3
client)."""

from __future__ import annotations

import os
from pathlib import Path

from blockdraft.config import StoreConfig
from blockdraft.store import checksum_cache, open_store
from blockdraft.store.artifact import commit_artifact, entry_for_local_file
from helpers.s3server import SeaweedS3


def commit_files(root: Path, files: dict[str, bytes], kind: str = "test", lineage=()) -> Path:
    """Write `files` ({relpath: bytes}) under `root` and commit them there as an artifact of `kind`; `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    entries = [entry_for_local_file(root, root / rel) for rel in files]
    commit_artifact(open_store(root), kind, entries, config={"store": {"url": "test"}}, lineage=lineage,
                    counts={"rows": len(files)})
    return root


def rot_under_cache(path: Path, offset: int = 100) -> None:
    """Flip a byte of `path` the way a failing disk does: size, mtime and ctime as they were. The ctime cannot be set
    back, so the checksum cache is made to hold the old checksum for the new stat, which is what it holds after real bit
    rot (the file must be older than the cache's racy window, or nothing is cached for it)."""
    before = path.stat()
    _, old = checksum_cache.file_checksum(path, before)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    st = path.stat()
    checksum_cache._write([(os.path.abspath(path), *checksum_cache._key(st), old)])
    assert checksum_cache.cached_checksum(path, st) == old  # the cache now vouches for the rotten bytes


class Destination:
    """Where a transfer test writes: an S3 prefix in a fresh bucket (`kind` "s3") or a local folder ("file"), plus raw
    tampering that bypasses blockdraft."""

    def __init__(self, kind: str, url: str, server: SeaweedS3 | None = None, bucket: str | None = None,
                 root: Path | None = None):
        self.kind, self.url, self.server, self.bucket, self.root = kind, url, server, bucket, root
        # 5 MiB parts (the S3 minimum) so small test files still take the multipart path.
        self.settings = StoreConfig(part_size_mib=5, concurrency=4)

    @classmethod
    def folder(cls, root: Path) -> Destination:
        return cls("file", f"file://{root}", root=root)

    @classmethod
    def s3(cls, server: SeaweedS3) -> Destination:
        bucket = server.new_bucket()
        return cls("s3", f"s3://{bucket}/runs", server=server, bucket=bucket)

    def sub(self, rel: str) -> str:
        return self.url.rstrip("/") + "/" + rel

    def s3_key(self, rel: str) -> str:
        return self.url.removeprefix(f"s3://{self.bucket}/").rstrip("/") + "/" + rel

    def overwrite(self, rel: str, data: bytes) -> None:
        if self.kind == "s3":
            self.server.client().put_object(Bucket=self.bucket, Key=self.s3_key(rel), Body=data)
        else:
            (self.root / rel).write_bytes(data)

    def remove(self, rel: str) -> None:
        if self.kind == "s3":
            self.server.client().delete_object(Bucket=self.bucket, Key=self.s3_key(rel))
        else:
            (self.root / rel).unlink()

    def exists(self, rel: str) -> bool:
        if self.kind == "s3":
            resp = self.server.client().list_objects_v2(Bucket=self.bucket, Prefix=self.s3_key(rel))
            return any(o["Key"] == self.s3_key(rel) for o in resp.get("Contents", []))
        return (self.root / rel).is_file()
