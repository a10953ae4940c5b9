"""Our S3 data path against the transfer libraries that could replace it, and s5cmd, on the same local SeaweedFS.

    .venv/bin/python -m bench.transfer_libraries [--gib 1] [--files 8] [--repeats 3] [--tools ...]

One artifact of about 1 GiB in `--files` files (random bytes), the same part size and concurrency for every client
(blockdraft's defaults: 64 MiB parts, 8 in flight in all), each transfer in its own child process timed from the
first library call (client creation included, imports and interpreter start-up not; s5cmd: the whole process).

Up (every upload sends CRC64NVME per part and the file's full-object CRC64NVME, taken from the manifest as push does,
so the server rejects damaged bytes; files uploaded in parallel):
  push         blockdraft `push` (what `bench.transfer` times: uploads, HEAD read-back, manifest, verify)
  ours         blockdraft's data path alone: `S3Store.put_file` of each file, on its shared part pool
  boto3        s3transfer's classic manager (`create_transfer_manager`, TransferConfig of our part size and
               concurrency), ExtraArgs ChecksumCRC64NVME: s3transfer then asks for ChecksumType FULL_OBJECT
  crt          awscrt's `S3Client` itself (TLS off, path-style requests to 127.0.0.1), `send_filepath`, checksum
               config CRC64NVME in the trailer, the full-object value in the request's header
  obstore      obstore (Rust object_store) `put_async` of each file, `checksum_algorithm="CRC64NVME"` (not a
               dependency: `pip install obstore` to measure it; left out when absent)
  s5cmd        `s5cmd cp` (no checksums): the reference

Down (every download ends with the file on disk and its full-object CRC64NVME compared with the manifest's; where
the library does not check it, the child does, and the figure includes that):
  pull         blockdraft `pull` (ranged GETs checksummed as received, O_DIRECT writes, manifest read-back)
  ours         `S3Store.get_file` of each file (ranged GETs on the part pool, checksummed as received)
  boto3        `TransferManager.download` (ranged GETs, nothing verified), then each file read again for its CRC
  crt          `make_request(GET_OBJECT, recv_filepath=..., expected_checksum=..., direct_io)`: CRT checks it
  obstore      one streaming GET per file (`get_async(...).stream()`), written and checksummed as it arrives
  s5cmd        `s5cmd cp` (no checksums): the reference

Ratios are throughput ratios against the s5cmd run of the same round (>1: faster than s5cmd). Peak RSS is the
child's VmHWM; CPU s/GiB its user+sys from wait4 (best run).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.transfer import MIB, REPO, SeaweedS3, _loadavg, make_artifact, run_measured
from blockdraft.store.checksum import crc64nvme_file

PART = 64 * MIB  # blockdraft's default store.part_size_mib
CONCURRENCY = 8  # blockdraft's default store.concurrency
TOOLS = ("ours", "boto3", "crt", "obstore")
BUCKET = "bench"


def _sums(src_or_dst: str) -> dict[str, list]:
    """{file name: [size, crc]} written by the parent beside the artifact."""
    return json.loads(Path(os.environ["BENCH_SUMS"]).read_text())


def _check(folder: Path, sums: dict[str, list], got: dict[str, str]) -> None:
    for name, (_, crc) in sums.items():
        if got.get(name) != crc:
            raise SystemExit(f"{name}: crc64nvme {got.get(name)} != {crc}")
        if not (folder / name).is_file():
            raise SystemExit(f"{name} missing")


# ------------------------------------------------------------------------------------------------ children


def child_ours(op: str, local: Path, prefix: str, sums: dict[str, list]) -> None:
    from blockdraft.config import StoreConfig
    from blockdraft.store import open_store

    store = open_store(f"s3://{BUCKET}/{prefix}", StoreConfig())
    names = sorted(sums)
    with ThreadPoolExecutor(len(names)) as pool:
        if op == "up":
            list(pool.map(
                lambda n: store.put_file(n, local / n, sums[n][1]),  # pyright: ignore[reportAttributeAccessIssue]
                names))
        else:
            local.mkdir(parents=True)
            into = open_store(local)
            got = dict(zip(names, pool.map(
                lambda n: store.get_file(n, into, n)[1],  # pyright: ignore[reportAttributeAccessIssue]
                names)))
            _check(local, sums, got)


def child_boto3(op: str, local: Path, prefix: str, sums: dict[str, list]) -> dict:
    import boto3
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    from blockdraft.store.s3_client import _client_config

    client = boto3.client("s3", config=_client_config("us-east-1", os.environ["AWS_ENDPOINT_URL"], CONCURRENCY))
    config = TransferConfig(
        multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY,
        preferred_transfer_client="classic"
    )
    names = sorted(sums)
    with create_transfer_manager(client, config) as manager:
        if op == "up":
            futures = [
                manager.upload(str(local / n), BUCKET, prefix + n,
                               extra_args={"ChecksumCRC64NVME": sums[n][1]}) for n in names
            ]
        else:
            local.mkdir(parents=True)
            futures = [manager.download(BUCKET, prefix + n, str(local / n)) for n in names]
        for f in futures:
            f.result()
    if op == "down":
        moved = time.perf_counter()
        with ThreadPoolExecutor(len(names)) as pool:
            got = dict(zip(names, pool.map(lambda n: crc64nvme_file(local / n)[1], names)))
        _check(local, sums, got)
        return {"verify_s": time.perf_counter() - moved}
    return {}


def child_crt(op: str, local: Path, prefix: str, sums: dict[str, list]) -> None:
    from awscrt import auth, http, s3

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    host = endpoint.split("//", 1)[1]
    creds = auth.AwsCredentialsProvider.new_static(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    client = s3.S3Client(
        region="us-east-1",
        tls_mode=s3.S3RequestTlsMode.DISABLED,
        signing_config=s3.create_default_s3_signing_config(region="us-east-1", credential_provider=creds),
        part_size=PART,
        multipart_upload_threshold=PART,
        max_active_connections_override=CONCURRENCY,
    )
    names = sorted(sums)
    requests = []
    if op == "up":
        for n in names:
            headers = http.HttpHeaders([("Host", host), ("Content-Length", str(sums[n][0])),
                                        ("x-amz-checksum-crc64nvme", sums[n][1])])
            requests.append(client.make_request(
                type=s3.S3RequestType.PUT_OBJECT,
                request=http.HttpRequest("PUT", f"/{BUCKET}/{prefix}{n}", headers),
                send_filepath=str(local / n),
                checksum_config=s3.S3ChecksumConfig(algorithm=s3.S3ChecksumAlgorithm.CRC64NVME,
                                                    location=s3.S3ChecksumLocation.TRAILER),
            ))
    else:
        local.mkdir(parents=True)
        for n in names:
            requests.append(client.make_request(
                type=s3.S3RequestType.GET_OBJECT,
                request=http.HttpRequest("GET", f"/{BUCKET}/{prefix}{n}", http.HttpHeaders([("Host", host)])),
                recv_filepath=str(local / (n + ".part")),
                checksum_config=s3.S3ChecksumConfig(
                    expected_checksum=sums[n][1], expected_checksum_algorithm=s3.S3ChecksumAlgorithm.CRC64NVME,
                    response_validation_mode=s3.S3ChecksumValidationMode.FULL_OBJECT,
                ),
                fio_options=s3.S3FileIoOptions(direct_io=True),
            ))
    for r in requests:
        r.finished_future.result()
    if op == "down":
        for n in names:
            os.rename(local / (n + ".part"), local / n)


def child_obstore(op: str, local: Path, prefix: str, sums: dict[str, list]) -> None:
    import obstore
    from awscrt import checksums
    from obstore.store import S3Store

    from blockdraft.store.s3_client import b64

    store = S3Store(
        BUCKET,
        endpoint=os.environ["AWS_ENDPOINT_URL"],
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region="us-east-1",
        virtual_hosted_style_request=False,
        unsigned_payload=True,
        checksum_algorithm="CRC64NVME",
        client_options={"allow_http": True},
    )
    names = sorted(sums)

    async def up() -> None:
        # One part in flight per file, files in parallel: CONCURRENCY parts in flight in all, as ours.
        await asyncio.gather(*[
            obstore.put_async(store, prefix + n, local / n, chunk_size=PART,
                              max_concurrency=max(1, CONCURRENCY // len(names)))
            for n in names
        ])

    async def down_one(n: str) -> str:
        resp = await obstore.get_async(store, prefix + n)
        crc = 0
        fd = os.open(local / n, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            async for chunk in resp.stream(min_chunk_size=8 * MIB):
                view = memoryview(chunk)
                crc = checksums.crc64nvme(view, crc)  # pyright: ignore[reportArgumentType]
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return b64(crc)

    async def down() -> None:
        local.mkdir(parents=True)
        got = dict(zip(names, await asyncio.gather(*[down_one(n) for n in names])))
        _check(local, sums, got)

    asyncio.run(up() if op == "up" else down())


def child(tool: str, op: str, local: str, prefix: str) -> None:
    sums = _sums(local)
    run = {"ours": child_ours, "boto3": child_boto3, "crt": child_crt, "obstore": child_obstore}[tool]
    start = time.perf_counter()
    extra = run(op, Path(local), prefix, sums) or {}
    print(json.dumps({"seconds": time.perf_counter() - start, **extra}), flush=True)
    # Leave without interpreter teardown: a library's native runtime aborting at exit (seen once with 1 GiB) is not
    # the transfer being timed.
    os._exit(0)


# ------------------------------------------------------------------------------------------------ parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS))
    parser.add_argument("--child", nargs=4, metavar=("TOOL", "OP", "LOCAL", "PREFIX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return

    tools = ["push_pull", *[t for t in args.tools.split(",") if t], "s5cmd"]
    if "obstore" in tools and importlib.util.find_spec("obstore") is None:
        print(
            "obstore is not installed (not a dependency of blockdraft: `pip install obstore` to measure it); left out"
        )
        tools.remove("obstore")
    load_before = _loadavg()
    work = Path(tempfile.mkdtemp(prefix="bd-bench-libs-"))
    s5cmd = str(Path(sys.executable).parent / "s5cmd")
    up: dict[str, list[tuple[float, int, float]]] = {t: [] for t in tools}
    down: dict[str, list[tuple[float, int, float]]] = {t: [] for t in tools}
    notes: dict[str, list[float]] = {}
    stored: dict[str, set[str]] = {}
    try:
        with SeaweedS3(work / "server") as server:
            admin = server.client()
            admin.create_bucket(Bucket=BUCKET)
            local = work / "artifact"
            total = make_artifact(local, int(args.gib * 1024 * MIB), args.files)
            sums = {p.name: list(crc64nvme_file(p)) for p in sorted(local.glob("shard-*"))}
            (work / "sums.json").write_text(json.dumps(sums))
            env = {**os.environ, **server.admin.env(server.endpoint), "BENCH_SUMS": str(work / "sums.json")}
            me = [sys.executable, "-m", "bench.transfer_libraries", "--child"]
            bt = [sys.executable, "-m", "bench.transfer", "--child"]

            def timed(argv: list[str]) -> tuple[tuple[float, int, float], dict]:
                seconds, rss, cpu, out = run_measured(argv, env)
                if argv[0] == s5cmd:
                    return (seconds, rss, cpu), {}
                got = json.loads(out.strip().splitlines()[-1])
                return (got.pop("seconds"), rss, cpu), got

            def step(tool: str, op: str, rep: int) -> None:
                prefix = f"{tool}-{rep}/"
                there = work / f"down-{tool}-{rep}"
                if tool == "push_pull":
                    argv = bt + (
                        ["push", str(local), f"s3://{BUCKET}/{prefix}"]
                        if op == "up"
                        else ["pull", f"s3://{BUCKET}/{prefix}", str(there)]
                    )
                elif tool == "s5cmd":
                    argv = [s5cmd, "--endpoint-url", server.endpoint, "cp"]
                    argv += (
                        [str(local / "shard-*"), f"s3://{BUCKET}/{prefix}"]
                        if op == "up"
                        else [f"s3://{BUCKET}/{prefix}*", f"{there}/"]
                    )
                else:
                    argv = me + [tool, op, str(local if op == "up" else there), prefix]
                result, extra = timed(argv)
                (up if op == "up" else down)[tool].append(result)
                if op == "up" and tool != "push_pull":
                    # What the server holds: a FULL_OBJECT CRC64NVME equal to the manifest's, or what instead.
                    for name, (_, crc) in sums.items():
                        head = admin.head_object(Bucket=BUCKET, Key=prefix + name, ChecksumMode="ENABLED")
                        kind = (f"{head.get('ChecksumType')} crc64nvme "
                                f"{'=' if head.get('ChecksumCRC64NVME') == crc else '!='} manifest")
                        stored.setdefault(tool, set()).add(kind)
                for k, v in extra.items():
                    notes.setdefault(f"{tool} {op} {k}", []).append(v)
                shutil.rmtree(there, ignore_errors=True)

            for rep in range(args.repeats):
                # The order rotates each round, so no client always follows the same one.
                order = tools[rep % len(tools):] + tools[: rep % len(tools)]
                for tool in order:
                    step(tool, "up", rep)
                for tool in order[::-1]:
                    step(tool, "down", rep)
                print(f"round {rep + 1}: up " + " ".join(f"{t} {up[t][-1][0]:.2f}" for t in tools)
                      + " | down " + " ".join(f"{t} {down[t][-1][0]:.2f}" for t in tools), flush=True)
                for tool in tools:  # free the server's disk for the next round
                    keys = [
                        o["Key"]
                        for page in admin.get_paginator("list_objects_v2").paginate(
                            Bucket=BUCKET, Prefix=f"{tool}-{rep}/"
                        )
                        for o in page.get("Contents", [])
                    ]
                    for i in range(0, len(keys), 1000):
                        admin.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
            leftovers = admin.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gib = total / 1024**3
    print(f"artifact: {total / MIB:.0f} MiB in {args.files} files; {args.repeats} rounds; part {PART // MIB} MiB x "
          f"{CONCURRENCY}")
    print(f"{'transfer':<16}{'best MB/s':>10}{'median MB/s':>12}{'peak RSS MiB':>14}{'CPU s/GiB':>11}"
          f"{'ratio/s5cmd best':>18}{'median':>8}   runs (s)")
    for label, results in (("up", up), ("down", down)):
        ref = results["s5cmd"]
        for tool in tools:
            runs = results[tool]
            seconds, _, cpu = min(runs)
            median_s = sorted(t for t, _, _ in runs)[len(runs) // 2]
            ratios = sorted(r[0] / o[0] for o, r in zip(runs, ref, strict=True))
            print(
                f"{tool + ' ' + label:<16}{total / seconds / 1e6:>10.0f}{total / median_s / 1e6:>12.0f}"
                f"{max(r for _, r, _ in runs):>14}"
                f"{cpu / gib:>11.2f}{ratios[-1]:>18.2f}{ratios[len(ratios) // 2]:>8.2f}   "
                + " ".join(f"{t:.2f}" for t, _, _ in runs)
            )
    for key, values in notes.items():
        print(f"{key}: " + " ".join(f"{v:.2f}" for v in values))
    for tool, kinds in stored.items():
        print(f"{tool}: objects stored with " + ", ".join(sorted(kinds)))
    print(f"unfinished multipart uploads left on the server: {len(leftovers)}")
    print(f"(load average before {load_before}, after {_loadavg()}, on {os.cpu_count()} cores)")


if __name__ == "__main__":
    os.chdir(REPO)
    main()
