"""The stage output (`store.output`) and input (`store.inputs`), on both stores (a local folder and a real SeaweedFS S3
server): when an output is done, what begin() undoes, resumable pieces, and inputs verified or refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.store import open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    PIECES_DIR,
    FileEntry,
    InputRef,
    Manifest,
    State,
    entry_for_local_file,
    verify_artifact,
)
from blockdraft.store.inputs import open_input, open_raw_input
from blockdraft.store.output import StageOutput, recorded_pieces, stage_key

KIND = "tokenized"
FILES = {"shard-0.arrow": b"rows of shard zero" * 50, "meta/info.json": b'{"rows": 2}'}


def local_files(root: Path, files: dict[str, bytes]) -> list[Path]:
    """Write `files` ({relpath: bytes}) under `root`; their paths, in order."""
    paths = []
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        paths.append(path)
    return paths


def committed(dest, tmp_path: Path, key: str = "k1", files: dict[str, bytes] = FILES, sub: str = "out") -> StageOutput:
    """An output of KIND made for `key` at dest/sub, published (files uploaded, manifest committed)."""
    out = StageOutput(dest.sub(sub), KIND, key, dest.settings)
    root = tmp_path / f"src-{sub}-{key}"
    out.publish(root, local_files(root, files), config={"note": "test"}, counts={"rows": 2})
    return out


def uploaded(out: StageOutput, tmp_path: Path, files: dict[str, bytes]) -> list[FileEntry]:
    """Upload `files` to the output's store (no manifest, no piece record); their entries."""
    root = tmp_path / "piece-src"
    entries = []
    for path in local_files(root, files):
        entry = entry_for_local_file(root, path)
        out.store.put_file(entry.path, path, entry.checksum)
        entries.append(entry)
    return entries


def flipped(data: bytes) -> bytes:
    """The same size, other bytes."""
    return bytes([data[0] ^ 0xFF]) + data[1:]


# ---------------------------------------------------------------------------------------------- done / begin


def test_done_is_none_before_commit_and_the_destination_report_after(dest, tmp_path):
    out = StageOutput(dest.sub("out"), KIND, "k1", dest.settings)
    assert out.done() is None
    root = tmp_path / "src"
    report = out.publish(root, local_files(root, FILES))
    assert report.state is State.VERIFIED
    done = out.done()
    assert done is not None and done.state is State.VERIFIED
    assert done.verified_files == len(FILES) and done.manifest_sha256 == report.manifest_sha256
    assert done.manifest.kind == KIND


def test_done_is_none_for_another_key_or_kind(dest, tmp_path):
    committed(dest, tmp_path, key="k1")
    assert StageOutput(dest.sub("out"), KIND, "k2", dest.settings).done() is None
    assert StageOutput(dest.sub("out"), "completions", "k1", dest.settings).done() is None
    assert StageOutput(dest.sub("out"), KIND, "k1", dest.settings).done() is not None


@pytest.mark.fault
def test_done_is_none_when_a_file_no_longer_verifies(dest, tmp_path):
    committed(dest, tmp_path)
    dest.overwrite("out/shard-0.arrow", flipped(FILES["shard-0.arrow"]))
    assert StageOutput(dest.sub("out"), KIND, "k1", dest.settings).done() is None


def test_done_is_none_for_a_partial_output_and_another_config_or_key_and_computes_the_key_only_for_this_config(
    dest, tmp_path
):
    def output(key: str, digest: str, asked: list[str] | None = None) -> StageOutput:
        def key_of() -> str:
            if asked is not None:
                asked.append(key)
            return key

        return StageOutput(dest.sub("out"), KIND, key_of, dest.settings, made_with={"run.digest": digest},
                           failures="failed")

    assert output("k1", "d1").done() is None  # nothing there
    root = tmp_path / "src"
    files = local_files(root, FILES)
    output("k1", "d1").publish(root, files, config={"run": {"digest": "d1"}},
                               counts={"failed": {"a.jsonl": "truncated"}})
    assert verify_artifact(open_store(dest.sub("out"), dest.settings)).state is State.VERIFIED
    assert output("k1", "d1").done() is None  # committed with failures: verified, yet not done, so a rerun retries them
    asked: list[str] = []
    assert output("k1", "d2", asked).done() is None and asked == []  # another config: the key is never asked for
    assert output("k2", "d1", asked).done() is None and asked == ["k2"]  # this config, another key
    output("k1", "d1").publish(root, files, config={"run": {"digest": "d1"}}, counts={"failed": {}})
    done = output("k1", "d1").done()
    assert done is not None and done.state is State.VERIFIED and done.manifest.config["run"] == {"digest": "d1"}


def test_a_commit_must_record_what_failed_and_the_config_it_was_made_with(dest, tmp_path):
    out = StageOutput(dest.sub("out"), KIND, "k1", dest.settings, made_with={"run.digest": "d1"}, failures="failed")
    root = tmp_path / "src"
    with pytest.raises(AssertionError, match="failures field"):
        out.publish(root, local_files(root, FILES), config={"run": {"digest": "d1"}}, counts={"rows": 2})
    with pytest.raises(AssertionError, match="made_with"):
        out.publish(root, local_files(root, FILES), config={"run": {"digest": "d2"}}, counts={"failed": 0})
    assert out.done() is None


def test_begin_uncommits_and_keeps_the_files(dest, tmp_path):
    out = committed(dest, tmp_path)
    assert out.done() is not None
    out.begin()
    assert out.done() is None
    assert not dest.exists(f"out/{MANIFEST_NAME}")
    assert all(dest.exists(f"out/{rel}") for rel in FILES)
    out.begin()  # nothing to uncommit is not an error
    assert out.done() is None


def test_commit_records_the_key_and_what_it_was_made_from(dest, tmp_path):
    lineage = [InputRef(kind="manifest", url="file:///elsewhere", sha256="0" * 64)]
    key = stage_key({"max_length": 16}, lineage)
    assert key == stage_key({"max_length": 16}, lineage)
    assert key not in (stage_key({"max_length": 32}, lineage), stage_key({"max_length": 16}))
    out = StageOutput(dest.sub("out"), KIND, key, dest.settings)
    report = out.commit(uploaded(out, tmp_path, FILES), config={"note": "x"}, lineage=lineage, counts={"rows": 2})
    assert report.state is State.VERIFIED
    assert (
        report.manifest.lineage == lineage
        and report.manifest.config["note"] == "x"
        and report.manifest.counts == {"rows": 2}
    )
    assert out.done() is not None


# ---------------------------------------------------------------------------------------------- copies (push, pull)


@pytest.mark.fault
def test_a_copy_is_done_only_with_the_same_manifest_bytes(dest, tmp_path):
    out = committed(dest, tmp_path)
    raw = out.store.read_bytes(MANIFEST_NAME)
    assert StageOutput.copy(dest.sub("out"), raw, dest.settings).done() is not None

    same_content_other_bytes = json.dumps(json.loads(raw)).encode()  # no indent: equal as JSON, not as bytes
    assert same_content_other_bytes != raw
    assert StageOutput.copy(dest.sub("out"), same_content_other_bytes, dest.settings).done() is None
    other = Manifest.model_validate_json(raw).model_copy(update={"counts": {"rows": 3}}).to_bytes()
    assert StageOutput.copy(dest.sub("out"), other, dest.settings).done() is None
    assert StageOutput.copy(dest.sub("elsewhere"), raw, dest.settings).done() is None

    dest.remove("out/meta/info.json")  # the same manifest over a missing file is not done either
    assert StageOutput.copy(dest.sub("out"), raw, dest.settings).done() is None


# ---------------------------------------------------------------------------------------------- pieces


def test_put_piece_then_finished_piece_round_trip(dest, tmp_path):
    out = StageOutput(dest.sub("out"), KIND, "k1", dest.settings)
    assert out.finished_piece("shard-0", "p0") is None
    entries = uploaded(out, tmp_path, {"shard-0.arrow": b"piece zero"})
    out.put_piece("shard-0", "p0", entries, counts={"rows": 1})
    piece = out.finished_piece("shard-0", "p0")
    assert piece is not None and piece.files == entries and piece.counts == {"rows": 1}
    assert dest.exists(f"out/{PIECES_DIR}/shard-0.json")
    assert out.done() is None  # a recorded piece commits nothing
    assert set(recorded_pieces(out.store)) == {"shard-0"}
    out.drop_piece("shard-0")
    assert out.finished_piece("shard-0", "p0") is None and recorded_pieces(out.store) == {}


@pytest.mark.fault
def test_a_piece_whose_file_was_corrupted_or_deleted_is_not_finished(dest, tmp_path):
    out = StageOutput(dest.sub("out"), KIND, "k1", dest.settings)
    files = {"a.arrow": b"piece a" * 10, "b.arrow": b"piece b" * 10}
    out.put_piece("a", "pa", uploaded(out, tmp_path, {"a.arrow": files["a.arrow"]}))
    out.put_piece("b", "pb", uploaded(out, tmp_path, {"b.arrow": files["b.arrow"]}))
    dest.overwrite("out/a.arrow", flipped(files["a.arrow"]))
    dest.remove("out/b.arrow")
    assert out.finished_piece("a", "pa") is None
    assert out.finished_piece("b", "pb") is None
    assert set(recorded_pieces(out.store)) == {"a", "b"}  # still recorded; only finished_piece decides


def test_a_piece_recorded_for_another_piece_key_or_kind_is_not_finished(dest, tmp_path):
    out = StageOutput(dest.sub("out"), KIND, "k1", dest.settings)
    out.put_piece("shard-0", "p0", uploaded(out, tmp_path, {"shard-0.arrow": b"zero"}))
    assert out.finished_piece("shard-0", "p0-other-config") is None
    assert StageOutput(dest.sub("out"), "completions", "k1", dest.settings).finished_piece("shard-0", "p0") is None
    assert out.finished_piece("shard-0", "p0") is not None
    out.put_piece("shard-1", "p1", uploaded(out, tmp_path, {"shard-1.arrow": b"one"}))
    assert out.piece_names("p0") == (["shard-0"], ["shard-1"])
    assert (StageOutput(dest.sub("out"), "completions", "k1", dest.settings).piece_names("p0")
            == ([], ["shard-0", "shard-1"]))


@pytest.mark.fault
def test_put_piece_refuses_a_file_that_does_not_verify_and_records_nothing(dest, tmp_path):
    out = StageOutput(dest.sub("out"), KIND, "k1", dest.settings)
    [entry] = uploaded(out, tmp_path, {"shard-0.arrow": b"zero"})
    dest.overwrite("out/shard-0.arrow", b"ZERO")
    with pytest.raises(ArtifactError, match=r"shard-0\.arrow did not verify before its piece was recorded"):
        out.put_piece("shard-0", "p0", [entry])
    assert not dest.exists(f"out/{PIECES_DIR}/shard-0.json")


@pytest.mark.fault
def test_a_torn_piece_record_is_not_finished(dest, tmp_path):
    out = StageOutput(dest.sub("out"), KIND, "k1", dest.settings)
    out.store.put_bytes(f"{PIECES_DIR}/shard-0.json", b'{"kind": "tokenized-pie')
    assert out.finished_piece("shard-0", "p0") is None
    assert recorded_pieces(out.store) == {}


# ---------------------------------------------------------------------------------------------- inputs


def test_open_input_returns_the_verified_artifact_pinned_by_content(dest, tmp_path):
    out = committed(dest, tmp_path)
    inp = open_input(dest.sub("out"), dest.settings, kinds=[KIND])
    assert inp.kind == KIND and inp.report.state is State.VERIFIED
    assert inp.ref == InputRef(kind="manifest", url=out.url, sha256=inp.report.manifest_sha256)
    assert inp.entry("shard-0.arrow").size == len(FILES["shard-0.arrow"])
    with pytest.raises(ArtifactError, match="lists no absent.bin"):
        inp.entry("absent.bin")
    assert open_input(out.store).ref == inp.ref  # a store works as well as its URL


@pytest.mark.parametrize("damage", ["incomplete", "corrupt", "missing"])
@pytest.mark.fault
def test_open_input_refuses_an_artifact_that_does_not_verify_in_one_line(damage, dest, tmp_path):
    out = committed(dest, tmp_path)
    if damage == "incomplete":
        out.begin()
    elif damage == "corrupt":
        dest.overwrite("out/shard-0.arrow", flipped(FILES["shard-0.arrow"]))
    else:
        dest.remove("out/shard-0.arrow")
    with pytest.raises(ArtifactError) as caught:
        open_input(dest.sub("out"), dest.settings, kinds=[KIND])
    message = str(caught.value)
    assert (
        message.startswith(f"input {open_store(dest.sub('out'), dest.settings).url} is {damage}:")
        and "\n" not in message
    )
    assert damage == "incomplete" or "shard-0.arrow" in message


def test_open_input_of_a_mistyped_path_says_it_does_not_exist(dest, tmp_path):
    """Nothing at all at the URL (a typo in train.data, say) is 'does not exist', not 'incomplete: no manifest'."""
    committed(dest, tmp_path)
    typo = open_store(dest.sub("ouT"), dest.settings).url
    with pytest.raises(ArtifactError) as caught:
        open_input(dest.sub("ouT"), dest.settings, kinds=[KIND], role="train.data")
    assert str(caught.value) == f"train.data {typo} does not exist (nothing there); check the path or URL"


def test_open_input_refuses_the_wrong_kind_in_one_line(dest, tmp_path):
    committed(dest, tmp_path)
    with pytest.raises(ArtifactError) as caught:
        open_input(dest.sub("out"), dest.settings, kinds=["completions", "drafter-checkpoint"], role="train.data")
    message = str(caught.value)
    assert message.startswith("train.data ") and "\n" not in message  # the role names which input is wrong
    assert f"is a '{KIND}' artifact, not 'completions' or 'drafter-checkpoint'" in message


def test_fetch_reads_a_local_input_in_place_or_downloads_a_remote_one_checked(dest, tmp_path):
    committed(dest, tmp_path)
    inp = open_input(dest.sub("out"), dest.settings)
    target = tmp_path / "fetched"
    got = inp.fetch(["shard-0.arrow", "meta/info.json"], target)
    if dest.kind == "file":
        assert got == dest.root / "out" and not target.exists()  # read where it is: no copy
    else:
        assert got == target
        assert (sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
                == ["meta/info.json", "shard-0.arrow"])
    for rel, data in FILES.items():
        assert (got / rel).read_bytes() == data
    with inp.fetched() as folder:
        assert {rel: (folder / rel).read_bytes() for rel in FILES} == FILES


@pytest.mark.fault
def test_fetch_refuses_bytes_that_changed_since_the_input_verified(s3_bucket, s3_env, tmp_path):
    """The remote copy changes (same size) between open_input and fetch: the checksum of the bytes received says so."""
    url = f"s3://{s3_bucket}/in"
    root = tmp_path / "src"
    StageOutput(url, KIND, "k1").publish(root, local_files(root, FILES))
    inp = open_input(url)
    s3_env.client().put_object(Bucket=s3_bucket, Key="in/shard-0.arrow", Body=flipped(FILES["shard-0.arrow"]))
    with pytest.raises(ArtifactError, match=r"shard-0\.arrow changed while read") as caught:
        inp.fetch(["meta/info.json", "shard-0.arrow"], tmp_path / "fetched")
    assert "\n" not in str(caught.value)
    assert (tmp_path / "fetched" / "meta/info.json").read_bytes() == FILES["meta/info.json"]
    assert not (tmp_path / "fetched" / "shard-0.arrow").exists()  # the bad bytes are not left behind
    assert open_store(url).exists("shard-0.arrow")


# -------------------------------------------------------------------------------------------- a raw input (no manifest)


def test_a_raw_input_is_pinned_by_what_the_store_reports_and_read_back_against_it(dest, tmp_path):
    data = b'{"prompt": "hello"}\n' * 20
    root = tmp_path / "raw"
    [path] = local_files(root, {"prompts.jsonl": data})
    open_store(dest.sub("raw"), dest.settings).put_file("prompts.jsonl", path,
                                                        entry_for_local_file(root, path).checksum)
    raw = open_raw_input(dest.sub("raw/prompts.jsonl"), dest.settings, role="prompts file")
    assert raw.ref.kind == "raw" and raw.ref.size == len(data) and raw.ref.url.endswith("/raw/prompts.jsonl")
    assert raw.ref.checksum is not None or raw.ref.etag is not None
    assert raw.fetch(tmp_path / "got.jsonl").read_bytes() == data


@pytest.mark.fault
def test_a_raw_input_that_is_absent_or_changes_while_read_is_refused_in_one_line(dest, tmp_path):
    with pytest.raises(ConfigError, match=r"prompts file .*nothing\.jsonl does not exist") as absent:
        open_raw_input(dest.sub("nothing.jsonl"), dest.settings, role="prompts file")
    assert "\n" not in str(absent.value)
    root = tmp_path / "raw"
    [path] = local_files(root, {"p.jsonl": b"line\n" * 10})
    store = open_store(dest.sub("raw"), dest.settings)
    store.put_file("p.jsonl", path)
    raw = open_raw_input(dest.sub("raw/p.jsonl"), dest.settings)
    store.put_bytes("p.jsonl", b"longer line\n" * 10)  # replaced after it was pinned
    if dest.kind == "file":
        return  # a local file is read where it is; staleness of a raw input is `verify`'s to report
    with pytest.raises(ArtifactError, match="changed while read"):
        raw.fetch(tmp_path / "got.jsonl")
    assert not (tmp_path / "got.jsonl").exists()
