"""tokenize with S3 on both ends: raw completions read from an s3:// prefix (no manifest; key, size and ETag as
lineage), output to an s3:// URL (preflight first, shards pushed as they finish, verified there, manifest last)."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.paths import TOKENIZER_DIR
from helpers.reporters import ProgressLog

from blockdraft.config import load_config
from blockdraft.errors import StoreError
from blockdraft.reporter import Reporter
from blockdraft.stages.tokenize import finished_shard_entries, run
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, read_manifest, verify_artifact
from blockdraft.store.status import status
from blockdraft.store.transfer import pull, stage_and_push

pytestmark = pytest.mark.s3


def jsonl(first: int, n: int) -> bytes:
    rows = []
    for i in range(first, first + n):
        rows.append({"id": f"c{i}",
                     "messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                  {"role": "assistant", "content": f"It is {i + 1}."}]})
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def s3_config(tmp_path: Path, **tokenize):
    return load_config(
        None,
        {"target": {"path": str(TOKENIZER_DIR)}, "tokenize": tokenize,
         "store": {"staging_dir": str(tmp_path / "staging"), "part_size_mib": 5}},
    )


def upload_raw(server, bucket: str) -> list[str]:
    """Completions as someone else uploaded them: a raw client, no manifest, no CRC64NVME."""
    raw = server.client()
    keys = [f"raw/part-{i}.jsonl" for i in range(3)]
    for i, key in enumerate(keys):
        raw.put_object(Bucket=bucket, Key=key, Body=jsonl(10 * i, 10))
    return keys


def test_tokenize_reads_raw_s3_completions_and_writes_a_verified_s3_artifact(s3_bucket, s3_env, tmp_path):
    keys = upload_raw(s3_env, s3_bucket)
    out_url = f"s3://{s3_bucket}/tokenized"
    result = run(s3_config(tmp_path), f"s3://{s3_bucket}/raw", out_url, Reporter())
    assert result.report.state is State.VERIFIED
    assert result.url == open_store(out_url).url
    remote = open_store(out_url)
    assert verify_artifact(remote).state is State.VERIFIED
    manifest = read_manifest(remote)[0]
    assert manifest.counts["rows_in"] == 30 and manifest.counts["shards"] == 3

    # Lineage pins each raw object by key, size and ETag as the server reports them.
    heads = {k: s3_env.client().head_object(Bucket=s3_bucket, Key=k) for k in keys}
    assert [(ref.kind, ref.url, ref.size, ref.etag) for ref in manifest.lineage] == [
        ("raw", f"s3://{s3_bucket}/{k}", heads[k]["ContentLength"], heads[k]["ETag"]) for k in keys
    ]
    # The tokenized artifact pulls to another folder and verifies there.
    assert pull(out_url, tmp_path / "pulled").verify.state is State.VERIFIED


class WaitForFirstShardAtDestination(Reporter):
    """On the second shard's last progress report (shard 0 recorded, shard 1 still being tokenized, shard 2 not begun),
    waits until shard 0's rows are listed at the destination, and notes how many objects were there."""

    def __init__(self, client, bucket: str) -> None:
        super().__init__()
        self.client, self.bucket = client, bucket
        self.reports = 0
        self.seen_at_destination: list[int] = []

    def progress(self, task, completed, total=None, **fields):
        if not completed:
            return
        self.reports += 1
        if self.reports != 2:
            return
        deadline = time.monotonic() + 300  # the pusher polls every 0.5 s; the deadline only bounds a hang
        while time.monotonic() < deadline:
            listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix="tokenized/train/").get("Contents", [])
            if any("shard-00000" in o["Key"] for o in listed):
                self.seen_at_destination.append(len(listed))
                return
            time.sleep(0.05)


class PollCount:
    """Wraps `finished` (what the pusher asks each poll): counts the polls, keeps what they listed, and lets the stage
    wait for the n-th poll to begin."""

    def __init__(self, finished) -> None:
        self.finished, self.polls, self.listed = finished, 0, []
        self.changed = threading.Condition()

    def __call__(self, local: Path) -> list:
        with self.changed:
            self.polls += 1
            self.changed.notify_all()
        entries = self.finished(local)
        self.listed += [entry.path for entry in entries]
        return entries

    def reached(self, n: int) -> bool:
        """Whether the n-th poll began within 300 s (a bound on a hang only)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.polls >= n, timeout=300)


def test_tokenize_to_s3_pushes_finished_shards_before_the_end(s3_bucket, s3_env, tmp_path):
    """The first shard is at the destination, verified, while a later shard is still being tokenized."""
    upload_raw(s3_env, s3_bucket)  # three files of 10 rows: each shard reports its progress once, at its end
    out_url = f"s3://{s3_bucket}/tokenized"
    reporter = WaitForFirstShardAtDestination(s3_env.client(), s3_bucket)
    result = run(s3_config(tmp_path, workers=1), f"s3://{s3_bucket}/raw", out_url, reporter)
    assert result.report.state is State.VERIFIED
    assert reporter.reports == 3 and reporter.seen_at_destination and reporter.seen_at_destination[0] >= 1
    assert open_store(out_url).exists(MANIFEST_NAME)


@pytest.mark.fault
def test_tokenize_to_s3_with_a_wrong_secret_fails_before_any_work(s3_bucket, s3_env, tmp_path, monkeypatch):
    upload_raw(s3_env, s3_bucket)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    reporter = ProgressLog()
    with pytest.raises(StoreError, match="wrong secret key"):
        run(s3_config(tmp_path), f"s3://{s3_bucket}/raw", f"s3://{s3_bucket}/tokenized", reporter)
    # Refused by the preflight: nothing tokenized, staged or written, rather than a clock that a slow machine could
    # lose.
    assert not [call for call in reporter.calls if call[1]] and reporter.lines == []
    assert not (tmp_path / "staging").exists()
    assert s3_env.client().list_objects_v2(Bucket=s3_bucket, Prefix="tokenized/").get("KeyCount", 0) == 0


def test_tokenize_reads_parquet_completions_from_s3(s3_bucket, s3_env, tmp_path):
    """Parquet needs seeks: the S3 object reader reopens its stream at the new position."""
    rows = [json.loads(line) for line in jsonl(0, 40).decode().splitlines()]
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer, row_group_size=10)
    s3_env.client().put_object(Bucket=s3_bucket, Key="raw/part-0.parquet", Body=buffer.getvalue())
    result = run(s3_config(tmp_path), f"s3://{s3_bucket}/raw", str(tmp_path / "tok"), Reporter())
    assert result.report.state is State.VERIFIED
    assert result.details.counts["rows_in"] == 40


def test_s3_object_reader_seeks_and_reads_like_a_file(s3_bucket, s3_env):
    data = os.urandom(3 * 1024 * 1024 + 5)
    s3_env.client().put_object(Bucket=s3_bucket, Key="obj.bin", Body=data)
    with open_store(f"s3://{s3_bucket}").open_read("obj.bin") as f:
        assert f.read(10) == data[:10]
        assert f.seek(-7, 2) == len(data) - 7 and f.read() == data[-7:]
        f.seek(1_000_000)
        assert f.read(2_000_000) == data[1_000_000:3_000_000]
    with pytest.raises(FileNotFoundError):
        open_store(f"s3://{s3_bucket}").open_read("absent.bin")


@pytest.mark.fault
def test_tokenized_artifact_is_stale_once_a_raw_input_object_changes(s3_bucket, s3_env, tmp_path):
    upload_raw(s3_env, s3_bucket)
    out_url = f"s3://{s3_bucket}/tokenized"
    run(s3_config(tmp_path), f"s3://{s3_bucket}/raw", out_url, Reporter())
    assert verify_artifact(open_store(out_url), check_inputs=True).state is State.VERIFIED
    s3_env.client().put_object(Bucket=s3_bucket, Key="raw/part-1.jsonl", Body=jsonl(100, 10))
    report = verify_artifact(open_store(out_url), check_inputs=True)
    assert report.state is State.STALE and "raw/part-1.jsonl" in report.problems[0].path
    by_root = {a.root: a.state for a in status(open_store(f"s3://{s3_bucket}/"))}
    assert by_root["tokenized"] is State.STALE


@pytest.mark.fault
def test_a_failed_rerun_over_a_committed_s3_output_that_changes_nothing_leaves_it_committed(
    s3_bucket, s3_env, tmp_path
):
    upload_raw(s3_env, s3_bucket)
    out_url = f"s3://{s3_bucket}/tokenized"
    cfg = s3_config(tmp_path)
    run(cfg, f"s3://{s3_bucket}/raw", out_url, Reporter())
    before = read_manifest(open_store(out_url))[1]
    polls = PollCount(finished_shard_entries)

    def crash(local: Path) -> None:
        # The pusher looks at the staged (unchanged) shards, all already at the destination, before the stage dies: a
        # second poll begins only after the first one has checked every shard it listed.
        assert polls.reached(2), "the pusher never polled"
        raise RuntimeError("stage died")

    with pytest.raises(RuntimeError, match="stage died"):
        stage_and_push(out_url, cfg.store, "tokenized", crash, polls, poll_s=0.1)
    assert polls.listed, "the pusher found no finished shard to check"
    # Nothing was replaced, so nothing was uncommitted: readers still see the verified artifact.
    assert verify_artifact(open_store(out_url)).state is State.VERIFIED
    assert read_manifest(open_store(out_url))[1] == before
