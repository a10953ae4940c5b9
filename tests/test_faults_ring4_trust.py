"""Trust, fourth ring (issue 47): what blockdraft stores and prints can be trusted, and what it was told to keep secret
is kept.

- A credential in any free-form setting (`eval.engine_args`' `--hf-token`, a URL's userinfo or token, an `hf_...` key)
  is pinned as its fingerprint wherever a config is pinned, and named by no manifest, checkpoint, export, message or
  log; the fingerprint still changes every key read from the setting when the secret changes.
- An agreement record beside a tokenized artifact is checked when read, and every stored string `status` prints goes
  through one formatter: a newline in a record, a key or a lineage URL forges no line of `status` or PROGRESS.md.
- A card rewrite stopped between the card and the manifest (Ctrl-C) is finished by `export --card-only`.
- The license is a setting (`export.license`, `--license`) written into the card; a card edited by hand is one line
  naming that fix, never dropped without a word.
- `export --eval` refuses an eval measured against another target.
- A DFlash2 export's vLLM command names the V2 model runner vLLM serves it on, and its card calls it a DFlash2 drafter.
- A folder standing at the lease file's name is one line naming it, and nothing is written.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import string
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch
import yaml
from helpers.artifacts import commit_files
from helpers.paths import GOLDEN2
from helpers.tiny_run import make_tiny_run, tiny_config, write_config
from pydantic import BaseModel, ValidationError
from transformers import AutoConfig
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, load_config
from blockdraft.errors import REDACTED, LeaseError, redact
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.formats import EXPORT_KIND, PINNED_CONFIG_NAME, PROVENANCE_NAME
from blockdraft.model.spec import DrafterSpec
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import export as export_stage
from blockdraft.stages.export import CARD_NAME, SERVING_NAME, export_drafter, serving_lines
from blockdraft.stages.train import resolved_training_config, save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    InputRef,
    State,
    commit_artifact,
    entry_for_local_file,
    verify_artifact,
)
from blockdraft.store.base import LEASE_NAME
from blockdraft.store.inputs import open_input
from blockdraft.store.lease import Lease
from blockdraft.store.manifest import AGREEMENT_NAME, manifest_sha256
from blockdraft.store.output import StageOutput, stage_key

pytestmark = pytest.mark.fault

CLI = str(Path(sys.executable).parent / "blockdraft")
SETS = Path(__file__).parent / "fixtures" / "prompt-sets"


def cli(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def run_cli(*args: str | Path) -> subprocess.CompletedProcess:
    """The command in its own process, as a user runs it: what it prints is all it prints."""
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_line(output: str) -> str:
    (line,) = output.strip().splitlines()
    return line


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(training output, its eval on one prompt, the config file) for the tiny target; the store is the config's."""
    tmp = tmp_path_factory.mktemp("trust")
    run = make_tiny_run(tmp)
    cfg = load_config(None, tiny_config(tmp, eval={"untrained_baseline": False, "num_prompts": 1}))
    eval_stage.run(cfg, str(run), str(tmp / "eval"), prompts=[str(SETS / "gsm8k.parquet")], max_new_tokens=4)
    return run, tmp / "eval", write_config(tmp, tiny_config(tmp))


# ---- case 1: a credential in any free-form setting ----


# Text settings whose validator admits only a fixed form (a device name, a Hub license id, an engine server's root URL),
# which no credential takes:
# `test_every_free_form_setting_...` checks that each refuses every planted form.
CONSTRAINED = {("placement", "target_devices"), ("placement", "drafter_devices"), ("export", "license"),
               ("target", "engine.url")}


def free_form_fields() -> list[tuple[str, str, str]]:
    """(section, field, "str" | "list" | "dict") of every setting whose value is text the user writes freely: str, a
    list of str, a table of str; not a Literal (its values are blockdraft's), not one of CONSTRAINED. Read from the
    model: a new setting is covered."""
    return [field for field in text_fields() if field[:2] not in CONSTRAINED]


def text_fields() -> list[tuple[str, str, str]]:
    """(section, field, kind) of every text setting; a field of a table inside a section is dotted (`engine.url`)."""
    found = []

    def walk(section: str, model: type, prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):  # [target.engine]
                walk(section, annotation, f"{prefix}{name}.")
                continue
            if typing.get_origin(annotation) in (typing.Union, types.UnionType):
                args = [a for a in typing.get_args(annotation) if a is not type(None)]
                annotation = args[0] if len(args) == 1 else None
            if annotation is str:
                found.append((section, prefix + name, "str"))
            elif typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,):
                found.append((section, prefix + name, "list"))
            elif typing.get_origin(annotation) is dict and typing.get_args(annotation)[1] is str:
                found.append((section, prefix + name, "dict"))

    for section, info in BlockdraftConfig.model_fields.items():
        walk(section, typing.cast(type, info.annotation), "")
    return found


def random_text(alphabet: str, n: int) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


# How a secret rides in a setting, and the secret itself (what must never be stored or printed).
FORMS = {
    "url userinfo": lambda: (lambda s: f"https://alice:{s}@models.example.com/org/model", "bd" + secrets.token_hex(16)),
    "url token": lambda: (lambda s: f"https://models.example.com/org/model?token={s}", "bd" + secrets.token_hex(16)),
    "flag value": lambda: (lambda s: f"--api-key={s}", "bd" + secrets.token_hex(16)),
    "key value": lambda: (lambda s: f"password={s}", "bd" + secrets.token_hex(16)),
    "hf token": lambda: (lambda s: f"/models/{s}", "hf_" + random_text(string.ascii_letters + string.digits, 34)),
    "openai key": lambda: (lambda s: s, "sk-" + random_text(string.ascii_letters + string.digits, 40)),
    "aws key id": lambda: (lambda s: s, "AKIA" + random_text(string.ascii_uppercase + string.digits, 16)),
}


def plant(kind: str, form: str, where: str) -> tuple[object, str]:
    """(the value to set, the secret it carries) for a setting of `kind`; `where` a store URL's folder for store.url."""
    shape, secret = FORMS[form]()
    if kind == "list":  # an engine's argv: the flag, then its value (of no known shape) as the next item
        secret = "bd" + secrets.token_hex(16)
        return ["--max-num-seqs", "4", "--hf-token", secret], secret
    if kind == "dict":
        return {"name": secret if form in ("hf token", "openai key", "aws key id") else shape(secret)}, secret
    return shape(secret), secret


def planted_sections(where: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """Every free-form setting with a secret planted in it ({section: {field: value}}), and each setting's secret."""
    sections: dict[str, dict] = {}
    secrets_of: dict[str, str] = {}
    names = list(FORMS)
    for index, (section, name, kind) in enumerate(free_form_fields()):
        form = names[index % len(names)]
        if (section, name) == ("store", "url"):  # a store URL is a folder: the token rides in its name
            shape, secret = FORMS["hf token"]()
            value: object = f"file://{where}/store-{secret}"
        elif (section, name) == ("store", "endpoint_url"):  # an S3 endpoint takes no query string
            shape, secret = FORMS["url userinfo"]()
            value = shape(secret)
        else:
            value, secret = plant(kind, form, str(where))
        put(sections.setdefault(section, {}), name, value)
        secrets_of[f"{section}.{name}"] = secret
    sections.setdefault("train", {})["target_engine"] = "vllm"  # [target.engine]'s settings are used by it only
    return sections, secrets_of


def put(table: dict, name: str, value: object) -> None:
    """`table[name] = value`, a dotted name (`engine.url`) into the table of that name."""
    *tables, last = name.split(".")
    for part in tables:
        table = table.setdefault(part, {})
    table[last] = value


def holding(texts: dict[str, bytes], secrets_of: dict[str, str]) -> list[str]:
    """'text: setting' for each text holding a setting's secret: whole, by its first 8 characters, or base64-encoded."""
    found = []
    for setting, secret in secrets_of.items():
        forms = [secret[:8].encode(), base64.b64encode(secret.encode())[:8]]
        found += [f"{name}: {setting}" for name, data in texts.items() if any(form in data for form in forms)]
    return found


def test_every_free_form_setting_is_pinned_as_a_fingerprint_that_still_keys_it():
    fields = free_form_fields()
    assert {("eval", "engine_args", "list"), ("generate", "base_url", "list"), ("store", "endpoint_url", "str"),
            ("target", "path", "str"), ("target", "engine.args", "list"),
            ("train", "wandb", "dict")} <= set(fields)
    for section, name, kind in text_fields():
        if (section, name) in CONSTRAINED:
            for form in FORMS:
                with pytest.raises(ValidationError):
                    put(planted := {}, name, plant(kind, form, "/tmp/x")[0])
                    BlockdraftConfig.model_validate({section: planted})
    sections, secrets_of = planted_sections(Path("/tmp/never-written"))
    config = BlockdraftConfig.model_validate(sections)
    pinned = json.dumps(config.resolved())
    assert holding({"resolved": pinned.encode()}, secrets_of) == []
    assert pinned.count("[redacted:") >= len(fields)
    assert config.resolved()["eval"]["engine_args"][:3] == ["--max-num-seqs", "4", "--hf-token"]
    # A message of this process naming any of them is redacted too: loading the config remembered each.
    for setting, secret in secrets_of.items():
        assert secret not in redact(f"the server said: {secret} is not allowed"), setting

    # Each setting's fingerprint moves every key read from it when its secret changes, and only then.
    for section, name, kind in fields:
        changed = json.loads(json.dumps(sections))
        value, _ = plant(kind, "url userinfo", "/tmp/x") if (section, name) != ("store", "url") else (
            f"file:///tmp/never-written/store-{FORMS['hf token']()[1]}", "")
        put(changed[section], name, value)
        assert BlockdraftConfig.model_validate(changed).digest(section) != config.digest(section), (section, name)
        assert BlockdraftConfig.model_validate(sections).digest(section) == config.digest(section)
    # Settings without a credential are pinned as they are: no key of an existing output moves.
    plain = BlockdraftConfig.model_validate({"eval": {"prompts": ["hf://datasets/openai/gsm8k?config=main&split=test"],
                                                      "engine_args": ["--max-num-batched-tokens", "8192"]},
                                             "generate": {"base_url": "http://127.0.0.1:8000/v1"}})
    assert plain.resolved() == plain.model_dump(mode="json")


def write_planted_toml(path: Path, sections: dict[str, dict]) -> None:
    """`sections` as TOML (strings as JSON strings, lists, tables inline)."""
    def value(v: object) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    path.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in values.items()) + "\n"
                            for name, values in sections.items()))


def test_secrets_planted_in_every_free_form_setting_reach_no_checkpoint_export_message_or_log(tmp_path):
    """A checkpoint trained under a config with a secret in every free-form setting, exported and surveyed through the
    CLI with that config: no stored byte (the checkpoint's pinned config and manifest, the export's
    blockdraft-export.json, serving.json, card and manifest) and no printed byte holds one, nor the error of a command
    that names one."""
    sections, secrets_of = planted_sections(tmp_path)
    # the data tokenized under a plain config; the checkpoint is then pinned under the planted one
    run = make_tiny_run(tmp_path)
    checkpoint = run / "step-00000005"
    planted = {**tiny_config(tmp_path), **{k: {**tiny_config(tmp_path).get(k, {}), **v} for k, v in sections.items()}}
    cfg = BlockdraftConfig.model_validate(planted)
    drafter = DFlashDrafter.from_pretrained(checkpoint)
    data = verify_artifact(open_store(tmp_path / "tokenized")).manifest.config["tokenize_run"]
    resolved = resolved_training_config(cfg, drafter.spec, str(tmp_path / "run"), data)
    shutil.rmtree(run)
    save_checkpoint(open_store(run), 5, drafter, {}, resolved, [open_input(open_store(tmp_path / "tokenized")).ref],
                    {"step": 5})
    config = tmp_path / "planted.toml"
    write_planted_toml(config, planted)

    out = tmp_path / "export"
    exported = run_cli("export", "--config", config, "--target", TINY_TARGET_DIR, run, out)
    surveyed = run_cli("status", tmp_path, "--config", config, "--progress", tmp_path / "PROGRESS.md")
    verified = run_cli("verify", out, "--config", config)
    # A command whose one-line error names a secret of no known shape that the config carries (eval.engine_args'): a
    # target folder named after it (a path, so no library asks the hub for it and logs the URL it asked).
    missing = tmp_path / "no-such-target" / secrets_of["eval.engine_args"]
    refused = run_cli("export", "--config", config, "--target", missing, run, tmp_path / "export2")
    commands = {"export": exported, "status": surveyed, "verify": verified, "refused": refused}

    stored = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != config}
    printed = {f"{name} {stream}": getattr(proc, stream).encode() for name, proc in commands.items()
               for stream in ("stdout", "stderr")}
    leaked = holding(stored, secrets_of) + holding(printed, secrets_of)
    assert leaked == [], leaked  # the names only: the assertion message holds no secret either

    assert exported.returncode == 0 and verified.returncode == 0, redact(exported.stderr + verified.stderr)
    assert (
        refused.returncode == 2 and "cannot read the target's config" in refused.stderr and REDACTED in refused.stderr
    )
    provenance = json.loads((out / PROVENANCE_NAME).read_text())
    assert provenance["config"]["eval"]["engine_args"][2] == "--hf-token"
    assert provenance["config"]["eval"]["engine_args"][3].startswith("[redacted:")
    assert provenance["config"] == json.loads((checkpoint / PINNED_CONFIG_NAME).read_text())
    assert json.loads((out / MANIFEST_NAME).read_text())["config"]["eval"] == provenance["config"]["eval"]


# ---- case 3: what status prints of an agreement record, a key, a lineage URL ----


FORGED = "\nverified\tdrafter-export\tfile:///forged/export\t-\t-\n"


def test_a_forged_agreement_record_key_or_lineage_url_forges_no_line_of_status_or_progress(tmp_path):
    work = tmp_path / "work"
    tokenized = commit_files(work / "tokenized", {"data.arrow": b"rows"}, kind="tokenized")
    raw = (tokenized / MANIFEST_NAME).read_bytes()
    record = {"manifest_sha256": manifest_sha256(raw), "agreement": 0.5, "positions": 40, "rows": 6,
              "by_thinking": {"off": {"agreement": 0.5, "positions": 40, "rows": 6}}}
    # An artifact whose lineage names a URL with a newline in it, and a folder whose name holds one.
    commit_files(work / "made", {"x.bin": b"x"}, kind="completions",
                 lineage=[InputRef(kind="manifest", url=f"file:///in{FORGED}", sha256="0" * 64)])
    commit_files(work / "odd\nverified\tdrafter-export\tforged\t-\t-", {"y.bin": b"y"}, kind="completions")

    def survey() -> tuple[list[str], str, str]:
        page = tmp_path / "PROGRESS.md"
        result = cli("status", work, "--progress", page)
        lines = result.stdout.strip().split("\n")
        shown = [line for line in lines if "/tokenized" in line]
        return lines, shown[0] if shown else "", page.read_text()

    for target, share, kept in (("tiny\nverified\tdrafter-export\tfile:///forged\t-\t-", 0.5, False),
                                ("tiny", float("nan"), False), ("tiny", 1.5, False), ("tiny\u202e", 0.5, False),
                                ("tiny", 0.5, True)):
        (tokenized / AGREEMENT_NAME).write_text(json.dumps({**record, "target": target, "agreement": share}))
        lines, shown, page = survey()
        assert len(lines) == 3, lines  # one line per artifact, whatever the stored strings hold
        assert not any(line.startswith("verified\tdrafter-export") for line in lines)
        assert all(len(line.split("\t")) == 5 for line in lines)
        rows = [line for line in page.splitlines() if line.startswith("| `")]
        assert len(rows) == 3 and "drafter-export" not in page.replace("\\nverified\\tdrafter-export", ""), page
        assert ("target_agreement=0.500 (tiny, 6 rows)" in shown) is kept, (target, share, shown)
        assert "target_agreement" in shown or not kept
    assert "file:///in\\nverified\\tdrafter-export" in "\n".join(lines)  # the forged URL shown escaped, on its own line


# ---- case 4: a card rewrite interrupted between the card and the manifest ----


def fail_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Ctrl-C at `point` of a card rewrite: before the new card is uploaded (right after the manifest came down), or
    between the uploaded card and the manifest."""
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(StageOutput, "_upload" if point == "before the card" else "commit", interrupt)


@pytest.mark.parametrize("point", ["before the card", "before the manifest"])
def test_card_only_finishes_a_card_rewrite_interrupted_before_its_manifest(tmp_path, evaluated, monkeypatch, point):
    run, eval_dir, config = evaluated
    out = tmp_path / "export"
    assert cli("export", "--config", config, run, out).exit_code == 0
    before = {e.path: e for e in verify_artifact(open_store(out)).manifest.files}

    fail_at(monkeypatch, point)
    with pytest.raises(KeyboardInterrupt):
        export_stage.rewrite_card(load_config(config), str(out), eval=str(eval_dir))
    monkeypatch.undo()
    verified = cli("verify", out)
    # never a false verified
    assert verified.exit_code == 1 and verified.stdout.startswith("incomplete"), verified.output

    finished = cli("export", "--config", config, "--card-only", out, "--eval", eval_dir)
    assert finished.exit_code == 0, finished.output
    assert "stopped before writing its manifest" in finished.output and "finishing it" in finished.output
    after = verify_artifact(open_store(out), check_inputs=True)
    assert after.state is State.VERIFIED
    files = {e.path: e for e in after.manifest.files}
    assert {p: e for p, e in files.items() if p != CARD_NAME} == {p: e for p, e in before.items() if p != CARD_NAME}
    assert open_store(eval_dir).url in (out / CARD_NAME).read_text()
    status = cli("status", out)
    assert status.exit_code == 0 and status.stdout.startswith("verified\tdrafter-export"), status.output
    again = cli("export", "--config", config, run, out)  # the key kept: the export is done
    assert again.exit_code == 0 and "nothing written" in again.output, again.output


# ---- case 6: the license, and a card edited by hand ----


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


def test_the_license_is_a_setting_written_into_the_card_and_a_hand_edited_card_is_one_line(tmp_path, evaluated):
    run, _, config = evaluated
    out = tmp_path / "export"
    made = cli("export", "--config", config, run, out, "--license", "apache-2.0")
    assert made.exit_code == 0, made.output
    assert front_matter((out / CARD_NAME).read_text())["license"] == "apache-2.0"
    assert verify_artifact(open_store(out)).state is State.VERIFIED

    # What docs/RESULTS.md once told the user to do: edit the front matter by hand.
    card = (out / CARD_NAME).read_text()
    edited = card.replace('license: "apache-2.0"', "license: mit")
    (out / CARD_NAME).write_text(edited)
    assert cli("verify", out).exit_code == 1
    for args in (["--card-only", out], [run, out]):
        refused = cli("export", "--config", config, *args)
        line = one_line(refused.output)
        assert refused.exit_code == 2 and f"{out}/{CARD_NAME} is not the card this export wrote" in line, refused.output
        assert "export.license" in line and "--force" in line
        assert (out / CARD_NAME).read_text() == edited  # never dropped without a word

    rewritten = cli("export", "--config", config, "--card-only", out, "--license", "mit", "--force")
    assert rewritten.exit_code == 0, rewritten.output
    assert front_matter((out / CARD_NAME).read_text())["license"] == "mit"
    assert verify_artifact(open_store(out)).state is State.VERIFIED
    weights = {e.path: e for e in verify_artifact(open_store(out)).manifest.files if e.path != CARD_NAME}

    # Another license for an export already done rewrites its card only; --card-only without one keeps the card's.
    relicensed = cli("export", "--config", config, run, out, "--license", "apache-2.0")
    assert relicensed.exit_code == 0 and "rewriting its card with license apache-2.0" in relicensed.output
    assert cli("export", "--config", config, "--card-only", out).exit_code == 0
    assert front_matter((out / CARD_NAME).read_text())["license"] == "apache-2.0"
    after = verify_artifact(open_store(out))
    assert after.state is State.VERIFIED and {e.path: e for e in after.manifest.files if e.path != CARD_NAME} == weights
    assert "nothing written" in cli("export", "--config", config, run, out).output
    bad = cli("export", "--config", config, run, out, "--license", "Apache License 2.0")
    assert bad.exit_code == 2 and "--license" in one_line(bad.output)


# ---- case 9: an eval against another target ----


def eval_of_another_target(eval_dir: Path, dest: Path, target: str, created_at: str) -> Path:
    """A verified eval artifact of the same checkpoint whose report was measured against `target`: the eval's files, its
    report's target changed, committed as eval writes its artifacts."""
    shutil.copytree(eval_dir, dest)
    (dest / MANIFEST_NAME).unlink()
    report = json.loads((dest / "report.json").read_text())
    (dest / "report.json").write_text(json.dumps({**report, "target": target}, indent=2) + "\n")
    recorded = json.loads((eval_dir / MANIFEST_NAME).read_text())
    files = [entry_for_local_file(dest, dest / e["path"]) for e in recorded["files"]]
    commit_artifact(open_store(dest), "eval", files, config=recorded["config"],
                    lineage=[InputRef(**ref) for ref in recorded["lineage"]], counts=recorded["counts"])
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    (dest / MANIFEST_NAME).write_text(json.dumps({**manifest, "created_at": created_at}, indent=2,
                                                 sort_keys=True) + "\n")
    assert verify_artifact(open_store(dest)).state is State.VERIFIED
    return dest


def test_an_eval_against_another_target_is_refused_in_one_line_and_passed_over_by_the_card(tmp_path, evaluated):
    run, eval_dir, _ = evaluated
    config = write_config(tmp_path, tiny_config(tmp_path))  # its store: tmp_path/store
    other = eval_of_another_target(eval_dir, tmp_path / "store" / "eval" / "other", "Qwen/Qwen3-8B",
                                   "2099-01-01T00:00:00+00:00")

    refused = cli("export", "--config", config, run, tmp_path / "export", "--eval", other)
    line = one_line(refused.output)
    assert (
        refused.exit_code == 2 and "measured the drafter against target Qwen/Qwen3-8B, not this export's target" in line
    )
    assert str(TINY_TARGET_DIR) in line and "--target" in line
    assert not (tmp_path / "export").exists() or not (tmp_path / "export" / MANIFEST_NAME).exists()

    # Without --eval the newest eval of the checkpoint in the store is the other target's: passed over, and said.
    shutil.copytree(eval_dir, tmp_path / "store" / "eval" / "this")
    made = cli("export", "--config", config, run, tmp_path / "export")
    assert made.exit_code == 0, made.output
    (said,) = [x for x in made.output.splitlines() if x.startswith("card: ")]
    assert f"passed over newer evals against another target: {open_store(other).url}" in said
    assert open_store(tmp_path / "store" / "eval" / "this").url in (tmp_path / "export" / CARD_NAME).read_text()
    card_only = cli("export", "--config", config, "--card-only", tmp_path / "export", "--eval", other)
    assert card_only.exit_code == 2 and "not this export's target" in one_line(card_only.output)


# ---- case 13: a DFlash2 export's serving command and card ----


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_a_dflash2_exports_vllm_command_names_the_v2_runner_and_its_card_calls_it_dflash2(tmp_path, architecture):
    if architecture == "dflash2":
        folder, target = GOLDEN2 / "drafter", GOLDEN2 / "target"
        drafter = DFlashDrafter.from_pretrained(folder)
    else:
        target = TINY_TARGET_DIR
        cfg = load_config(None, tiny_config(tmp_path))
        drafter = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(target), cfg.dflash))
    out = StageOutput(open_store(tmp_path / "out"), EXPORT_KIND, stage_key({"test": architecture}))
    torch.manual_seed(0)
    result = export_drafter(drafter, AutoConfig.from_pretrained(target), out, target_path=str(target),
                            location=str(tmp_path / "out"))
    serving = json.loads((tmp_path / "out" / SERVING_NAME).read_text())
    card = (tmp_path / "out" / CARD_NAME).read_text()
    vllm = next(line for line in serving_lines(result.details.serving) if line.startswith("vLLM:"))
    if architecture == "dflash2":
        assert serving["vllm_env"] == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
        assert serving["vllm_command"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve ")
        assert vllm.startswith("vLLM:   VLLM_USE_V2_MODEL_RUNNER=1 vllm serve")
        assert (
            f"# DFlash2 drafter for {target}" in card and "A DFlash2 drafter" in card and "DFlash drafter" not in card
        )
        assert "V2 model runner" in card and serving["vllm_command"] in card
        assert "dflash2" in front_matter(card)["tags"]
    else:
        assert serving["vllm_env"] == {} and serving["vllm_command"].startswith("vllm serve ")
        assert f"# DFlash drafter for {target}" in card and "V2 model runner" not in card
    assert serving["vllm_speculative_config"]["method"] == "dflash"  # the architecture in config.json selects DFlash2


# ---- case 21: a folder at the lease file's name ----


def test_a_folder_standing_at_the_lease_files_name_is_one_line_and_nothing_is_written(tmp_path, evaluated,
                                                                                      leases_given_back):
    run, _, config = evaluated
    source = commit_files(tmp_path / "src", {"data.arrow": b"rows"}, kind="tokenized")
    for dest, args in ((tmp_path / "pushed", ["push", source]),
                       (tmp_path / "export", ["export", "--config", config, run])):
        (dest / LEASE_NAME).mkdir(parents=True)
        result = cli(*args, dest)
        # One error line (export says first which eval its card would have given), no traceback.
        (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"{dest}/{LEASE_NAME} is a folder" in line and "move that folder away" in line, line
        assert [p.relative_to(dest) for p in dest.rglob("*")] == [Path(LEASE_NAME)]
    with pytest.raises(LeaseError, match="is a folder"):
        Lease(open_store(tmp_path / "pushed")).acquire()


# ---- case 1: the rule's edges ----


def test_redaction_of_a_setting_keeps_what_is_no_credential():
    from blockdraft.errors import redact_settings  # the rule itself (the tests above go through the stages)

    argv = ["--max-num-batched-tokens", "8192", "--tokenizer-mode", "auto", "--hf-token", "EMPTY", "--api-key=KEY"]
    pinned = redact_settings(argv)
    assert (
        pinned[:4] == argv[:4] and pinned[5].startswith("[redacted:") and pinned[6].startswith("--api-key=[redacted:")
    )
    assert redact_settings(pinned) == pinned  # pinning a pinned config changes nothing
    assert (
        redact_settings("hf://datasets/HuggingFaceH4/MATH-500?split=test")
        == "hf://datasets/HuggingFaceH4/MATH-500?split=test"
    )
    assert redact_settings("https://alice:pw12345678@host/v1") != redact_settings("https://alice:pw87654321@host/v1")
