"""Shared fixtures; the helpers they build on are in tests/helpers.

S3 tests use a real SeaweedFS server on 127.0.0.1 (`helpers.s3server`), one per session, with a fresh bucket per test;
a test that kills its server gets its own (`own_s3_server`). Every test that reaches a server through these fixtures
is marked `s3` here, so `-m "not s3"` never starts one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.artifacts import Destination, commit_files
from helpers.s3server import SeaweedS3

SERVER_FIXTURES = {"s3_server", "own_s3_server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `s3` every test whose fixtures start or use a SeaweedFS server, however indirectly it asks for one; then
    order the files longest first (the engine's, then the other `slow` ones, each group in name order), so that
    `make test`'s workers, which take a file at a time in this order (`--dist loadfile --no-loadscope-reorder`), do not
    end with one long file left on one of them."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.s3)
    items.sort(key=lambda item: 0 if item.get_closest_marker("engine") else 1 if item.get_closest_marker("slow") else 2)


@pytest.fixture(scope="session", autouse=True)
def own_checksum_cache(tmp_path_factory):
    """The local-file checksum cache in a folder of this test session (inherited by the CLIs the tests start), never the
    user's."""
    before = os.environ.get("BLOCKDRAFT_CACHE_DIR")
    os.environ["BLOCKDRAFT_CACHE_DIR"] = str(tmp_path_factory.mktemp("checksum-cache"))
    yield
    if before is None:
        os.environ.pop("BLOCKDRAFT_CACHE_DIR", None)
    else:
        os.environ["BLOCKDRAFT_CACHE_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Every model in these tests is tiny: a second intra-op thread gains nothing and, on a busy 2-core machine,
    spinning OpenMP threads make it many times slower. Subprocesses (torchrun ranks, killed CLIs) set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_engine_thread(request, monkeypatch):
    """An engine server a test starts runs one OpenMP thread, as our own decode does here (`one_torch_thread`):
    `make test` runs a worker per core, and a server spinning a thread on every core beside another worker's tests is
    slowed many times over."""
    if request.node.get_closest_marker("engine"):
        monkeypatch.setenv("OMP_NUM_THREADS", "1")


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
        server.stop(grace_s=0)  # its data dir goes with the test


def isolate_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS setting of the machine running the tests may leak in: no profiles, no config files, no env keys."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path):
    """The session server's admin identity through the standard AWS environment variables."""
    isolate_aws(monkeypatch, tmp_path)
    for key, value in s3_server.admin.env(s3_server.endpoint).items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env):
    """A fresh, empty bucket on the session server, with the admin identity in the environment."""
    return s3_env.new_bucket()


@pytest.fixture
def make_artifact():
    """make(root, {relpath: bytes}, kind=..., lineage=...) -> root: files written and committed locally."""
    return commit_files


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def dest(request, tmp_path):
    """Each test that takes it runs twice: against a local folder and against a prefix in a fresh S3 bucket."""
    if request.param == "file":
        return Destination.folder(tmp_path / "remote")
    return Destination.s3(request.getfixturevalue("s3_env"))


@pytest.fixture
def leases_given_back():
    """A lease test gives back every lease it took."""
    from blockdraft.store import lease

    before = sorted(lease._held)  # the output roots whose lease this process holds
    yield
    assert sorted(lease._held) == before  # every lease taken in a test was given back
