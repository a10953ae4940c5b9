"""Target agreement in `status`'s view of a tokenized artifact: `tokenize --check-target` notes the share it measured
beside the artifact, bound to its manifest; `status` shows it with the artifact's counts, push and pull carry it, and a
record that does not name the artifact's manifest (the artifact made again, or a record edited) is not shown."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.store.local import LocalStore
from blockdraft.store.manifest import AGREEMENT_NAME, manifest_sha256, read_manifest

ROWS = 12


def cli(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def _completions(folder: Path, rows: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = (TINY_TARGET_DIR / "completions.jsonl").read_text().splitlines()[:rows]
    (folder / "completions.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _config(tmp: Path) -> Path:
    path = tmp / "blockdraft.toml"
    path.write_text(f'[target]\npath = "{TINY_TARGET_DIR}"\n[tokenize]\nheld_out_fraction = 0.0\n'
                    '[train]\ntarget_agreement_rows = 6\n')
    return path


def _shown(status_output: str, url_part: str) -> str | None:
    """The target_agreement field of the status line of the artifact whose URL ends with `url_part`, or None."""
    for line in status_output.splitlines():
        fields = line.split("\t")
        if len(fields) == 5 and fields[2].rstrip("/").endswith(url_part):
            found = re.search(r"target_agreement=([0-9.]+) \(([^,]+), (\d+) rows\)", fields[4])
            return found.group(0) if found else None
    raise AssertionError(f"no status line for {url_part}: {status_output}")


def test_check_target_records_the_share_status_shows_it_and_push_and_pull_carry_it(tmp_path, dest):
    config = _config(tmp_path)
    tokenized = tmp_path / "work" / "tokenized"
    made = cli("tokenize", _completions(tmp_path / "completions", ROWS), tokenized, "--check-target", "--config",
               config)
    assert made.exit_code == 0, made.output
    said = re.search(r"target agreement (\d\.\d\d): ", made.stderr.replace("\n", " "))
    assert said is not None, made.output
    record = json.loads((tokenized / AGREEMENT_NAME).read_text())
    assert record["target"] == TINY_TARGET_DIR.name and record["rows"] == 6

    local = cli("status", tmp_path / "work")
    # the record is bookkeeping: the artifact still verifies, nothing incomplete
    assert local.exit_code == 0, local.output
    shown = _shown(local.stdout, "tokenized")
    assert shown is not None and shown.startswith(f"target_agreement={record['agreement']:.3f} "
                                                  f"({TINY_TARGET_DIR.name}, 6 rows)")
    assert f"{record['agreement']:.2f}" == said.group(1)

    endpoint = ["--endpoint-url", dest.server.endpoint] if dest.kind == "s3" else []
    pushed = cli("push", tokenized, dest.sub("tokenized"), *endpoint)
    assert pushed.exit_code == 0, pushed.output
    remote = cli("status", dest.url, *endpoint)
    assert remote.exit_code == 0, remote.output
    assert _shown(remote.stdout, "tokenized") == shown
    pulled = cli("pull", dest.sub("tokenized"), tmp_path / "node" / "tokenized", *endpoint)
    assert pulled.exit_code == 0, pulled.output
    assert _shown(cli("status", tmp_path / "node").stdout, "tokenized") == shown


def test_a_record_that_names_another_manifest_is_not_shown(tmp_path):
    config = _config(tmp_path)
    tokenized = tmp_path / "work" / "tokenized"
    made = cli("tokenize", _completions(tmp_path / "completions", ROWS), tokenized, "--check-target", "--config",
               config)
    assert made.exit_code == 0, made.output
    record = (tokenized / AGREEMENT_NAME).read_bytes()
    assert _shown(cli("status", tmp_path / "work").stdout, "tokenized") is not None

    # The artifact made again from other rows, without --check-target: the old record says nothing about these rows.
    remade = cli("tokenize", _completions(tmp_path / "fewer", ROWS - 4), tokenized, "--config", config, "--force")
    assert remade.exit_code == 0, remade.output
    (tokenized / AGREEMENT_NAME).write_bytes(record)  # as the first run left it, whatever the remake did with it
    after = cli("status", tmp_path / "work")
    assert after.exit_code == 0, after.output
    assert _shown(after.stdout, "tokenized") is None

    # Bound to the manifest it holds now, the same record is shown; with a share that is not a number, it is not.
    found = read_manifest(LocalStore(tokenized))
    assert found is not None
    current = {**json.loads(record), "manifest_sha256": manifest_sha256(found[1]), "agreement": 0.5}
    (tokenized / AGREEMENT_NAME).write_text(json.dumps(current))
    assert _shown(cli("status", tmp_path / "work").stdout, "tokenized") == ("target_agreement=0.500 "
                                                                            f"({TINY_TARGET_DIR.name}, 6 rows)")
    (tokenized / AGREEMENT_NAME).write_text(json.dumps({**current, "agreement": "high"}))
    assert _shown(cli("status", tmp_path / "work").stdout, "tokenized") is None
