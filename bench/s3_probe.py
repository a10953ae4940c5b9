"""What the two-client probe of `store/s3_client.py` costs and saves, against one botocore client configured by itself.

    .venv/bin/python -m bench.s3_probe [--cap 60] [--repeats 20]

Failing endpoints (time until the first request of a fresh store fails, one run each):
  refused  a 127.0.0.1 port nothing listens on (connection refused)
  silent   a 127.0.0.1 port that accepts connections and never answers
for: blockdraft's store (the probe client: 3 s connect, 5 s read, 2 tries, then the one StoreError line); one
botocore client with blockdraft's transfer settings only (5 s connect, 120 s read, 4 tries: what the transfers need);
one botocore client with the probe's short settings for everything. A run still waiting after `--cap` seconds is
reported as such, with what its settings allow.

Working endpoint (a local SeaweedFS): the median over `--repeats` of a fresh store's first request (a HEAD of an
absent key), with the probe and with it skipped, so its price on every command is measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3

from bench.transfer import REPO, SeaweedS3
from blockdraft.config import StoreConfig
from blockdraft.errors import StoreError
from blockdraft.store import open_store
from blockdraft.store.s3_client import (
    PROBE_ATTEMPTS,
    PROBE_CONNECT_TIMEOUT_S,
    PROBE_READ_TIMEOUT_S,
    TRANSFER_ATTEMPTS,
    TRANSFER_CONNECT_TIMEOUT_S,
    TRANSFER_READ_TIMEOUT_S,
    Connection,
    _client_config,
)


def _silent_port() -> tuple[int, list[socket.socket]]:
    """A port that accepts connections and never sends a byte (the accepted sockets are kept open)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = [server]

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1], held


def _refused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _time_to_error(fn, cap: float) -> str:
    """Seconds until `fn` raises (run in a daemon thread), or '> cap' while it still waits."""
    out: dict[str, object] = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            fn()
            out["result"] = "answered"
        except BaseException as exc:  # noqa: BLE001 - any failure is the outcome being timed
            out["result"] = type(exc).__name__
        out["seconds"] = time.perf_counter() - start

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(cap)
    if t.is_alive():
        return f"> {cap:.0f} s (still waiting)"
    return f"{out['seconds']:.2f} s ({out['result']})"


def failing(cap: float) -> None:
    silent, held = _silent_port()
    endpoints = {"refused": f"http://127.0.0.1:{_refused_port()}", "silent": f"http://127.0.0.1:{silent}"}
    transfer_bound = TRANSFER_ATTEMPTS * TRANSFER_READ_TIMEOUT_S
    print(f"transfer settings: {TRANSFER_CONNECT_TIMEOUT_S} s connect, {TRANSFER_READ_TIMEOUT_S} s read, "
          f"{TRANSFER_ATTEMPTS} tries (a silent endpoint: about {transfer_bound} s); probe: {PROBE_CONNECT_TIMEOUT_S} "
          f"s / {PROBE_READ_TIMEOUT_S} s / {PROBE_ATTEMPTS} tries")
    for label, endpoint in endpoints.items():

        def ours(endpoint: str = endpoint) -> None:
            try:
                open_store("s3://bench/p", StoreConfig(endpoint_url=endpoint)).head("x")
            except StoreError as exc:
                print(f"    ours said: {exc}")
                raise

        def one_client(probe: bool, endpoint: str = endpoint):
            client = boto3.client("s3", endpoint_url=endpoint,
                                  config=_client_config("us-east-1", endpoint, 8, probe=probe))
            return lambda: client.head_object(Bucket="bench", Key="p/x")

        print(f"{label}:")
        print(f"  blockdraft store (probe client first)      {_time_to_error(ours, cap)}")
        print(f"  one client, transfer settings              {_time_to_error(one_client(False), cap)}")
        print(f"  one client, probe settings for everything  {_time_to_error(one_client(True), cap)}")
    for s in held:
        s.close()


def working(repeats: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="bd-bench-probe-"))
    try:
        _working(work, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _working(work: Path, repeats: int) -> None:
    with SeaweedS3(work / "server") as server:
        server.client().create_bucket(Bucket="bench")
        os.environ.update(server.admin.env(server.endpoint))
        config = StoreConfig(endpoint_url=server.endpoint)
        real = Connection.reach

        def first_request(probe: bool) -> float:
            Connection.reach = real if probe else (lambda self, *a: None)  # type: ignore[method-assign]
            try:
                start = time.perf_counter()
                assert open_store("s3://bench/p", config).head("absent") is None
                return time.perf_counter() - start
            finally:
                Connection.reach = real  # type: ignore[method-assign]

        first_request(True)  # the botocore loader and service model, parsed once per process
        with_probe, without = [], []
        for _ in range(repeats):
            with_probe.append(first_request(True))
            without.append(first_request(False))
        a, b = statistics.median(with_probe) * 1e3, statistics.median(without) * 1e3
        print(f"working endpoint, a fresh store's first request (median of {repeats}): with the probe {a:.1f} ms, "
              f"without {b:.1f} ms: the probe costs {a - b:.1f} ms once per store connection")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
                       "AWS_REGION": "us-east-1"})
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        os.environ.pop(k, None)
    print(f"load average before {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    failing(args.cap)
    working(args.repeats)
    print(f"load average after {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    sys.stdout.flush()
    os._exit(0)  # the capped runs' threads still wait on their sockets


if __name__ == "__main__":
    os.chdir(REPO)
    main()
