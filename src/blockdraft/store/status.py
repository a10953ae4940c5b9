"""`status`: every artifact under a prefix, its kind, lineage and state, as read from the destination.

An artifact root is a folder holding a manifest. Files that no manifest covers form `incomplete` artifacts,
grouped under the highest folder below the surveyed prefix that contains no committed artifact (so `ckpt/step-200/`
beside a committed `ckpt/step-100/` is its own incomplete artifact). A tokenized artifact's target agreement, where
`tokenize --check-target` noted it for the manifest it holds (`read_agreement`), joins its counts. `--progress` renders
the same facts as Markdown. Every string read from the store (keys, a manifest's kind, counts and lineage, an agreement
record) is printed through `printable`, so none forges a line, a column or an artifact.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from blockdraft.config import StoreConfig
from blockdraft.errors import ConfigError, printable
from blockdraft.store import open_store
from blockdraft.store.artifact import (
    BYTES_READ_BACK,
    CHECKED_KINDS,
    LOCAL_CACHED,
    MANIFEST_NAME,
    ORIGIN_NAME,
    PIECES_DIR,
    SERVER_CHECKSUMS,
    InputRef,
    State,
    VerifyReport,
    verify_artifact,
)
from blockdraft.store.base import LEASE_NAME, WRITING_NAME, Store
from blockdraft.store.checksum_cache import batched_writes
from blockdraft.store.manifest import AGREEMENT_NAME, no_rows_measured, read_agreement


@dataclass
class ArtifactStatus:
    """One artifact: `root` is its key prefix relative to the status URL ('' = the URL itself)."""

    root: str
    url: str
    report: VerifyReport
    agreement: dict[str, Any] | None = None  # target agreement measured on this manifest's rows (`read_agreement`)

    @property
    def state(self) -> State:
        return self.report.state

    @property
    def kind(self) -> str:
        return self.report.manifest.kind if self.report.manifest else "-"

    @property
    def lineage(self) -> list[InputRef]:
        return self.report.manifest.lineage if self.report.manifest else []


# States in which an artifact's own files verified and nothing it was made from is known to have changed.
OK_STATES = (State.VERIFIED, State.UNREACHABLE, State.UNCHECKED)


def format_counts(a: ArtifactStatus) -> str:
    """The manifest's flat counts (rows, tokens, clipped rows, ...) as `k=v, ...`, `printable`; nested tables are left
    to the manifest."""
    manifest = a.report.manifest
    if manifest is None:
        return "-"
    parts = [f"{k}={v}" for k, v in sorted(manifest.counts.items()) if not isinstance(v, dict)]
    if a.agreement is not None and no_rows_measured(a.agreement):
        parts.append(f"target_agreement=no rows to measure ({a.agreement['target']})")
    elif a.agreement is not None:
        parts.append(f"target_agreement={a.agreement['agreement']:.3f} ({a.agreement['target']}, {a.agreement['rows']} "
                     "rows)")
    return printable(", ".join(parts) or "-")


def _plain(key: str) -> bool:
    """A key that splitting at its last '/' reads as `PurePosixPath` does (no empty, '.' or leading component): every
    key a local store lists and nearly every S3 key; the rest take the slow path."""
    return not ("//" in key or "/./" in key or key.startswith(("/", "./")) or key.endswith(("/", "/.")) or key == ".")


def _parent(key: str) -> str:
    if _plain(key):
        return key.rpartition("/")[0]
    parent = str(PurePosixPath(key).parent)
    return "" if parent == "." else parent


def _name(key: str) -> str:
    return key.rpartition("/")[2] if _plain(key) else PurePosixPath(key).name


def _ancestors(folder: str) -> list[str]:
    """`folder` and every folder above it, top ('') last: 'a/b' -> ['a/b', 'a', '']."""
    parts = folder.split("/") if folder else []
    return ["/".join(parts[:depth]) for depth in range(len(parts), 0, -1)] + [""]


def find_artifact_roots(keys: list[str]) -> tuple[list[str], list[str]]:
    """(committed roots, incomplete roots) among object keys, each root a '/'-joined folder ('' = top).

    A writer's lease, its mark of an output being written and a copy's origin record are bookkeeping beside an artifact,
    never one. A folder holding a stage's piece records (`PIECES_DIR`) is one artifact being written, whatever
    subfolders its files sit in. Linear in the keys times their depth: every question is a set lookup along one key's
    own folders.
    """
    keys = [k for k in keys if _name(k) not in (LEASE_NAME, ORIGIN_NAME, WRITING_NAME, AGREEMENT_NAME)]
    committed = {_parent(k) for k in keys if _name(k) == MANIFEST_NAME}
    # folders with a committed artifact at or below
    holds_committed = {a for root in committed for a in _ancestors(root)}
    in_progress = {
        k.split(f"{PIECES_DIR}/")[0].rstrip("/")
        for k in keys
        if k.startswith(f"{PIECES_DIR}/") or f"/{PIECES_DIR}/" in k
    }
    incomplete: set[str] = set()
    for key in keys:
        folders = _ancestors(_parent(key))  # deepest first
        if any(f in committed for f in folders):
            continue
        writing = next((f for f in folders if f in in_progress), None)
        if writing is not None:
            incomplete.add(writing)
            continue
        # The highest folder below the top on the key's path that holds no committed artifact; else the
        # key's own folder (files directly under the top belong to the top).
        candidates = folders[-2::-1] or [""]  # top-down, without the top itself
        incomplete.add(next((c for c in candidates if c not in holds_committed), candidates[-1]))
    return sorted(committed), sorted(incomplete)


def status(store: Store, deep: bool = False, store_config: StoreConfig | None = None) -> list[ArtifactStatus]:
    """Every artifact under `store`, verified from the destination; inputs checked too, transitively, for `stale` (an
    input's content changed) and `input unreachable here` (an input outside `store` that this machine cannot read).
    `deep` reads every byte of a remote store back instead of trusting the checksums its server stored. A local file
    unchanged since it was last read keeps the checksum cached then (a listing, not a read: `--deep` reads every byte).
    Inputs are opened with `store_config` (endpoint, profile, region), the settings `store` was opened with: an input on
    the same server resolves."""
    def open_url(url: str) -> Store:
        return open_store(url, store_config)

    keys = [info.key for info in store.list()]
    committed, incomplete = find_artifact_roots(keys)
    measured = {_parent(k) for k in keys if _name(k) == AGREEMENT_NAME}  # read only where the listing shows one
    out = []
    memo: dict[str, VerifyReport] = {}  # each artifact verified once, whether surveyed or an input of one
    with batched_writes():  # checksums newly read are remembered a thousand to a commit, not one each
        for root in sorted(committed + incomplete):
            child = store.child(root) if root else store
            report = verify_artifact(child, check_inputs=True, open_url=open_url, within=store.url, memo=memo,
                                     deep=deep, cached=True)
            agreement = read_agreement(child, report.manifest_sha256) if root in measured else None
            out.append(ArtifactStatus(root=root, url=child.url, report=report, agreement=agreement))
    return out


def format_lineage(refs: list[InputRef]) -> str:
    if not refs:
        return "-"
    parts = []
    for ref in refs:
        pin = f"sha256:{ref.sha256[:12]}" if ref.sha256 else f"{ref.size} B {ref.checksum or ref.etag or ''}".strip()
        unchecked = "" if ref.kind in CHECKED_KINDS else f", {ref.kind} rows: not checked"
        parts.append(f"{ref.url} ({pin}{unchecked})")
    return printable(", ".join(parts))


PAGE_TITLE = "# blockdraft status: "  # the first line of every page render_progress writes


def check_page(page: Path, store: Store | None = None, artifacts: Sequence[ArtifactStatus] = ()) -> None:
    """Refuse (one line) a status page that would land inside an artifact, whose files its manifest lists and checksums,
    or replace a file blockdraft did not write. Inside: below a folder holding a manifest or a writing mark, or below
    one of `artifacts` of the local `store` (an artifact being written has neither yet)."""
    where = page.resolve()
    for folder in where.parents:
        if any((folder / name).exists() for name in (MANIFEST_NAME, WRITING_NAME, LEASE_NAME)):
            raise ConfigError(f"--progress {page} lies inside the artifact {folder}, where it would change a listed "
                              "file or add an unlisted one; write the page outside every artifact")
    local = store.local_path() if store is not None else None
    if local is not None:
        for a in artifacts:
            root = (local / a.root).resolve()
            if where == root or root in where.parents:
                raise ConfigError(f"--progress {page} lies inside the artifact {a.url}; write the page outside every "
                                  "artifact")
    if where.is_file():
        with open(where, "rb") as f:
            first = f.read(len(PAGE_TITLE.encode()))
        if first != PAGE_TITLE.encode():
            raise ConfigError(f"--progress {page} is a file blockdraft did not write (it is not a status page); name a "
                              "new file or remove that one yourself")


def _cell(text: str) -> str:
    """A `printable` text as one cell of a Markdown table: its pipes escaped."""
    return text.replace("|", "\\|")


def render_progress(url: str, artifacts: list[ArtifactStatus]) -> str:
    """A Markdown status page; every claim on it was just read from the destination, and it says how."""
    now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    counts = {state: sum(a.state is state for a in artifacts) for state in State}
    methods = sorted({a.report.method for a in artifacts if a.report.method})
    how = {
        SERVER_CHECKSUMS: "each listed file's size and the CRC64NVME checksum its server stored at upload (HEAD; "
                          "`--deep` reads every byte back)",
        BYTES_READ_BACK: "each listed file's bytes read back and their CRC64NVME checksum recomputed",
        LOCAL_CACHED: "each listed file's bytes read back and their CRC64NVME checksum recomputed, or for a file "
                      "unchanged (size, mtime, ctime, inode) since it was last read the checksum cached then (`--deep` "
                      "reads every byte)",
    }
    lines = [
        f"{PAGE_TITLE}{url}",
        "",
        f"Checked at {now} at the destination: every manifest, and "
        f"{'; '.join(how.get(m, m) for m in methods) or 'no files'}.",
        "",
        ", ".join(f"{n} {state.value}" for state, n in counts.items() if n) or "no artifacts found",
        "",
        "| artifact | kind | state | files verified | bytes verified | counts | made from |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in artifacts:
        manifest = a.report.manifest
        listed = len(manifest.files) if manifest else 0
        lines.append(
            f"| `{_cell(printable(a.root or '.'))}` | {_cell(printable(a.kind))} | **{a.state.value}** | "
            f"{a.report.verified_files}/{listed} | {a.report.verified_bytes} | {_cell(format_counts(a))} | "
            f"{_cell(format_lineage(a.lineage))} |"
        )
    problems = [(a, p) for a in artifacts for p in a.report.problems]
    if problems:
        lines += ["", "## Problems", ""]
        lines += [f"- `{printable(a.root or '.')}`: {p.state.value}: `{printable(p.path)}`: {printable(p.detail)}"
                  for a, p in problems]
    incomplete = [a for a in artifacts if a.state is State.INCOMPLETE]
    if incomplete:
        lines += ["", "Incomplete means files without a manifest: an interrupted or running stage. Nothing in them is "
                      "verified.", ""]
    if any(a.state is State.UNREACHABLE for a in artifacts):
        lines += [
            "", f"{State.UNREACHABLE.value.capitalize()} means the artifact's own files verified, but an input it was "
                "made from is a folder that only another machine holds, so whether it changed cannot be checked from "
                "here.", "",
        ]
    if any(a.state is State.UNCHECKED for a in artifacts):
        lines += [
            "", f"{State.UNCHECKED.value.capitalize()} means the artifact's own files verified, but an input it was "
            "made from is pinned by the rows read through `datasets` from the hub, which status does not read again.",
            "",
        ]
    return "\n".join(lines) + "\n"
