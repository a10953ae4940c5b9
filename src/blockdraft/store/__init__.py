"""Stores (local folder, S3) and the artifact/manifest rule every stage uses."""

from __future__ import annotations

from pathlib import Path

from blockdraft.config import StoreConfig, is_s3_url, store_url_problem
from blockdraft.errors import StoreError
from blockdraft.store.base import ObjectInfo, Store
from blockdraft.store.local import LocalStore


def open_store(url: str | Path, store_config: StoreConfig | None = None) -> Store:
    """A store rooted at `url`: `s3://bucket/prefix`, `file://path` or a plain path.

    `store_config` (None: the defaults) gives the S3 endpoint, region, profile, part size and concurrency; the S3
    backend also reads the standard AWS chain for what it leaves unset.
    """
    url = str(url)
    problem = store_url_problem(url)
    if problem:
        raise StoreError(problem)
    if is_s3_url(url):
        # Imported here, not at the top: boto3 takes ~0.4 s to import and only s3:// URLs need it.
        from blockdraft.store.s3 import S3Store

        return S3Store.from_url(url, store_config)
    return LocalStore(url.removeprefix("file://"))


__all__ = ["ObjectInfo", "Store", "StoreError", "open_store"]
