"""The manifest: what an artifact lists (its files by path, size and CRC64NVME), what it was made from, and the one rule
that keeps every listed path inside its artifact. Read and written here; verification is `artifact.py`'s.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from blockdraft import __version__
from blockdraft.errors import ArtifactError, control_characters
from blockdraft.store.base import BOOKKEEPING_PREFIX, ObjectInfo, Store, is_bookkeeping
from blockdraft.store.checksum import crc64nvme_file
from blockdraft.store.checksum_cache import file_checksum

MANIFEST_NAME = "blockdraft-manifest.json"
MANIFEST_FORMAT = "blockdraft-manifest/1"
# Beside the manifest of a local copy (pulled, or pushed from here): where the same manifest, byte for byte, lives in a
# store. Not listed in the manifest: it says where this copy came from or went, not what the artifact is.
ORIGIN_NAME = ".blockdraft-origin.json"
# Target agreement measured on a tokenized artifact's rows (`tokenize --check-target`), bound to its manifest's digest.
AGREEMENT_NAME = ".blockdraft-agreement.json"


PIECES_DIR = BOOKKEEPING_PREFIX + "pieces"  # a long stage's finished pieces, as sub-manifests (`output`)
INCOMING_DIR = BOOKKEEPING_PREFIX + "incoming"  # a pull's verified bytes, waiting until all of them are in (`transfer`)


def entry_path_problem(path: str) -> str | None:
    """Why `path` cannot name a file inside an artifact, or None when it can: a relative '/'-separated path below the
    artifact's root, with no empty, '.' or '..' part, no backslash, NUL or drive letter, not the manifest, and with no
    part named as blockdraft's bookkeeping (`base.is_bookkeeping`: leases, marks, pieces, origins, agreement records,
    temporary files). The one rule every manifest entry obeys wherever a manifest is read (a shared bucket may hold a
    planted one)."""
    if not path:
        return "is empty"
    if "\\" in path or "\0" in path:
        return "has a backslash or NUL byte"
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        return "is an absolute path"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' part"
    if path == MANIFEST_NAME or is_bookkeeping(path):
        return f"names blockdraft's own {next((p for p in parts if p.startswith(BOOKKEEPING_PREFIX)), path)}"
    return None


class FileEntry(BaseModel):
    path: str
    size: int = Field(ge=0)
    checksum: str  # base64 CRC64NVME

    @field_validator("path")
    @classmethod
    def _inside(cls, path: str) -> str:
        problem = entry_path_problem(path)
        if problem is not None:
            raise ValueError(f"entry {path!r} {problem}: it would leave the artifact or clash with its bookkeeping")
        return path


class InputRef(BaseModel):
    """One input of an artifact, by content.

    kind "manifest": another artifact the artifact was made from, pinned by the sha256 of its manifest bytes.
    kind "measured": another artifact pinned the same way, whose rows or figures the artifact only measured or cites (a
    checkpoint's train.eval_data, the eval an export's card gives): `status` checks its pin and its own files, and an
    artifact stale only through such inputs does not make what is made from it stale (`artifact._input_changed`).
    kind "raw": a file without a manifest (completions someone else uploaded), pinned by size and checksum/ETag.
    kind "folder": a folder without a manifest (a folder `datasets` saved, a published drafter), pinned by the sha256 of
    its files' paths, sizes and CRC64NVME checksums (`folder_sha256`).
    kind "dataset": rows read through `datasets` from the hub, pinned by the sha256 of those rows: `status` cannot read
    them again, and says so (`State.UNCHECKED`).
    """

    kind: str
    url: str
    sha256: str | None = None
    size: int | None = None
    checksum: str | None = None
    etag: str | None = None


class Manifest(BaseModel):
    format: str = MANIFEST_FORMAT
    kind: str
    created_at: str = Field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    tool_version: str = __version__
    config: dict[str, Any] = Field(default_factory=dict)
    lineage: list[InputRef] = Field(default_factory=list)
    files: list[FileEntry] = Field(default_factory=list)
    counts: dict[str, Any] = Field(default_factory=dict)

    @field_validator("format")
    @classmethod
    def _this_format(cls, value: str) -> str:
        if value != MANIFEST_FORMAT:
            raise ValueError(f"{value!r}, this blockdraft reads only {MANIFEST_FORMAT!r}")
        return value

    @model_validator(mode="after")
    def _unique_paths(self) -> Manifest:
        seen: set[str] = set()
        for entry in self.files:
            if entry.path in seen:
                raise ValueError(f"entry {entry.path!r} is listed twice")
            seen.add(entry.path)
        return self

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(store: Store) -> tuple[Manifest, bytes] | None:
    """The artifact's manifest as read from the destination, or None if there is none; ArtifactError for bytes that are
    not a blockdraft manifest (torn, edited, another tool's file)."""
    try:
        data = store.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        return None
    try:
        return Manifest.model_validate_json(data), data
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        raise ArtifactError(
            f"{store.url.rstrip('/')}/{MANIFEST_NAME} is not a valid blockdraft manifest "
            f"({where}: {first['msg'].removeprefix('Value error, ')}); "
            "re-run the stage (or push/pull) that wrote it"
        ) from None


def record_origin(local: Store, url: str, sha256: str) -> None:
    """Note in the local copy `local` that the artifact with manifest digest `sha256` is also at `url` (a store)."""
    local.put_bytes(ORIGIN_NAME, json.dumps({"url": url, "manifest_sha256": sha256}, sort_keys=True).encode() + b"\n")


def read_origin(store: Store, sha256: str | None) -> str | None:
    """The store URL that a local copy names as its origin, when it names one for this very manifest; else None
    (a record for another manifest is an old copy's, and a remote store is its own origin)."""
    if store.local_path() is None or sha256 is None:
        return None
    try:
        origin = json.loads(store.read_bytes(ORIGIN_NAME))
    except (FileNotFoundError, ValueError):
        return None
    if (
        not isinstance(origin, dict)
        or origin.get("manifest_sha256") != sha256
        or not isinstance(origin.get("url"), str)
    ):
        return None
    return origin["url"]


def record_agreement(store: Store, measured: str, target: str, result: dict[str, Any]) -> bool:
    """Note beside the artifact the target agreement measured on its rows (`blockdraft.data.agreement`) against the
    target named `target`, bound to `measured`: the digest of the manifest the folder held when its rows were read (a
    measurement about the rows, not one of its files). False, and nothing written, unless the folder still holds that
    very manifest: another run that wrote the folder while the rows were measured made an artifact this is not of."""
    found = read_manifest(store)
    if found is None or manifest_sha256(found[1]) != measured:
        return False
    _put_agreement(store, {"manifest_sha256": measured, "target": target, **result})
    return True


def no_rows_measured(record: dict[str, Any]) -> bool:
    """Whether an agreement record says nothing was measured (no train row with a supervised token): no share, and no
    positions or rows. Shown as such, never as a share of 0."""
    counts = [record.get(name) for name in ("positions", "rows")]
    return record.get("agreement") is None and all(type(n) is int and n == 0 for n in counts)


def _put_agreement(store: Store, record: dict[str, Any]) -> None:
    store.put_bytes(AGREEMENT_NAME, json.dumps(record, sort_keys=True).encode() + b"\n")


def read_agreement(store: Store, sha256: str | None) -> dict[str, Any] | None:
    """The agreement record beside the artifact when it was measured on this very manifest; else None (a record
    written before the artifact was made again says nothing about the rows it holds now)."""
    if sha256 is None:
        return None
    try:
        record = json.loads(store.read_bytes(AGREEMENT_NAME))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("manifest_sha256") != sha256:
        return None
    return record if agreement_problem(record) is None else None


MAX_TARGET_CHARS = 256  # a target's name in an agreement record: a folder name or hub id, never a text


def agreement_problem(record: dict[str, Any]) -> str | None:
    """Why `record` (its manifest pin aside) is not an agreement record as `record_agreement` writes it, or None: the
    share a finite number in [0, 1], the positions and rows counted by non-negative integers, the same for each thinking
    mode (`by_thinking`, if there), and the target a name of one line (no control character: a newline in it would forge
    a line of `status`). A record with any other value is not shown: it was not measured as it says."""
    def figures_problem(figures: Any, where: str) -> str | None:
        if not isinstance(figures, dict):
            return f"{where} is not a table"
        share = figures.get("agreement")
        if no_rows_measured(figures):
            return None
        if (
            isinstance(share, bool)
            or not isinstance(share, float | int)
            or not math.isfinite(share)
            or not 0 <= share <= 1
        ):
            return f"{where}agreement {share!r} is not a share in [0, 1]"
        counts = [figures.get(name) for name in ("positions", "rows")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            return f"{where}positions and rows {counts} are not counts"
        return None

    target = record.get("target")
    if not isinstance(target, str) or not target or len(target) > MAX_TARGET_CHARS or control_characters(target):
        return f"target {target!r} is not a target's name"
    modes = record.get("by_thinking", {})
    if not isinstance(modes, dict):
        return "by_thinking is not a table"
    problems = [figures_problem(record, ""), *(figures_problem(v, f"by_thinking.{k}.") for k, v in modes.items())]
    return next((p for p in problems if p is not None), None)


def carry_agreement(source: Store, dest: Store, sha256: str) -> None:
    """A copy of the artifact (push, pull) carries its agreement record when one was measured on this manifest."""
    record = read_agreement(source, sha256)
    if record is not None:
        _put_agreement(dest, record)


def raw_input(store: Store, info: ObjectInfo) -> InputRef:
    return InputRef(kind="raw", url=f"{store.url.rstrip('/')}/{info.key}", size=info.size, checksum=info.checksum,
                    etag=info.etag)


MEASURED = "measured"  # the lineage kind of an input whose rows or figures an artifact measured or cites (`InputRef`)


def measured(ref: InputRef) -> InputRef:
    """`ref` (an artifact's manifest pin) as an input the artifact only measured or cites, not one it was made from."""
    return ref.model_copy(update={"kind": MEASURED})


def folder_sha256(store: Store) -> str | None:
    """sha256 over every file in the folder `store` (sorted by path: path, size and CRC64NVME each; blockdraft's own
    bookkeeping left out), or None when it holds no file. A local file unchanged since it was last read keeps the
    checksum cached then; a remote object without a stored checksum is read back."""
    pins = [[info.key, *_file_pin(store, info.key)] for info in sorted(store.list(), key=lambda i: i.key)
            if not is_bookkeeping(info.key)]
    return hashlib.sha256(json.dumps(pins).encode()).hexdigest() if pins else None


def _file_pin(store: Store, key: str) -> tuple[int | None, str | None]:
    """(size, CRC64NVME) of one file of a folder input; (None, None) when it is gone since listed (the folder is
    changing, and the pin says so). A local file is read through its links, as the stage that reads the folder does: a
    snapshot in the Hub's cache links its files to blobs outside it (this folder is an input, never an artifact written
    here)."""
    local = store.local_path()
    if local is not None:
        try:
            return file_checksum(local / key)
        except FileNotFoundError:
            return None, None
    head = store.head(key)
    if head is None:
        return None, None
    return head.size, head.checksum if head.checksum is not None else store.checksum_by_reading(key)[1]


def folder_input(store: Store) -> InputRef:
    """The folder `store` (no manifest) as an input, pinned by `folder_sha256`; ArtifactError when it holds no file."""
    digest = folder_sha256(store)
    if digest is None:
        raise ArtifactError(f"{store.url} holds no file; check the path")
    return InputRef(kind="folder", url=store.url, sha256=digest)


def entry_for_local_file(root: Path, path: Path) -> FileEntry:
    """The manifest entry of local file `path` under `root`: its '/'-separated relative path, size and checksum."""
    size, checksum = crc64nvme_file(path)
    return FileEntry(path=path.relative_to(root).as_posix(), size=size, checksum=checksum)
