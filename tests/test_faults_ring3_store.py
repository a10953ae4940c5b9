"""Third ring of faults, the store and data side: nothing written where it does not belong (a planted link in a working
folder, a demo folder or a progress page holding someone else's files), a suspended writer that comes back after its
lease was taken over, a row nested deeper than Python recurses, and the messages that named the wrong cause."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.artifacts import Destination, commit_files
from helpers.tokenize_data import config, conversation, rows_of, tokenize, write_jsonl
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import BlockdraftError, LeaseError, OutsideArtifactError
from blockdraft.pipeline import DEMO_MARK, claim_workdir
from blockdraft.reporter import Reporter
from blockdraft.stages.eval.prompts import prompts_from_jsonl
from blockdraft.store import open_store
from blockdraft.store.artifact import INCOMING_DIR, MANIFEST_NAME, State, verify_artifact
from blockdraft.store.base import LEASE_NAME, WRITING_NAME
from blockdraft.store.local import LocalStore
from blockdraft.store.manifest import PIECES_DIR, FileEntry, Manifest
from blockdraft.store.transfer import pull, push

DEEP = 50_000


def deep_rows() -> list[str]:
    """An array and an object each nested `DEEP` levels: valid JSON no recursive parser can hold."""
    return ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_row_nested_50000_deep_is_quarantined_as_bad_json_and_the_run_goes_on(tmp_path, workers):
    rows = [json.dumps(conversation(0)), *deep_rows(), json.dumps(conversation(1))]
    source = write_jsonl(tmp_path / "in" / "deep.jsonl", rows)
    (tmp_path / "in" / "deep-array.json").write_text("[" + ",".join([json.dumps(conversation(2)), *deep_rows()]) + "]")
    out = tmp_path / "out"
    result = tokenize(source.parent, out, config(held_out_fraction=0.0, workers=workers))
    counts = result.details.counts
    assert counts["input_files_failed"] == 0 and counts["rejected"] == {"bad_json": 4}, counts
    assert sorted(r["source_id"] for r in rows_of(out)["train"]) == ["c0", "c1", "c2"]
    assert not (out / WRITING_NAME).exists()


def test_eval_prompts_nested_50000_deep_are_one_line_naming_the_row(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + deep_rows()[1] + "\n")
    with pytest.raises(BlockdraftError, match="prompts.jsonl line 2 is not valid JSON"):
        prompts_from_jsonl(prompts, None, load_config(None, {}), 10)


# --------------------------------------------------------------------------------------- working paths in a destination


@pytest.mark.parametrize("planted", [INCOMING_DIR, f"{INCOMING_DIR}/sub"])
def test_a_link_planted_at_a_pulls_incoming_folder_is_refused_and_nothing_outside_is_touched(tmp_path, planted):
    src = commit_files(tmp_path / "src", {"a.bin": b"a" * 64, "sub/b.bin": b"b" * 64})
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    for name in ("a.bin", "sub/b.bin", "b.bin"):  # the user's files, some named like the artifact's
        (other / name).write_bytes(b"the user's own " + name.encode())
    dest = tmp_path / "dest"
    (dest / INCOMING_DIR).parent.mkdir(parents=True)
    if planted != INCOMING_DIR:
        (dest / INCOMING_DIR).mkdir()
    os.symlink(other / ("sub" if planted != INCOMING_DIR else ""), dest / planted)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}

    with pytest.raises(OutsideArtifactError, match="resolves outside"):
        pull(f"file://{src}", dest)
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
    assert not (dest / MANIFEST_NAME).exists()
    result = CliRunner().invoke(app, ["pull", str(src), str(dest)])
    assert result.exit_code != 0 and "resolves outside" in result.output and "Traceback" not in result.output


def test_a_link_planted_in_a_pulls_incoming_folder_is_refused_from_s3(s3_env, tmp_path):
    dest_s3 = Destination.s3(s3_env)
    src = commit_files(tmp_path / "src", {"a.bin": b"a" * 64})
    push(src, dest_s3.url, dest_s3.settings)
    other = tmp_path / "other"
    other.mkdir()
    local = tmp_path / "dest"
    local.mkdir()
    os.symlink(other, local / INCOMING_DIR)
    with pytest.raises(OutsideArtifactError, match="resolves outside"):
        pull(dest_s3.url, local, dest_s3.settings)
    assert list(other.iterdir()) == []


def test_a_store_writes_no_working_file_through_a_link_swapped_in_after_a_check(tmp_path):
    """The folder is opened where it is written: a link that replaces a folder between two writes is refused by the
    second, whatever an earlier check found."""
    store = LocalStore(tmp_path / "dest")
    store.put_bytes(f"{PIECES_DIR}/one.json", b"{}")
    store.put_bytes(MANIFEST_NAME, b"{}")
    (tmp_path / "elsewhere").mkdir()
    shutil.rmtree(tmp_path / "dest" / PIECES_DIR)
    os.symlink(tmp_path / "elsewhere", tmp_path / "dest" / PIECES_DIR)
    for write in (lambda: store.put_bytes(f"{PIECES_DIR}/two.json", b"{}"),
                  lambda: store.put_bytes_if_absent(f"{PIECES_DIR}/two.json", b"{}"),
                  lambda: store.put_file(f"{PIECES_DIR}/two.json", tmp_path / "dest" / MANIFEST_NAME),
                  lambda: store.delete(f"{PIECES_DIR}/x.json")):
        with pytest.raises(OutsideArtifactError, match="resolves outside"):
            write()
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_demo_refuses_a_workdir_holding_the_users_own_files_and_leaves_them(tmp_path):
    work = tmp_path / "work"
    (work / "train-logs").mkdir(parents=True)
    own = {"blockdraft.toml": "[train]\nlr = 1e-4\n", "prompts.jsonl": '{"prompt": "mine"}\n',
           "PROGRESS.md": "my notes\n", "train-logs/metrics.jsonl": '{"step": 1}\n'}
    for name, text in own.items():
        (work / name).write_text(text)
    result = CliRunner().invoke(app, ["demo", "--workdir", str(work), "--profile", "ci"])
    assert result.exit_code != 0 and "holds files the demo did not write (PROGRESS.md" in result.output, result.output
    assert "Traceback" not in result.output
    assert {name: (work / name).read_text() for name in own} == own
    assert sorted(p.name for p in work.iterdir()) == ["PROGRESS.md", "blockdraft.toml", "prompts.jsonl", "train-logs"]


def test_a_folder_the_demo_made_is_the_demos_again(tmp_path):
    claim_workdir(tmp_path / "new")  # a new folder, then the same one again: both are the demo's
    (tmp_path / "new" / "blockdraft.toml").write_text("written by the demo\n")
    claim_workdir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    claim_workdir(tmp_path / "empty")
    assert (tmp_path / "new" / DEMO_MARK).is_file() and (tmp_path / "empty" / DEMO_MARK).is_file()


# ----------------------------------------------------------------------------------------- messages that name the cause


def test_an_endpoint_with_a_query_string_is_refused_by_name(tmp_path):
    result = CliRunner().invoke(app, ["status", "s3://b/x", "--endpoint-url",
                                      "http://user:SECRET@127.0.0.1:1/?region=x"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert (
        "has a query string" in result.output
        and "not a valid URI" not in result.output
        and "SECRET" not in result.output
    )


def test_bit_rot_on_the_server_is_named_as_a_damaged_server_copy_not_a_short_read(s3_env, tmp_path):
    dest = Destination.s3(s3_env)
    payload = random.Random(1).randbytes(300_000)
    push(commit_files(tmp_path / "src", {"w.bin": payload}), dest.url, dest.settings)
    volumes = [p for p in s3_env.data.rglob(f"{dest.bucket}_*.dat") if payload[1000:1100] in p.read_bytes()]
    assert len(volumes) == 1
    data = bytearray(volumes[0].read_bytes())
    data[data.find(payload[1000:1100]) + 50] ^= 1
    volumes[0].write_bytes(bytes(data))
    with pytest.raises(BlockdraftError, match="the server's copy is damaged") as caught:
        pull(dest.url, tmp_path / "pulled", dest.settings)
    assert "retry the pull" not in str(caught.value) and "w.bin" in str(caught.value)


# ---- case 3: a status page lands only where it belongs


@pytest.mark.parametrize("where", ["a listed file", "a new file inside"])
def test_a_status_page_inside_an_artifact_is_refused_and_the_artifact_stays_verified(tmp_path, where):
    store = tmp_path / "store"
    data = commit_files(store / "data", {"a.bin": b"a" * 100, "sub/b.bin": b"b" * 50})
    page = data / ("a.bin" if where == "a listed file" else "sub/PROGRESS.md")
    out = CliRunner().invoke(app, ["status", str(store), "--progress", str(page)])
    assert out.exit_code != 0 and "lies inside the artifact" in out.output and len(out.output.strip().splitlines()) == 1
    assert (data / "a.bin").read_bytes() == b"a" * 100 and not (data / "sub" / "PROGRESS.md").exists()
    again = CliRunner().invoke(app, ["status", str(store)])
    assert again.exit_code == 0 and again.output.startswith("verified")


def test_a_status_page_never_replaces_a_file_blockdraft_did_not_write_but_renews_its_own(tmp_path):
    store = tmp_path / "store"
    commit_files(store / "data", {"a.bin": b"a" * 100})
    notes = tmp_path / "NOTES.md"
    notes.write_text("my own notes\n")
    out = CliRunner().invoke(app, ["status", str(store), "--progress", str(notes)])
    assert out.exit_code != 0 and "did not write" in out.output and notes.read_text() == "my own notes\n"
    page = tmp_path / "PROGRESS.md"
    for _ in range(2):  # the second run replaces the page the first one wrote
        out = CliRunner().invoke(app, ["status", str(store), "--progress", str(page)])
        assert out.exit_code == 0, out.output
        assert page.read_text().startswith("# blockdraft status: ")


# ---- case 12: a folder where a file is listed, and a long list of problems, each named as what they are


def test_a_folder_standing_where_the_manifest_lists_a_file_is_named_a_folder_not_absent(tmp_path):
    root = commit_files(tmp_path / "art", {"a.bin": b"a" * 10, "b.bin": b"b" * 20})
    (root / "b.bin").unlink()
    (root / "b.bin").mkdir()
    (root / "b.bin" / "x").write_bytes(b"x")
    result = CliRunner().invoke(app, ["verify", str(root)])
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and "absent" not in said
    assert "b.bin: a folder, not the file of 20 bytes the manifest lists; move that folder away" in said
    with pytest.raises(BlockdraftError, match="b.bin .missing: a folder, not the file of 20 bytes"):
        pull(str(root), tmp_path / "pulled")


def test_a_manifest_of_100000_missing_files_is_refused_in_one_short_line(tmp_path):
    # A committed artifact whose manifest then lists 100,000 files that are not there.
    root = commit_files(tmp_path / "art", {"a.bin": b"a"})
    manifest = Manifest.model_validate_json((root / MANIFEST_NAME).read_bytes())
    manifest.files = [FileEntry(path=f"shard-{i:06d}.arrow", size=8, checksum="AAAAAAAAAAA=") for i in range(100_000)]
    (root / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    with pytest.raises(BlockdraftError) as caught:
        pull(str(root), tmp_path / "pulled")
    message = str(caught.value)
    assert "\n" not in message and len(message) < 1000
    assert "100,000 file(s) do not verify" in message and "(+99,995 more; `blockdraft verify" in message
    assert "shard-000004.arrow" in message and "shard-000005.arrow" not in message


# ---- case 5: a writer suspended past its lease is still the writer; one that lost its lease writes no further object

MIB = 1 << 20


def _stopped_push(dest: Destination, local, at_least: int) -> subprocess.Popen:
    """`blockdraft push local dest` in its own process (one file at a time, 5 MiB parts), SIGSTOPped once `at_least`
    objects (its lease and writing mark among them) are at the destination, with files still to upload."""
    cmd = [str(Path(sys.executable).parent / "blockdraft"), "push", str(local), dest.url, "--concurrency", "1",
           "--part-size-mib", "5"]
    proc = subprocess.Popen(cmd, env={**os.environ, "COLUMNS": "400"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    raw, deadline = dest.server.client(), time.monotonic() + 300
    while len(raw.list_objects_v2(Bucket=dest.bucket).get("Contents", [])) < at_least and proc.poll() is None:
        assert time.monotonic() < deadline, "the push uploaded nothing in 300 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, "the push finished before it could be stopped"
    return proc


def _age_lease(dest: Destination, **fields) -> None:
    """The push's lease, as the store holds it, with `fields` changed and its expiry an hour ago (a suspended job, a
    clock that jumped)."""
    raw, key = dest.server.client(), dest.s3_key(LEASE_NAME)
    record = json.loads(raw.get_object(Bucket=dest.bucket, Key=key)["Body"].read())
    record.update(fields, expires_at=time.time() - 3600)
    raw.put_object(Bucket=dest.bucket, Key=key, Body=json.dumps(record).encode())


def test_a_push_suspended_past_its_lease_keeps_it_and_one_that_lost_it_writes_nothing_more(
    s3_env, tmp_path, leases_given_back
):
    dest = Destination.s3(s3_env)
    first = commit_files(tmp_path / "first", {f"shard-{i}.arrow": bytes([i]) * (6 * MIB) for i in range(6)},
                         kind="tokenized")
    second = commit_files(tmp_path / "second", {f"shard-{i}.arrow": bytes([100 + i]) * (6 * MIB) for i in range(6)},
                          kind="tokenized")
    proc = _stopped_push(dest, first, at_least=3)
    try:
        # Its writer is alive on this host (pid and start time): an expired lease is still its, whatever the clock says.
        _age_lease(dest)
        with pytest.raises(LeaseError, match=r"is alive on this host"):
            push(second, dest.url, dest.settings)

        # Now a lease the second push may take over (another host's, expired): it commits, and the first, resumed, stops
        # at its next object with the one line naming the new writer, and writes none.
        _age_lease(dest, host="train-node-7")
        taken = push(second, dest.url, dest.settings, reporter=(told := Reporter()))
        assert taken.verify.state is State.VERIFIED and any("taking over the lease" in w for w in told.warnings)
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err and "lost the lease" in " ".join(err.split())
    deep = verify_artifact(open_store(dest.url, dest.settings), deep=True)
    assert deep.state is State.VERIFIED, deep.summary()
