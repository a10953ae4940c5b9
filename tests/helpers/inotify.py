"""Which files of a folder the kernel saw read: inotify's IN_ACCESS events, through libc (Linux only)."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

IN_ACCESS = 0x00000001
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name


class ReadWatch:
    """Watches the folders given (not their subfolders); `names_read()` drains the names of the files read since."""

    def __init__(self, *folders: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        for folder in folders:
            if self._libc.inotify_add_watch(self._fd, str(folder).encode(), IN_ACCESS) < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder} failed")

    def names_read(self) -> set[str]:
        names: set[str] = set()
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return names
            at = 0
            while at < len(data):
                _, mask, _, length = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0").decode()
                if mask & IN_ACCESS and name:
                    names.add(name)
                at += _EVENT.size + length

    def close(self) -> None:
        os.close(self._fd)
