"""Checksums of local files, computed once per byte: a file's CRC64NVME is remembered with its size, mtime (ns), inode and
device, and trusted again only while all four are unchanged (how git's index and rsync's quick check decide).

The cache is one SQLite file per user (`$BLOCKDRAFT_CACHE_DIR`, else `$XDG_CACHE_HOME/blockdraft`, else
`~/.cache/blockdraft`), shared by every blockdraft process on the machine. A file modified within `RACY_S` of being read
is not remembered (a filesystem with coarse timestamps could change it again without changing its mtime); `--deep`
ignores the cache and reads every byte. Anything wrong with the cache (unwritable, locked, corrupt) only means the file is
read again: a cached value is never needed for correctness.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

from blockdraft.store.checksum import crc64nvme_file

RACY_S = 2.0
_local = threading.local()


def cache_path() -> Path:
    base = os.environ.get("BLOCKDRAFT_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "blockdraft")
    return Path(base) / "crc64nvme.sqlite"


def _db() -> sqlite3.Connection | None:
    """This thread's connection to the cache (None when it cannot be opened: files are then simply read)."""
    path = cache_path()
    conn = getattr(_local, "conn", None)
    if conn is not None and getattr(_local, "path", None) == path:
        return conn
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=2.0)
        # WAL without a sync per insert: a cache entry lost in a power cut only means a file is read again.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS sums (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, ino INTEGER, dev INTEGER, crc TEXT)"
        )
    except (OSError, sqlite3.Error):
        return None
    _local.conn, _local.path = conn, path
    return conn


def file_checksum(path: Path) -> tuple[int, str]:
    """(size, base64 CRC64NVME) of a local file: from the cache when the file is unchanged since it was last read, else
    read (and remembered unless it was modified in the last `RACY_S` seconds)."""
    st = path.stat()
    key = str(path.absolute())
    db = _db()
    if db is not None:
        try:
            row = db.execute("SELECT size, mtime_ns, ino, dev, crc FROM sums WHERE path = ?", (key,)).fetchone()
        except sqlite3.Error:
            row = None
        if row is not None and tuple(row[:4]) == (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev):
            return st.st_size, row[4]
    size, crc = crc64nvme_file(path)
    after = path.stat()
    unchanged = (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino) and size == st.st_size
    if db is not None and unchanged and time.time() - st.st_mtime_ns / 1e9 > RACY_S:
        try:
            with db:
                db.execute("INSERT OR REPLACE INTO sums VALUES (?, ?, ?, ?, ?, ?)", (key, size, st.st_mtime_ns, st.st_ino, st.st_dev, crc))
        except sqlite3.Error:
            pass
    return size, crc


__all__ = ["RACY_S", "cache_path", "file_checksum"]
