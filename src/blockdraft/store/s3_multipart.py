"""The S3 data path: whole-file uploads in parts and ranged parallel downloads, on the connection's shared part pool.

Our own part scheduler over the plain boto3 client. Each part is read once; its CRC64NVME is computed on the bytes in
memory, sent with the part so the server rejects corruption, and folded (crc combine) into the full-object checksum,
which goes with the upload too (single PUT or CompleteMultipartUpload, ChecksumType FULL_OBJECT). Downloads stream
ranged GETs into a temp file and fold the range checksums the same way, so no file is read twice. Memory: at most
`concurrency` parts of `part_size` bytes in flight, shared by every file of the store.

Why not a library (2026-12-05, `python -m bench.transfer_libraries --gib 1 --files 8 --repeats 3`, run twice: the same
parts and concurrency for all, a local SeaweedFS, load average 0.8-1.0 before and 3.0-3.7 after on 2 shared cores;
docs/PERFORMANCE.md, transfer). Throughput against s5cmd in the same round, median of 3 rounds per run, run 1 / run 2,
with the file's CRC64NVME checked on the way down: up, this module 1.23 / 1.34, boto3's classic transfer manager 1.37 /
1.26, awscrt's S3Client 1.07 / 1.24, obstore 1.27 / 1.25; down, this module 0.90 / 1.52, awscrt 0.67 / 1.11, obstore
0.56 / 0.76, boto3 0.51 / 0.65. Uploads are alike within the rounds' spread; downloads are ours by a margin. boto3
cannot make an upload conditional (s3transfer refuses IfMatch / IfNoneMatch), reads each part twice (checksum, then
send) and checks no download; obstore sends no full-object value of the caller's, puts conditionally only in one PUT
and checks no download; awscrt does the whole job (conditional completion, full-object CRC64NVME both ways, O_DIRECT)
but at about 1 GiB of RSS, with its own errors and credentials. boto3's CRT transfer manager ignores `endpoint_url` (it
always goes to AWS over TLS): it cannot reach a local or IP endpoint.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future
from pathlib import Path

from awscrt import checksums

from blockdraft.errors import StoreError
from blockdraft.store.base import ABSENT, LocalFolder, NewFile
from blockdraft.store.s3_client import MIB, SERVER_COPY_DAMAGED, S3Location, b64

STREAM_CHUNK = 1 * MIB
# O_DIRECT writes are whole blocks at block-aligned offsets from aligned memory; 4 KiB covers 512 B and 4 KiB devices.
DIRECT_ALIGN = 4096
_local = threading.local()


def _ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each part of a `size`-byte object, in order."""
    return [(offset, min(part_size, size - offset)) for offset in range(0, size, part_size)]


def _fold(crcs: list[int], ranges: list[tuple[int, int]]) -> int:
    """The full-object CRC64NVME from the CRCs of consecutive ranges."""
    full = 0
    for crc, (offset, length) in zip(crcs, ranges):
        full = crc if offset == 0 else checksums.combine_crc64nvme(full, crc, length)
    return full


def _corrupt_local(path: Path, got: str, expected: str | None) -> StoreError:
    return StoreError(f"local file {path.name} does not match its expected checksum (crc64nvme {got} != {expected}); "
                      "the local artifact is corrupt")


# ---------------------------------------------------------------------------------------------- uploads


def put_file(at: S3Location, key: str, local_path: Path, expected: str | None, over: str | None = None) -> None:
    """Upload a local file to `key`: one PUT up to a part, else a multipart upload; the object appears only when whole,
    and with `over` only if `key` still holds the object of that etag (ABSENT: none).

    Raises StoreError when the bytes read differ from `expected` (the local file changed or rotted), or when the key
    changed under `over`: the upload is then not completed.
    """
    path = Path(local_path)
    size = os.path.getsize(path)
    condition = {} if over is None else {"IfNoneMatch": "*"} if over == ABSENT else {"IfMatch": over}
    if size <= at.conn.part_size:
        at.conn.pool.submit(_put_single, at, key, path, size, expected, condition).result()
    else:
        _put_multipart(at, key, path, size, expected, condition)


def _put_single(at: S3Location, key: str, path: Path, size: int, expected: str | None, condition: dict) -> None:
    with open(path, "rb") as f:
        data = f.read()
    crc = b64(checksums.crc64nvme(data))
    if len(data) != size or (expected is not None and crc != expected):
        raise _corrupt_local(path, crc, expected)
    at.call("uploading", key, at.conn.client.put_object, Key=at.key(key), Body=data, ChecksumCRC64NVME=crc, **condition)


def _put_part(
    at: S3Location, key: str, upload_id: str, number: int, fd: int, offset: int, length: int
) -> tuple[int, dict]:
    """Upload part `number` (bytes [offset, offset+length) of `fd`); returns its CRC and its CompleteMultipartUpload
    entry."""
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise StoreError(f"local file for {key} shrank while uploading; rerun the push")
    crc = checksums.crc64nvme(data)
    resp = at.call(
        "uploading a part of", key, at.conn.client.upload_part,
        Key=at.key(key), UploadId=upload_id, PartNumber=number, Body=data, ChecksumCRC64NVME=b64(crc),
    )
    return crc, {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC64NVME": b64(crc)}


def _put_multipart(at: S3Location, key: str, path: Path, size: int, expected: str | None, condition: dict) -> None:
    client = at.conn.client
    created = at.call(
        "starting an upload of", key, client.create_multipart_upload, Key=at.key(key), ChecksumAlgorithm="CRC64NVME",
        ChecksumType="FULL_OBJECT"
    )
    upload_id = created["UploadId"]
    ranges = _ranges(size, at.conn.part_size)
    fd = os.open(path, os.O_RDONLY)
    futures: list[Future] = []
    try:
        for number, (offset, length) in enumerate(ranges, start=1):
            futures.append(at.conn.pool.submit(_put_part, at, key, upload_id, number, fd, offset, length))
        results = [f.result() for f in futures]
        full = b64(_fold([crc for crc, _ in results], ranges))
        if expected is not None and full != expected:
            raise _corrupt_local(path, full, expected)
        at.call(
            "completing the upload of", key, client.complete_multipart_upload,
            Key=at.key(key), UploadId=upload_id, MultipartUpload={"Parts": [part for _, part in results]},
            ChecksumCRC64NVME=full, ChecksumType="FULL_OBJECT", **condition,
        )
    except BaseException:
        _settle(futures)
        try:
            client.abort_multipart_upload(Bucket=at.bucket, Key=at.key(key), UploadId=upload_id)
        except Exception:  # the server may be gone; a later push aborts leftovers (abort_partial_uploads)
            pass
        raise
    finally:
        os.close(fd)


def _settle(futures: list[Future]) -> None:
    """Cancel what has not started and wait for what has, so no part still reads the file once it is closed."""
    for f in futures:
        f.cancel()
    for f in futures:
        if not f.cancelled():
            f.exception()


# ---------------------------------------------------------------------------------------------- downloads


def get_file(at: S3Location, key: str, into: LocalFolder, as_key: str) -> tuple[int, str]:
    """Ranged GETs on the shared pool, written at their offsets into a temp file of `into` renamed to `as_key` when
    whole.

    Returns (size in bytes, base64 CRC64NVME) of the bytes received. If-Match pins every range to the same object
    version. No preallocation: writing into fallocated (unwritten) ext4 extents measured slower here;
    `pull` checks free space before it starts instead. Whole aligned blocks go through a second, O_DIRECT descriptor
    where the file system offers one (`_open_direct`), the rest through the buffered one.
    """
    info = at.call("reading metadata of", key, at.conn.client.head_object, Key=at.key(key))
    size, etag = info["ContentLength"], info.get("ETag")
    with into.writing(as_key) as new:
        direct = _open_direct(new)
        try:
            ranges = _ranges(size, at.conn.part_size)
            futures = [
                at.conn.pool.submit(_get_range, at, key, etag, (new.fd, direct), offset, length)
                for offset, length in ranges
            ]
            try:
                crcs = [f.result() for f in futures]
            except BaseException:
                _settle(futures)
                raise
        finally:
            if direct >= 0:
                os.close(direct)
        # No fsync: a crash can leave the page cache unwritten, but every reader verifies checksums, so
        # such a file shows as corrupt, never as verified.
    return size, b64(_fold(crcs, ranges))


def _open_direct(new: NewFile) -> int:
    """A second descriptor of `path` with O_DIRECT, or -1 where the file system (or platform) has none.

    Why: buffered writes copy every byte into freshly allocated page-cache pages, and on this VM first-touching those
    pages measured 1.3-1.5 CPU-s per GiB (host-side faults) against 0.2 when the kernel reuses recently freed ones;
    O_DIRECT writes go from the reused chunk buffer to the device and touch no new page.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return new.reopen(os.O_WRONLY | flag)
    except OSError:
        return -1


def _write_at(fd: int, data: bytes | memoryview, pos: int, direct: int = -1) -> None:
    """Write all of `data` at `pos`. A short write (a disk that filled, or a file-size limit reached, mid-chunk) is
    retried for the rest, which raises the OSError: the checksum covers `data` whole, so a hole left by an unchecked
    short write would be zeros on disk under a checksum that verified.

    With `direct` (an O_DIRECT descriptor of the same file; `data` must then start page-aligned), whole DIRECT_ALIGN
    blocks at aligned offsets go through it and the unaligned rest through `fd`; a direct write the file system
    refuses (EINVAL: a stricter alignment) is written through `fd` instead.
    """
    view = memoryview(data)
    while view:
        whole = len(view) - len(view) % DIRECT_ALIGN if direct >= 0 and pos % DIRECT_ALIGN == 0 else 0
        try:
            written = os.pwrite(direct, view[:whole], pos) if whole else os.pwrite(fd, view, pos)
        except OSError as exc:
            if not whole or exc.errno != errno.EINVAL:
                raise
            direct, written = -1, os.pwrite(fd, view, pos)
        if written <= 0:
            raise OSError(errno.EIO, f"a write at offset {pos} made no progress")
        view, pos = view[written:], pos + written


def read_checksum(at: S3Location, key: str) -> tuple[int, str]:
    """(size, base64 CRC64NVME) of the object's bytes as read back: ranged GETs on the shared pool, each streamed in
    `STREAM_CHUNK` pieces and dropped once checksummed, so memory stays bounded whatever the object's size."""
    info = at.call("reading metadata of", key, at.conn.client.head_object, Key=at.key(key))
    size, etag = info["ContentLength"], info.get("ETag")
    ranges = _ranges(size, at.conn.part_size)
    futures = [at.conn.pool.submit(_get_range, at, key, etag, None, offset, length) for offset, length in ranges]
    try:
        crcs = [f.result() for f in futures]
    except BaseException:
        _settle(futures)
        raise
    return size, b64(_fold(crcs, ranges))


def _chunk_buffer() -> memoryview:
    """This thread's reusable STREAM_CHUNK receive buffer: page-aligned (an anonymous mmap), as O_DIRECT needs, and
    reused so no chunk allocates fresh memory. At most one per pool thread: `concurrency` x STREAM_CHUNK in all."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(mmap.mmap(-1, STREAM_CHUNK))
    return buf


def _get_range(at: S3Location, key: str, etag: str | None, fds: tuple[int, int] | None, offset: int,
               length: int) -> int:
    """Stream bytes [offset, offset+length) of the object into the file at the same offset (`fds`: its buffered and
    O_DIRECT descriptors, -1 for none; None: only read them); returns their CRC64NVME.

    Each chunk is received into this thread's buffer, filled whole (so every chunk starts block-aligned), checksummed
    and written from there; nothing is read back."""
    extra = {"IfMatch": etag} if etag else {}
    resp = at.call("downloading", key, at.conn.client.get_object, Key=at.key(key),
                   Range=f"bytes={offset}-{offset + length - 1}", **extra)
    buf = _chunk_buffer()
    crc = 0
    pos, end = offset, offset + length
    with at.errors("downloading", key), resp["Body"] as body:
        while pos < end:
            want = min(STREAM_CHUNK, end - pos)
            got = 0
            while got < want and (n := body.readinto(buf[got:want])):
                got += n
            if not got:
                break
            # awscrt reads any buffer, no copy
            crc = checksums.crc64nvme(buf[:got], crc)  # pyright: ignore[reportArgumentType]
            if fds is not None:
                _write_at(fds[0], buf[:got], pos, fds[1])
            pos += got
            if got < want:
                break
    if pos != end:
        raise StoreError(f"the server stopped sending {at.url}{key} after {pos - offset} of {length} bytes at offset "
                         f"{offset} (its connection was cut, or it could not read its stored copy); "
                         f"{SERVER_COPY_DAMAGED}")
    return crc
