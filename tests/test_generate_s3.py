"""`generate` with input and output on S3 (a real SeaweedFS server on 127.0.0.1) and the generate process itself
killed with SIGKILL midway: the shards recorded as finished pieces stay, a shard uploaded without its piece is redone,
and the rerun requests only the prompts the finished pieces do not hold."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers.chat_server import EndpointProcess

from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages.generate import SHARDS_DIR
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact
from blockdraft.store.output import recorded_pieces

pytestmark = pytest.mark.s3


def shard_ids(store) -> list[str]:
    ids = []
    for info in store.list(f"{SHARDS_DIR}/"):
        text = zstandard.ZstdDecompressor().decompressobj().decompress(store.read_bytes(info.key)).decode()
        ids += [json.loads(x)["id"] for x in text.splitlines() if x.strip()]
    return ids


def piece_ids(out_url: str) -> list[str]:
    """The ids of every piece recorded at the output."""
    pieces = recorded_pieces(open_store(out_url))
    return [i for piece in pieces.values() for i in piece.counts["ids"]]


@pytest.mark.slow
@pytest.mark.fault
def test_generate_on_s3_resumes_after_kill_9_of_the_generate_process(s3_bucket, tmp_path):
    rows = [json.loads(x) for x in (TINY_TARGET_DIR / "prompts.jsonl").read_text().splitlines()[:10]]
    # Parquet input with plain `prompt` strings, uploaded to S3.
    table = pa.table({"id": [r["id"] for r in rows], "prompt": [r["messages"][-1]["content"] for r in rows]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    (tmp_path / "prompts.parquet").write_bytes(buf.getvalue())
    open_store(f"s3://{s3_bucket}/in").put_file("prompts.parquet", tmp_path / "prompts.parquet")

    # Four requests are answered and the fifth is held: the run stops there, however fast the machine, until it is
    # killed.
    with EndpointProcess(TINY_TARGET_DIR, tmp_path / "endpoint.log", faults="ok,ok,ok,ok,hold") as endpoint:
        config = tmp_path / "c.toml"
        config.write_text(
            f'[generate]\nengine = "openai"\nbase_url = "{endpoint.url}"\nmax_new_tokens = 40\nconcurrency = 1\n'
            'rows_per_shard = 2\nretry_backoff_s = 0.05\nthinking = "off"\n'
        )
        out_url = f"s3://{s3_bucket}/completions"
        cmd = [str(Path(sys.executable).parent / "blockdraft"), "generate", f"s3://{s3_bucket}/in/prompts.parquet",
               out_url, "--config", str(config)]
        out = open_store(out_url)
        first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "first.err", "w"))
        try:
            deadline = time.monotonic() + 300  # bounds a hang only
            while len(piece_ids(out_url)) < 4 and time.monotonic() < deadline and first.poll() is None:
                time.sleep(0.05)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
        assert first.returncode == -signal.SIGKILL, (tmp_path / "first.err").read_text()
        kept = piece_ids(out_url)
        assert len(kept) >= 4 and len(kept) < 10 and len(set(kept)) == len(kept)
        assert set(kept) == set(endpoint.answered())  # the answered prompts' pieces, two shards of two
        assert set(kept) <= set(shard_ids(out))
        assert verify_artifact(out).state is State.INCOMPLETE  # no manifest: the killed run never claimed to be done

        before = len(endpoint.arrived())
        second = subprocess.run(cmd, capture_output=True, text=True)
        assert second.returncode == 0, second.stderr
        rerun = endpoint.arrived()[before:]
        assert set(rerun) == {r["id"] for r in rows} - set(kept) and len(rerun) == len(set(rerun))
        assert sorted(shard_ids(out)) == sorted(r["id"] for r in rows)  # a shard uploaded without its piece was deleted
        report = verify_artifact(out, check_inputs=True)
        assert report.state is State.VERIFIED and report.manifest.kind == "completions"
        assert report.manifest.counts["rows"] == 10 and report.manifest.counts["rows_by"]["thinking_off"] == 10
        assert report.manifest.counts["reused"] == len(kept)
        assert report.manifest.lineage[0].kind == "raw" and report.manifest.lineage[0].url.endswith(
            "in/prompts.parquet"
        )
