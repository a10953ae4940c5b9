"""Stores (local folder, S3) and the artifact/manifest rule every stage uses."""

from __future__ import annotations

from pathlib import Path

from blockdraft.errors import StoreError
from blockdraft.store.base import ObjectInfo, Store


def open_store(url: str | Path, settings: object | None = None) -> Store:
    """A store rooted at `url`: `s3://bucket/prefix`, `file://path` or a plain path.

    `settings` is a `blockdraft.config.StoreConfig` (endpoint, region, profile); the S3 backend also reads
    the standard AWS chain, after any explicit settings.
    """
    url = str(url)
    if url.startswith("s3://"):
        from blockdraft.store.s3 import S3Store

        return S3Store.from_url(url, settings)
    if "://" in url and not url.startswith("file://"):
        scheme = url.split("://", 1)[0]
        raise StoreError(f"unsupported store URL scheme '{scheme}://' in {url}; use s3://bucket/prefix, file://path or a plain path")
    from blockdraft.store.local import LocalStore

    return LocalStore(url.removeprefix("file://"))


__all__ = ["ObjectInfo", "Store", "StoreError", "open_store"]
