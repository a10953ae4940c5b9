"""The S3 store: `s3://bucket/prefix` on AWS or any S3-compatible server, through boto3's classic client.

The connection and error lines live in `s3_client`, the part-parallel upload and download in `s3_multipart`; this
module is the `Store` over them: listing, HEAD with checksums, small reads and writes, and a seekable object reader.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from awscrt import checksums
from botocore.exceptions import ClientError

from blockdraft.config import StoreConfig
from blockdraft.store import s3_multipart
from blockdraft.store.base import ROOT_MARKERS, LocalFolder, ObjectInfo, Store
from blockdraft.store.s3_client import S3Location, b64, is_precondition_failed, make_connection, parse_s3_url


class S3Store(Store):
    def __init__(self, at: S3Location) -> None:
        self.at = at
        self.url = at.url

    @classmethod
    def from_url(cls, url: str, store_config: StoreConfig | None = None) -> S3Store:
        bucket, prefix = parse_s3_url(url)
        return cls(S3Location(bucket, prefix, make_connection(store_config)))

    @property
    def endpoint(self) -> str | None:
        return self.at.conn.endpoint

    def child(self, key_prefix: str) -> S3Store:
        sub = key_prefix.strip("/")
        return S3Store(S3Location(self.at.bucket, self.at.prefix + sub + "/" if sub else self.at.prefix, self.at.conn))

    # ---- metadata ----

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        at = self.at
        pages = at.conn.client.get_paginator("list_objects_v2").paginate(Bucket=at.bucket, Prefix=at.key(prefix))
        with at.errors("listing", prefix):
            for page in pages:
                for obj in page.get("Contents", []):
                    yield ObjectInfo(key=obj["Key"][len(at.prefix) :], size=obj["Size"], etag=obj.get("ETag"))

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self.at.call("reading metadata of", key, self.at.conn.client.head_object, Key=self.at.key(key),
                                ChecksumMode="ENABLED")
        except FileNotFoundError:
            return None
        # Only a FULL_OBJECT CRC64NVME is comparable with a manifest; any other checksum proves nothing here.
        return ObjectInfo(key=key, size=resp["ContentLength"], checksum=resp.get("ChecksumCRC64NVME"),
                          etag=resp.get("ETag"))

    def open_read(self, key: str) -> BinaryIO:
        """A buffered, seekable stream of the object (Parquet needs seeks); sequential reads are one streaming GET."""
        info = self.at.call("reading metadata of", key, self.at.conn.client.head_object, Key=self.at.key(key))
        return io.BufferedReader(_ObjectReader(self.at, key, info["ContentLength"], info.get("ETag")),
                                 buffer_size=s3_multipart.STREAM_CHUNK)

    def read_bytes(self, key: str) -> bytes:
        resp = self.at.call("reading", key, self.at.conn.client.get_object, Key=self.at.key(key))
        with self.at.errors("reading", key), resp["Body"] as body:
            return body.read()

    def delete(self, key: str) -> None:
        self.at.call("deleting", key, self.at.conn.client.delete_object, Key=self.at.key(key))

    def parent(self) -> S3Store | None:
        if not self.at.prefix:
            return None
        up = self.at.prefix.rstrip("/").rpartition("/")[0]
        return S3Store(S3Location(self.at.bucket, up + "/" if up else "", self.at.conn))

    def abort_partial_uploads(self, keys: Collection[str] | None = None) -> int:
        """Abort the unfinished multipart uploads of `keys` (their parts cost storage and prove nothing), or when None
        of every key under this prefix outside the roots of other artifacts below it; another artifact's are never
        touched."""
        at, client = self.at, self.at.conn.client
        uploads = []
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=at.bucket, Prefix=at.prefix)
        with at.errors("listing unfinished uploads under", ""):
            for page in pages:
                uploads += [(up["Key"], up["UploadId"]) for up in page.get("Uploads", [])]
        wanted = (lambda rel: rel in keys) if keys is not None else self._outside_other_roots()
        mine = [(key, upload_id) for key, upload_id in uploads if wanted(key[len(at.prefix) :])]
        with at.errors("aborting unfinished uploads under", ""):
            for key, upload_id in mine:
                client.abort_multipart_upload(Bucket=at.bucket, Key=key, UploadId=upload_id)
        return len(mine)

    def _outside_other_roots(self) -> Callable[[str], bool]:
        """Whether a key is outside every folder below this prefix that is another artifact's root."""
        roots = {info.key.rpartition("/")[0] for info in self.list() if info.key.rpartition("/")[2] in ROOT_MARKERS}
        roots.discard("")
        return lambda rel: not any(rel.startswith(root + "/") for root in roots)

    # ---- data ----

    def put_bytes(self, key: str, data: bytes) -> None:
        crc = b64(checksums.crc64nvme(data))
        self.at.call("writing", key, self.at.conn.client.put_object, Key=self.at.key(key), Body=data,
                     ChecksumCRC64NVME=crc)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        crc = b64(checksums.crc64nvme(data))
        created = True
        with self.at.errors("writing", key):
            try:
                self.at.conn.client.put_object(Bucket=self.at.bucket, Key=self.at.key(key), Body=data,
                                               ChecksumCRC64NVME=crc, IfNoneMatch="*")
            except ClientError as exc:
                if not is_precondition_failed(exc):
                    raise
                created = False
        return created

    def put_file(self, key: str, local_path: Path, checksum: str | None = None, over: str | None = None) -> None:
        """Upload in parts on the shared pool; the object appears only when whole and server-checked, and with `over`
        only if the key still holds what it names (If-Match / If-None-Match on the PUT or the completion).

        Raises StoreError when the bytes read differ from `checksum` (the local file changed or rotted), or when the
        key changed under `over`: the upload is then not completed.
        """
        s3_multipart.put_file(self.at, key, local_path, checksum, over)

    def checksum_by_reading(self, key: str) -> tuple[int, str]:
        """Every byte read back with ranged GETs in parallel (bounded memory) and checksummed; nothing is written."""
        return s3_multipart.read_checksum(self.at, key)

    def get_file(self, key: str, into: LocalFolder, as_key: str) -> tuple[int, str]:
        """Ranged GETs on the shared pool into a temp file renamed when whole; (size, base64 CRC64NVME) as received."""
        return s3_multipart.get_file(self.at, key, into, as_key)


class _ObjectReader(io.RawIOBase):
    """Reads one S3 object from a position: a streaming GET of `bytes=pos-`, reopened only after a seek.

    If-Match pins every GET to the version first seen, so a concurrent overwrite fails loudly instead of mixing.
    """

    def __init__(self, at: S3Location, key: str, size: int, etag: str | None) -> None:
        self._at, self._key, self._size, self._etag = at, key, size, etag
        self._pos = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: self._size + offset}[whence]
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        if target != self._pos:
            self._drop()
            self._pos = target
        return self._pos

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self._size or len(buffer) == 0:
            return 0
        at = self._at
        if self._body is None:
            extra = {"IfMatch": self._etag} if self._etag else {}
            resp = at.call("reading", self._key, at.conn.client.get_object, Key=at.key(self._key),
                           Range=f"bytes={self._pos}-", **extra)
            self._body = resp["Body"]
        with at.errors("reading", self._key):
            data = self._body.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self._pos += n
        return n

    def _drop(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def close(self) -> None:
        self._drop()
        super().close()
