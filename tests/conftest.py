"""Shared fixtures. S3 tests use a real SeaweedFS server on 127.0.0.1 (tests/s3server.py), one per session,
with a fresh bucket per test; a test that kills its server gets its own (`own_s3_server`)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from s3server import SeaweedS3  # noqa: E402


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
