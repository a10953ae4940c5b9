"""Shared fixtures. S3 tests use a real SeaweedFS server on 127.0.0.1 (tests/s3server.py), one per session,
with a fresh bucket per test; a test that kills its server gets its own (`own_s3_server`)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from s3server import SeaweedS3  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Every model in these tests is tiny: a second intra-op thread gains nothing and, on a busy 2-core machine,
    spinning OpenMP threads make it many times slower. Subprocesses (torchrun ranks, killed CLIs) set their own."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def own_s3_server(tmp_path):
    """A server this test may SIGKILL and restart; always stopped at the end."""
    server = SeaweedS3(tmp_path / "seaweedfs")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _isolate_aws(monkeypatch, tmp_path: Path) -> None:
    """No AWS setting of the machine running the tests may leak in: no profiles, no config files, no env keys."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path):
    """The session server's admin identity through the standard AWS environment variables."""
    _isolate_aws(monkeypatch, tmp_path)
    for key, value in s3_server.admin.env(s3_server.endpoint).items():
        monkeypatch.setenv(key, value)
    return s3_server


def new_bucket(server: SeaweedS3) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_bucket(s3_env):
    """A fresh, empty bucket on the session server, with the admin identity in the environment."""
    return new_bucket(s3_env)


@pytest.fixture
def make_artifact():
    """make(root, {relpath: bytes}, kind=..., lineage=...) -> root: files written and committed locally."""
    from blockdraft.store import open_store
    from blockdraft.store.artifact import commit_artifact, entry_for_local_file

    def make(root: Path, files: dict[str, bytes], kind: str = "test", lineage=()) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        entries = [entry_for_local_file(root, root / rel) for rel in files]
        commit_artifact(open_store(root), kind, entries, config={"store": {"url": "test"}}, lineage=lineage, counts={"rows": len(files)})
        return root

    return make


class Destination:
    """Where a transfer test writes: an S3 prefix in a fresh bucket or a local folder, plus raw tampering
    that bypasses blockdraft (a raw boto3 client or plain file writes)."""

    def __init__(self, kind: str, url: str, server: SeaweedS3 | None = None, bucket: str | None = None, root: Path | None = None):
        from blockdraft.config import StoreConfig

        self.kind, self.url, self.server, self.bucket, self.root = kind, url, server, bucket, root
        # 5 MiB parts (the S3 minimum) so small test files still take the multipart path.
        self.settings = StoreConfig(part_size_mib=5, concurrency=4)

    def sub(self, rel: str) -> str:
        return self.url.rstrip("/") + "/" + rel

    def _s3_key(self, rel: str) -> str:
        return self.url.removeprefix(f"s3://{self.bucket}/").rstrip("/") + "/" + rel

    def overwrite(self, rel: str, data: bytes) -> None:
        if self.kind == "s3":
            self.server.client().put_object(Bucket=self.bucket, Key=self._s3_key(rel), Body=data)
        else:
            (self.root / rel).write_bytes(data)

    def remove(self, rel: str) -> None:
        if self.kind == "s3":
            self.server.client().delete_object(Bucket=self.bucket, Key=self._s3_key(rel))
        else:
            (self.root / rel).unlink()

    def exists(self, rel: str) -> bool:
        if self.kind == "s3":
            resp = self.server.client().list_objects_v2(Bucket=self.bucket, Prefix=self._s3_key(rel))
            return any(o["Key"] == self._s3_key(rel) for o in resp.get("Contents", []))
        return (self.root / rel).is_file()


@pytest.fixture(params=["file", "s3"])
def dest(request, tmp_path):
    if request.param == "file":
        root = tmp_path / "remote"
        return Destination("file", f"file://{root}", root=root)
    server = request.getfixturevalue("s3_env")
    bucket = new_bucket(server)
    return Destination("s3", f"s3://{bucket}/runs", server=server, bucket=bucket)
