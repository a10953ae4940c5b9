"""Concurrent writers on one output: N trials of two `blockdraft push` processes (different artifacts, one S3 prefix on
a local SeaweedFS) started together, N trials of two `blockdraft tokenize` runs into one folder, and N of two
`blockdraft train` runs (seeds 0 and 1) into one train.output.

    .venv/bin/python -m bench.writers [--trials 20] [--train-trials 20]

For each trial it records both exit codes and checks, after both ended, that the output verifies (bytes read back) and
holds the manifest of a process that said `verified`; a loser must exit 2 naming the lease's owner. Prints one JSON line
per kind: trials, trials where both overlapped (one lost), false `verified` (must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from blockdraft.store import open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    State,
    commit_artifact,
    entry_for_local_file,
    read_manifest,
    verify_artifact,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from helpers.paths import TOKENIZER_DIR  # noqa: E402
from helpers.s3server import SeaweedS3  # noqa: E402
from helpers.tokenize_data import make_corpus  # noqa: E402


def _artifact(root: Path, fill: int) -> Path:
    root.mkdir(parents=True)
    for k in range(4):
        (root / f"shard-{k}.bin").write_bytes(bytes([fill]) * 3_000_000)
    commit_artifact(open_store(root), "tokenized", [entry_for_local_file(root, p) for p in sorted(root.glob("*.bin"))])
    return root


def _race(argvs: list[list[str]]) -> list[tuple[int, str]]:
    procs = [subprocess.Popen([sys.executable, "-m", "blockdraft", *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for a in argvs]
    return [(p.wait(), p.communicate()[1]) for p in procs]


def _judge(url: str, results: list[tuple[int, str]], allowed: list[bytes]) -> dict[str, int]:
    """One trial's outcome: overlapped (one process lost the lease), false_verified (a `verified` the output
    contradicts)."""
    losers = [err for rc, err in results if rc == 2 and "is being written by pid" in err]  # the lease's line
    other = [rc for rc, err in results if rc != 0 and err not in losers]
    report = verify_artifact(open_store(url), deep=True)
    found = read_manifest(open_store(url))
    holds_a_winner = found is not None and (not allowed or found[1] in allowed)
    false = int(any(rc == 0 for rc, _ in results) and (report.state is not State.VERIFIED or not holds_a_winner))
    return {"overlapped": int(bool(losers)), "false_verified": false, "other_failures": len(other)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--train-trials", type=int, default=20, help="two train runs into one output, this many times "
                                                                     "(0: skip)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-writers-") as tmp, SeaweedS3(Path(tmp) / "s3") as server:
        os.environ.update(server.admin.env(server.endpoint))
        arts = [_artifact(Path(tmp) / f"a{i}", i + 1) for i in range(2)]
        manifests = [(a / MANIFEST_NAME).read_bytes() for a in arts]
        totals = {"kind": "push", "trials": args.trials, "overlapped": 0, "false_verified": 0, "other_failures": 0}
        for _ in range(args.trials):
            url = f"s3://{server.new_bucket()}/run/tokenized"
            results = _race([["push", str(a), url] for a in arts])
            winners = [manifests[i] for i, (rc, _) in enumerate(results) if rc == 0]
            for key, value in _judge(url, results, winners).items():
                totals[key] += value
        print(json.dumps(totals))

        corpus = make_corpus(Path(tmp) / "corpus", files=2, per_file=40)
        totals = {"kind": "tokenize", "trials": args.trials, "overlapped": 0, "false_verified": 0, "other_failures": 0}
        for trial in range(args.trials):
            out = Path(tmp) / f"tok-{trial}"
            results = _race(
                [
                    ["tokenize", str(corpus), str(out), "--tokenizer", str(TOKENIZER_DIR), "--max-length", str(m)]
                    for m in (512, 256)
                ]
            )
            for key, value in _judge(str(out), results, []).items():
                totals[key] += value
        print(json.dumps(totals))
        if args.train_trials:
            print(json.dumps(_train_races(Path(tmp), args.train_trials)))


def _train_races(tmp: Path, trials: int) -> dict[str, object]:
    """Two `blockdraft train` runs (seeds 0 and 1) into one train.output: every checkpoint left there must verify and
    come from one run (the run identity in its manifest), and a run that exited 0 must be that run."""
    from helpers.train_data import config_file, make_rows, write_tokenized

    rows = make_rows(6, prompt_len=6, new_tokens=24, seed=0)
    data = write_tokenized(tmp / "train-data", rows[:4], rows[4:])
    totals: dict[str, object] = {"kind": "train", "trials": trials, "overlapped": 0, "false_verified": 0,
                                 "other_failures": 0}
    for trial in range(trials):
        out = tmp / f"ckpt-{trial}"
        configs = []
        for seed in (0, 1):
            folder = tmp / f"train-{trial}-{seed}"
            folder.mkdir()
            configs.append(config_file(folder, data, str(out), max_steps=4, checkpoint_every=2, seed=seed))
        results = _race([["train", "--config", str(c)] for c in configs])
        seeds = set()
        for info in sorted({i.key.split("/")[0] for i in open_store(out).list() if i.key.startswith("step-")}):
            report = verify_artifact(open_store(out).child(info))
            manifest = report.manifest
            if report.state is not State.VERIFIED or manifest is None:
                totals["false_verified"] = int(totals["false_verified"]) + int(any(rc == 0 for rc, _ in results))
                continue
            seeds.add(manifest.counts["run"]["seed"])
        winners = {seed for seed, (rc, _) in zip((0, 1), results) if rc == 0}
        totals["false_verified"] = int(totals["false_verified"]) + int(len(seeds) > 1 or not winners <= seeds)
        totals["overlapped"] = int(totals["overlapped"]) + int(
            any(rc == 2 and "is being written by pid" in err for rc, err in results)
        )
        totals["other_failures"] = int(totals["other_failures"]) + sum(rc not in (0, 2) for rc, _ in results)
    return totals


if __name__ == "__main__":
    main()
