"""The artifact/manifest core on the local-folder store: commit last, verify from the destination, five states."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.errors import ArtifactError
from blockdraft.store import open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    State,
    commit_artifact,
    entry_for_local_file,
    read_manifest,
    uncommit,
    verify_artifact,
)
from blockdraft.store.checksum import crc64nvme_bytes
from blockdraft.store.inputs import open_input


def test_crc64nvme_matches_s3_reference_value():
    # S3's documented CRC64NVME of "123456789" is 0xAE8B14860A799888.
    assert crc64nvme_bytes(b"123456789") == "rosUhgp5mIg="


@pytest.mark.fault
def test_verified_then_each_failure_state(tmp_path, make_artifact):
    make_artifact(tmp_path, {"a.bin": b"alpha" * 100, "sub/b.bin": b"beta"})
    store = open_store(tmp_path)
    assert verify_artifact(store).state is State.VERIFIED

    data = bytearray((tmp_path / "a.bin").read_bytes())
    data[7] ^= 0x01
    (tmp_path / "a.bin").write_bytes(bytes(data))
    report = verify_artifact(store)
    assert report.state is State.CORRUPT
    assert report.problems[0].path == "a.bin"

    (tmp_path / "sub/b.bin").unlink()
    assert verify_artifact(store).state is State.MISSING

    uncommit(store)
    assert verify_artifact(store).state is State.INCOMPLETE


def test_a_manifest_of_another_format_is_refused_with_one_line(tmp_path, make_artifact):
    make_artifact(tmp_path, {"a.bin": b"alpha"})
    manifest = tmp_path / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"blockdraft-manifest/1"', '"blockdraft-manifest/0"'))
    with pytest.raises(ArtifactError, match=r"format: .*'blockdraft-manifest/0', this blockdraft reads only .*re-run "
                                            r"the stage") as caught:
        read_manifest(open_store(tmp_path))
    assert "\n" not in str(caught.value)


@pytest.mark.fault
def test_stale_when_input_manifest_changes(tmp_path, make_artifact):
    src, out = tmp_path / "src", tmp_path / "out"
    make_artifact(src, {"x": b"1"})
    make_artifact(out, {"y": b"2"}, lineage=[open_input(open_store(src)).ref])
    assert verify_artifact(open_store(out), check_inputs=True).state is State.VERIFIED
    make_artifact(src, {"x": b"changed"})
    report = verify_artifact(open_store(out), check_inputs=True)
    assert report.state is State.STALE


@pytest.mark.fault
def test_commit_refuses_a_file_that_differs_from_its_entry(tmp_path):
    (tmp_path / "a").write_bytes(b"one")
    entry = entry_for_local_file(tmp_path, tmp_path / "a")
    (tmp_path / "a").write_bytes(b"two")
    with pytest.raises(ArtifactError, match="did not verify"):
        commit_artifact(open_store(tmp_path), "test", [entry])
    assert not (tmp_path / MANIFEST_NAME).exists()


@pytest.mark.fault
def test_input_that_is_not_verified_is_refused(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="incomplete"):
        open_input(open_store(tmp_path))


@pytest.mark.fault
def test_verify_cli_exit_codes(tmp_path, make_artifact):
    make_artifact(tmp_path, {"a": b"x" * 10})
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(tmp_path)])
    assert ok.exit_code == 0 and ok.stdout.startswith("verified")
    (tmp_path / "a").unlink()
    bad = runner.invoke(app, ["verify", f"file://{tmp_path}"])
    assert bad.exit_code == 1 and bad.stdout.startswith("missing")
