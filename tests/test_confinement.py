"""A manifest's entries stay inside their artifact: no '..', no absolute path, no backslash, no duplicate, no
bookkeeping name, no symlink out of the folder. A violating manifest is `corrupt` with the entry named, wherever it is
read (verify, status, push, pull, a stage input), and nothing outside the artifact is read or written for it."""

from __future__ import annotations

import json
import os

import pytest
from helpers.artifacts import commit_files
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.errors import ArtifactError, OutsideArtifactError
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, entry_path_problem, verify_artifact
from blockdraft.store.inputs import open_input
from blockdraft.store.local import LocalStore
from blockdraft.store.transfer import pull, push

CLIMB = "/".join(["..", "..", "victim.txt"])  # an entry that climbs two folders out of its artifact


def _plant(art, *entries: dict) -> None:
    """Add raw entries to the committed manifest of `art`, as someone with write access to a shared bucket could."""
    data = json.loads((art / MANIFEST_NAME).read_text())
    data["files"] += list(entries)
    (art / MANIFEST_NAME).write_text(json.dumps(data))


def _entry_of(path, name: str) -> dict:
    """A valid-looking entry for `name` with the size and checksum of the real file at `path`."""
    from blockdraft.store.checksum import crc64nvme_file

    size, checksum = crc64nvme_file(path)
    return {"path": name, "size": size, "checksum": checksum}


@pytest.mark.parametrize(
    ("path", "why"),
    [
        (CLIMB, "'..' part"),
        ("/etc/hostname", "absolute path"),
        ("a\\..\\b", "backslash"),
        ("C:/x", "absolute path"),
        ("a//b", "empty"),
        ("./a", "'.'"),
        ("", "empty"),
        (".blockdraft-lease.json", "own .blockdraft-lease.json"),
        (".blockdraft-pieces/x.json", "own .blockdraft-pieces"),
        (MANIFEST_NAME, f"own {MANIFEST_NAME}"),
    ],
)
def test_the_rule_names_each_kind_of_escape(path, why):
    problem = entry_path_problem(path)
    assert problem is not None and why in problem


def test_ordinary_entries_pass():
    for path in ("model.safetensors", "train/shard-00000.arrow", "a..b/c.json", ".hidden/x",
                 "step-00000002/config.json"):
        assert entry_path_problem(path) is None


def test_a_path_escape_is_corrupt_and_push_writes_nothing_outside_the_destination(tmp_path):
    src = commit_files(tmp_path / "src", {"a.bin": b"a" * 64})
    victim = tmp_path / "d1" / "victim.txt"
    victim.parent.mkdir()
    victim.write_bytes(b"the user's own file")
    payload = tmp_path / "src" / "evil.txt"
    payload.write_bytes(b"overwritten!")
    _plant(src, _entry_of(payload, CLIMB))

    report = verify_artifact(open_store(src))
    assert report.state is State.CORRUPT and CLIMB in report.summary()
    with pytest.raises(ArtifactError, match=r"\.\./\.\./victim\.txt"):
        push(src, f"file://{tmp_path}/d1/d2/dst")
    assert victim.read_bytes() == b"the user's own file"
    assert not (tmp_path / "d1" / "d2" / "dst").exists()

    result = CliRunner().invoke(app, ["push", str(src), f"file://{tmp_path}/d1/d2/dst"])
    assert result.exit_code == 2 and "Traceback" not in result.output and CLIMB in result.output
    assert victim.read_bytes() == b"the user's own file"


def test_an_absolute_entry_is_corrupt_not_counted(tmp_path):
    src = commit_files(tmp_path / "src", {"a.bin": b"a" * 64, "b.bin": b"b" * 64, "c.bin": b"c" * 64})
    # a path longer than a terminal line: the corrupt line must name it whole, not broken at the console's width
    outside = tmp_path / ("a-folder-with-a-long-name-" * 4) / "outside.txt"
    outside.parent.mkdir()
    outside.write_bytes(b"somebody else's file")
    _plant(src, _entry_of(outside, str(outside)))

    result = CliRunner().invoke(app, ["verify", str(src)])
    assert result.exit_code != 0 and "corrupt" in result.output and str(outside) in result.output
    assert "verified: 4 files" not in result.output
    with pytest.raises(ArtifactError, match="absolute path"):
        open_input(str(src))


def test_a_duplicate_entry_is_corrupt(tmp_path):
    src = commit_files(tmp_path / "src", {"a.bin": b"a" * 64})
    _plant(src, _entry_of(src / "a.bin", "a.bin"))
    report = verify_artifact(open_store(src))
    assert report.state is State.CORRUPT and "'a.bin' is listed twice" in report.summary()


def test_a_symlink_out_of_the_artifact_is_corrupt_and_never_read(tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_bytes(b"not part of any artifact")
    src = commit_files(tmp_path / "src", {"a.bin": b"a" * 64})
    os.symlink(outside, src / "link.txt")
    _plant(src, _entry_of(outside, "link.txt"))
    report = verify_artifact(open_store(src))
    assert report.state is State.CORRUPT and "link.txt resolves outside" in report.summary()
    with pytest.raises(ArtifactError, match="link.txt resolves outside"):
        pull(f"file://{src}", tmp_path / "pulled-link")
    assert not (tmp_path / "pulled-link" / "link.txt").exists()

    folder = commit_files(tmp_path / "src2", {"a.bin": b"a" * 64})
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "w.bin").write_bytes(b"w" * 8)
    os.symlink(tmp_path / "elsewhere", folder / "sub")
    _plant(folder, _entry_of(tmp_path / "elsewhere" / "w.bin", "sub/w.bin"))
    assert verify_artifact(open_store(folder)).state is State.CORRUPT
    with pytest.raises(ArtifactError, match="sub/w.bin"):  # its folder is a link, so the folder's listing lacks it
        pull(f"file://{folder}", tmp_path / "pulled")
    assert not (tmp_path / "pulled" / MANIFEST_NAME).exists()


def test_a_store_never_writes_through_a_symlinked_folder(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(tmp_path / "elsewhere", dest / "train")
    store = LocalStore(dest)
    with pytest.raises(OutsideArtifactError, match="resolves outside"):
        store.put_bytes("train/x.arrow", b"data")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_planted_manifest_in_a_bucket_is_refused_by_pull(s3_env, tmp_path):
    s3_server = s3_env
    from helpers.artifacts import Destination

    dest = Destination.s3(s3_server)
    src = commit_files(tmp_path / "src", {"a.bin": b"a" * 64})
    push(src, dest.url, dest.settings)
    data = json.loads((src / MANIFEST_NAME).read_text())
    data["files"].append({"path": "/".join(["..", "..", "..", "victim.txt"]), "size": 64,
                          "checksum": data["files"][0]["checksum"]})
    dest.overwrite(MANIFEST_NAME, json.dumps(data).encode())

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's own file")
    out = tmp_path / "a" / "b" / "pulled"
    with pytest.raises(ArtifactError, match=r"\.\./\.\./\.\./victim\.txt"):
        pull(dest.url, out, dest.settings)
    assert victim.read_bytes() == b"the user's own file"
    result = CliRunner().invoke(app, ["status", dest.url, "--endpoint-url", s3_server.endpoint])
    assert "corrupt" in result.output and "Traceback" not in result.output
