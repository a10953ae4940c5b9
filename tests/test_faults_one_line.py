"""A careless user's paths meet one line and a non-zero exit, never a traceback: an output that is a file or a folder
that cannot be written (pull, export), `verify` of a file, a full disk in `push` to a folder and in `export`, a
`--progress` page in a missing folder, `status` of a path with nothing there, `train` over a checkpoint that does not
verify; and `push` says what it compared at the destination.

A full disk is a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) on a CLI subprocess: every write past it fails with
EFBIG, as a full disk fails with ENOSPC, through the same code. A read-only folder is an empty one under /sys, which
refuses new files even to root (chmod does not stop root).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import GOLDEN
from helpers.train_data import config_file, make_rows, write_tokenized
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, DFlashConfig, TargetConfig
from blockdraft.model import DFlashDrafter
from blockdraft.model.formats import WEIGHTS_NAME
from blockdraft.stages.train import save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, check_method, verify_artifact
from blockdraft.store.base import LEASE_NAME
from blockdraft.store.local import TMP_PREFIX
from blockdraft.store.transfer import INCOMING_DIR

pytestmark = pytest.mark.fault


def one_line_error(output: str, exit_code: int) -> str:
    """The one error line of a refused command (exit status 2, nothing else printed, no traceback)."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (exit_code, output)
    assert "Traceback" not in output
    return lines[0]


def invoke(*args: object) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return one_line_error(result.output, result.exit_code)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TMP_PREFIX)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A committed checkpoint of the golden drafter (what export reads)."""
    cfg = BlockdraftConfig(
        target=TargetConfig(path=str(GOLDEN / "target")),
        dflash=DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5],
                            num_draft_layers=3, gamma=3.0),
    )
    run = tmp_path_factory.mktemp("ckpt") / "run"
    save_checkpoint(open_store(run), 10, DFlashDrafter.from_pretrained(GOLDEN / "drafter"), {"step": 10},
                    cfg.resolved(), [], {"step": 10})
    return run / "step-00000010"


@pytest.fixture
def artifact(tmp_path, make_artifact) -> Path:
    return make_artifact(tmp_path / "art", {"a.txt": b"hello\n", "big.bin": os.urandom(300_000)})


def read_only_folder() -> Path:
    """An empty folder that refuses new files even to root: one under /sys (sysfs creates no file a user asks for)."""
    for base in (Path("/sys/class"), Path("/sys/kernel")):
        for folder in sorted(base.iterdir()) if base.is_dir() else []:
            try:
                if folder.is_symlink() or not folder.is_dir() or any(folder.iterdir()):
                    continue
                (folder / "blockdraft-probe").open("wb").close()
            except OSError:
                return folder
            (folder / "blockdraft-probe").unlink()
    pytest.skip("no empty folder under /sys refuses writes on this machine")


def cli_with_file_size_limit(limit: int, args: list[object], tmp: Path) -> subprocess.CompletedProcess:
    """The CLI in a subprocess that may write no file past `limit` bytes (EFBIG, as a full disk gives ENOSPC), its temp
    folder `tmp`."""

    def limit_writes() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "blockdraft", *map(str, args)], capture_output=True, text=True, env=env,
        preexec_fn=limit_writes, timeout=300,
    )


# ---- an output path that is a file, a folder that cannot be written, an input that is a file


def test_pull_into_a_path_that_is_a_file_is_one_line_and_leaves_the_file(tmp_path, artifact):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine\n")
    line = invoke("pull", artifact, mine)
    assert line == f"error: pull destination {mine} is a file, not a folder; pull into a folder"
    assert mine.read_text() == "mine\n"
    line = invoke("pull", artifact, mine / "sub")
    assert f"pull destination {mine / 'sub'} lies under {mine}, a file" in line


def test_export_into_a_path_that_is_a_file_is_one_line_and_leaves_the_file(tmp_path, checkpoint):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine\n")
    line = invoke("export", checkpoint, mine)
    assert line == f"error: export destination {mine} is a file, not a folder; export into a folder"
    assert mine.read_text() == "mine\n"


def test_verify_of_a_file_names_it_and_the_folder_to_pass(artifact):
    line = invoke("verify", artifact / MANIFEST_NAME)
    assert line == (f"error: artifact {artifact / MANIFEST_NAME} is a file, not a folder; pass the folder that holds "
                    f"its {MANIFEST_NAME}")


def test_pull_and_export_into_a_folder_that_refuses_writes_are_one_line(artifact, checkpoint):
    folder = read_only_folder()
    for args, again in ((["pull", artifact, folder], "rerun the pull"),
                        (["export", checkpoint, folder], "rerun the export")):
        line = invoke(*args)
        assert line.startswith(f"error: cannot write files in {folder} (") and line.endswith(
            f"choose another folder, then {again}" + (" (nothing was committed)" if args[0] == "export" else "")
        ), line
    assert not any(folder.iterdir())


# ---- a full disk


def test_a_full_disk_during_a_push_to_a_folder_is_one_line_and_leaves_no_temp_file(tmp_path, artifact):
    dest = tmp_path / "dest"
    proc = cli_with_file_size_limit(100_000, ["push", artifact, f"file://{dest}"], tmp_path / "tmp")
    line = one_line_error(proc.stderr, proc.returncode)
    assert line.startswith(f"error: disk full writing big.bin in file://{dest} (") and line.endswith(
        "free space, then rerun the push (files verified there are skipped)"), line
    assert proc.stdout == "" and temp_files(dest) == [] and not (dest / MANIFEST_NAME).exists()
    assert not (dest / LEASE_NAME).exists()
    # With room again, the rerun finishes: the file that was whole stays and is skipped.
    again = CliRunner().invoke(app, ["push", str(artifact), f"file://{dest}"])
    assert again.exit_code == 0 and "1 already verified and skipped" in again.output, again.output
    assert verify_artifact(open_store(dest)).state is State.VERIFIED


def test_a_full_disk_during_an_export_is_one_line_and_leaves_no_temp_file(tmp_path, checkpoint):
    out, tmp = tmp_path / "export", tmp_path / "tmp"
    proc = cli_with_file_size_limit(100_000, ["export", checkpoint, out], tmp)
    line = one_line_error(proc.stderr, proc.returncode)
    assert (line.startswith("error: disk full in ")
            and line.endswith("free space, then rerun the export (nothing was committed)")), line
    assert list(tmp.iterdir()) == []  # the folder the export files were made in is gone
    assert temp_files(out) == [] and not (out / MANIFEST_NAME).exists() and not (out / LEASE_NAME).exists()


# ---- status


def test_status_with_a_progress_page_in_a_missing_folder_fails_before_the_survey(tmp_path, artifact):
    page = tmp_path / "missing" / "dir" / "P.md"
    result = CliRunner().invoke(app, ["status", str(artifact), "--progress", str(page)])
    line = one_line_error(result.output, result.exit_code)
    assert line == (f"error: --progress {page}: the folder {page.parent} does not exist; create it or write the page "
                    "elsewhere")


def test_status_of_a_path_with_nothing_there_exits_2(tmp_path):
    typo = tmp_path / "stroe"
    line = invoke("status", typo)
    assert line.startswith(f"error: nothing under file://{typo}: no manifest and no finished file") and line.endswith(
        "check the path or URL"
    )
    # A pull killed in its first download leaves its lease and an unfinished temp file, and nothing a reader may use.
    interrupted = tmp_path / "pulled"
    (interrupted / INCOMING_DIR).mkdir(parents=True)
    (interrupted / INCOMING_DIR / f"{TMP_PREFIX}model").write_bytes(b"half")
    (interrupted / LEASE_NAME).write_text("{}")
    assert invoke("status", interrupted).startswith(f"error: nothing under file://{interrupted}: ")


# ---- what push compared


def test_push_says_what_it_compared_at_the_destination(dest, artifact):
    result = CliRunner().invoke(app, ["push", str(artifact), dest.url])
    assert result.exit_code == 0, result.output
    method = check_method(open_store(dest.url), deep=False)
    assert method in " ".join(result.output.split())
    if dest.kind == "s3":
        assert "checksums as stored by the server" in method


# ---- a training run whose only checkpoint does not verify


def test_a_run_whose_only_checkpoint_is_corrupt_stops_naming_it_unless_force(tmp_path):
    rows = make_rows(3, prompt_len=5, new_tokens=16, seed=3)
    data = write_tokenized(tmp_path / "tokenized", rows[:2], rows[2:])
    config = config_file(tmp_path, data, max_steps=2, checkpoint_every=2, batch_size=1)
    assert CliRunner().invoke(app, ["train", "--config", str(config)]).exit_code == 0
    weights = tmp_path / "ckpt" / "step-00000002" / WEIGHTS_NAME
    flipped = bytearray(weights.read_bytes())
    flipped[-8:] = bytes(b ^ 0xFF for b in flipped[-8:])
    weights.write_bytes(bytes(flipped))

    refused = CliRunner().invoke(app, ["train", "--config", str(config)])
    errors = [line for line in refused.output.splitlines() if "error:" in line]
    assert refused.exit_code == 2 and len(errors) == 1 and "Traceback" not in refused.output, refused.output
    assert errors[0].startswith(f"error: no checkpoint under {open_store(tmp_path / 'ckpt').url} verifies "
                                "(step-00000002 (corrupt: ")
    assert errors[0].endswith("or rerun with --force to start over")
    assert weights.read_bytes() == bytes(flipped)  # not overwritten

    forced = CliRunner().invoke(app, ["train", "--config", str(config), "--force"])
    assert forced.exit_code == 0, forced.output
    assert "--force: training starts over at step 0" in " ".join(forced.output.split())
    assert verify_artifact(open_store(weights.parent)).state is State.VERIFIED
