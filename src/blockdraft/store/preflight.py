"""Preflight: prove in seconds that a store accepts writes, before any long stage writes to it.

Write a small probe object (with its checksum), read it back, compare, delete it. Each failure is one line
naming the cause: no credentials, wrong secret, no write permission, no such bucket, endpoint unreachable or stalled.
On S3 every request goes through the probe client (a few seconds' timeouts, one retry: `s3_client.PROBE_*`), so an
endpoint that accepts connections and never answers fails it in seconds; the transfers after it keep their long
timeouts.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from dataclasses import dataclass

from blockdraft.config import is_s3_url
from blockdraft.errors import StoreError
from blockdraft.store.base import Store

PROBE_PREFIX = ".blockdraft-preflight-"


@dataclass
class PreflightReport:
    url: str
    seconds: float

    def summary(self) -> str:
        return f"{self.url}: write, read back and delete of a probe object succeeded in {self.seconds:.2f} s"


def probing(store: Store) -> Store:
    """`store` with short timeouts: an S3 store's probing view (same bucket, prefix and credentials); others as they
    are."""
    if not is_s3_url(store.url):
        return store
    from blockdraft.store.s3 import S3Store  # imported here: only s3:// URLs pay for boto3

    if not isinstance(store, S3Store):
        return store
    return S3Store(dataclasses.replace(store.at, conn=store.at.conn.probing()))


def preflight(store: Store) -> PreflightReport:
    """Raise StoreError naming what is missing, or return how long the round trip took."""
    start = time.monotonic()
    store = probing(store)
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    data = f"blockdraft preflight {probe} pid {os.getpid()}\n".encode()
    try:
        # Listing first: it names a missing bucket before a write could create one (some servers auto-create).
        next(iter(store.list(PROBE_PREFIX)), None)
        store.put_bytes(probe, data)
        try:
            if store.read_bytes(probe) != data:
                raise StoreError(f"{store.url}: the probe object read back differs from what was written; the store "
                                 "corrupts data")
        finally:
            store.delete(probe)
    except FileNotFoundError:
        raise StoreError(f"{store.url}: the probe object vanished right after it was written; the store does not keep "
                         "writes") from None
    except PermissionError as exc:
        raise StoreError(f"no write permission on {store.url} ({exc.strerror}); fix the folder's permissions or choose "
                         "another") from None
    except OSError as exc:
        raise StoreError(f"cannot write to {store.url} ({exc.strerror or exc}); fix the path or free space") from None
    return PreflightReport(url=store.url, seconds=time.monotonic() - start)
