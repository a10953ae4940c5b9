"""The export's model card: README.md with the Hub's front matter, whose every figure equals the artifact it names (the
eval report, the tokenized data's manifest, serving.json), listed and checksummed in the export's manifest; without
`--eval` it gives the latest verified eval of that very checkpoint in the store, else says none was found; figures at
temperature name their draft rule; `export --card-only` rewrites it after an eval, the export still verified and still
done."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from helpers.paths import FIXTURES
from helpers.tiny_run import make_tiny_run, tiny_config, write_config
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import export as export_stage
from blockdraft.stages.export.card import EvalSource, render_card
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.checksum import crc64nvme_file

SETS = FIXTURES / "prompt-sets"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(training output, its eval on two prompt sets, the config file) for the tiny target."""
    tmp = tmp_path_factory.mktemp("card")
    run = make_tiny_run(tmp)
    cfg = load_config(None, tiny_config(tmp, eval={"untrained_baseline": False, "num_prompts": 2}))
    prompts = [str(SETS / "gsm8k.parquet"), str(SETS / "mt_bench.jsonl")]
    eval_stage.run(cfg, str(run), str(tmp / "eval"), prompts=prompts, max_new_tokens=6)
    return run, tmp / "eval", write_config(tmp, tiny_config(tmp))


def export(*args: str) -> str:
    result = CliRunner().invoke(app, ["export", *args])
    assert result.exit_code == 0, result.output
    return result.output


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def table(card: str) -> dict[str, list[str]]:
    """The evaluation table's rows by prompt set: its cells after the set's name."""
    rows = [
        line.strip("| ").split(" | ")
        for line in card.splitlines()
        if line.startswith("| ") and not line.startswith("| prompt set")
    ]
    return {row[0]: row[1:] for row in rows}


def test_export_after_eval_writes_a_card_whose_every_figure_is_the_reports(tmp_path, evaluated):
    run, eval_dir, config = evaluated
    out = tmp_path / "export"
    printed = export("--config", str(config), str(run), str(out), "--eval", str(eval_dir))
    assert f"Card:   {open_store(out).url.rstrip('/')}/README.md" in printed
    report = json.loads((eval_dir / "report.json").read_text())
    card = (out / "README.md").read_text()

    meta = front_matter(card)
    assert meta == {"base_model": str(TINY_TARGET_DIR), "library_name": "blockdraft",
                    "tags": ["speculative-decoding", "dflash", "blockdraft"]}
    assert "# license: set the license" in card and "export.license" in card  # none set: a comment says how to set it

    eval_manifest = verify_artifact(open_store(eval_dir))
    assert f"`{open_store(eval_dir).url}` (manifest sha256 `{eval_manifest.manifest_sha256}`)" in card
    rows = table(card)
    assert list(rows) == ["gsm8k", "mt_bench", "all"]
    for name, figures in [*report["prompt_sets"].items(), ("all", None)]:
        layout, prompts, tau, speedup, lossless, tau_ngram = rows[name]
        source = figures or {"layout": "", "num_prompts": report["num_prompts"], "drafters": report["drafters"],
                             "lossless": report["lossless"]["ok"]}
        dflash = source["drafters"]["dflash"]
        assert layout == source["layout"] and int(prompts) == source["num_prompts"]
        assert float(tau) == round(dflash["tau"], 3) and float(speedup.rstrip("x")) == round(dflash["speedup"], 2)
        assert lossless == ("yes" if source["lossless"] else "NO")
        assert float(tau_ngram) == round(source["drafters"]["ngram"]["tau"], 3)
        accepted = re.search(rf"^- {name}: (.*)$", card, re.MULTILINE)
        assert accepted is not None
        assert [float(a) for a in accepted.group(1).split(", ")] == [round(a, 3) for a in dflash["position_acceptance"]]
    assert f"up to {report['max_new_tokens']} new tokens per prompt; target in {report['target_dtype']}" in card
    assert "Served by" not in card  # no engine check ran: none is shown

    data = verify_artifact(open_store(run.parent / "tokenized"))
    counts = data.manifest.counts
    assert (
        f"manifest sha256 `{data.manifest_sha256}`): conversations {counts['rows_in']:,}, rows {counts['rows_out']:,}"
        in card
    )
    assert f"tokens {counts['tokens']:,}, supervised tokens {counts['supervised_tokens']:,}" in card
    run_config = data.manifest.config["tokenize_run"]
    assert f"thinking mode {run_config['thinking']}; chat template sha256 `{run_config['template_sha256']}`" in card
    serving = json.loads((out / "serving.json").read_text())
    assert serving["sglang_command"] in card and serving["vllm_command"] in card
    assert f"- parameters: {verify_artifact(open_store(out)).manifest.counts['parameters']:,}" in card

    verified = verify_artifact(open_store(out), check_inputs=True)
    assert verified.state is State.VERIFIED
    (entry,) = [e for e in verified.manifest.files if e.path == "README.md"]
    assert (entry.size, entry.checksum) == crc64nvme_file(out / "README.md")


def test_without_an_eval_the_card_says_none_ran_and_card_only_rewrites_it_after_one(tmp_path, evaluated):
    run, eval_dir, config = evaluated
    out = tmp_path / "export"
    printed = export("--config", str(config), str(run), str(out))
    card = (out / "README.md").read_text()
    assert "No eval of this checkpoint was given or found for this export" in card and "| prompt set" not in card
    assert "card: no verified eval of" in printed  # the store holds none: the fixture's eval lies outside it
    before = {e.path: e for e in verify_artifact(open_store(out)).manifest.files}

    export("--config", str(config), "--card-only", str(out), "--eval", str(eval_dir))
    card = (out / "README.md").read_text()
    assert "No eval of this checkpoint" not in card and list(table(card)) == ["gsm8k", "mt_bench", "all"]
    after = verify_artifact(open_store(out), check_inputs=True)
    assert after.state is State.VERIFIED
    files = {e.path: e for e in after.manifest.files}
    assert (
        files["README.md"] != before["README.md"]
        and files["README.md"].checksum == crc64nvme_file(out / "README.md")[1]
    )
    assert {p: e for p, e in files.items() if p != "README.md"} == {p: e for p, e in before.items() if p != "README.md"}

    # The same export command again finds its export done (the card's rewrite kept what it was made for).
    manifest = (out / MANIFEST_NAME).read_bytes()
    again = export_stage.run(load_config(config), str(run), str(out))
    assert again.already_done and (out / MANIFEST_NAME).read_bytes() == manifest


def test_an_eval_of_another_checkpoint_is_refused_in_one_line(tmp_path, evaluated):
    _, eval_dir, config = evaluated
    other = make_tiny_run(tmp_path, seed=1)
    result = CliRunner().invoke(app, ["export", "--config", str(config), str(other), str(tmp_path / "export"), "--eval",
                                      str(eval_dir)])
    assert result.exit_code != 0
    (line,) = result.output.strip().splitlines()
    assert (
        "is of checkpoint" in line
        and "not of the exported checkpoint" in line
        and "pass an eval of this checkpoint" in line
    )
    assert not (tmp_path / "export" / MANIFEST_NAME).exists()


def test_the_card_gives_the_sampling_settings_and_sampled_figures_of_an_eval_at_temperature(tmp_path, evaluated):
    run, _, config = evaluated
    cfg = load_config(None, tiny_config(tmp_path, eval={"untrained_baseline": False, "num_prompts": 1,
                                                        "temperature": 0.8, "top_k": 20, "seed": 3,
                                                        "samples_per_prompt": 2}))
    eval_stage.run(cfg, str(run), str(tmp_path / "eval"), prompts=[str(SETS / "gsm8k.parquet")], max_new_tokens=4)
    sampled = json.loads((tmp_path / "eval" / "report.json").read_text())["sampled"]
    export("--config", str(config), str(run), str(tmp_path / "export"), "--eval", str(tmp_path / "eval"))
    card = (tmp_path / "export" / "README.md").read_text()
    assert (f"Sampled decoding: temperature 0.8, top-p {sampled['top_p']:g}, top-k 20, seed 3, 2 decode(s) per prompt, "
            f"{sampled['decodes']} in all") in card
    for name, d in sampled["drafters"].items():
        row = re.search(rf"^\| {name} \| (\S+) \| (\S+) to (\S+) \| (\S+)x \|$", card, re.MULTILINE)
        assert row is not None, name
        tau, low, high, speedup = (float(x) for x in row.groups())
        assert (tau, low, high, speedup) == (round(d["metrics"]["tau"], 3), round(d["tau_ci95"][0], 3),
                                             round(d["tau_ci95"][1], 3), round(d["metrics"]["speedup"], 2))
    # The figures at temperature name the draft rule they were measured under (the report's `proposal`); greedy's need
    # none (the same under every rule).
    named = "drafts proposed by the `{}` rule (`eval.proposal`)"
    assert f"over every prompt; {named.format(sampled['proposal'])}" in card

    # Each rule by name, the engine check at temperature too.
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    engine = {"engine": "vllm", "version": "0", "dtype": "float32", "tau": 2.0, "speedup": 1.5, "num_prompts": 1,
              "outputs_equal_target_only": 1, "rule": "binomial 95%", "temperature": 0.8, "disagreement": None}
    for proposal in ("vllm", "vllm-probabilistic", "sglang"):
        report["sampled"]["proposal"] = proposal
        served = render_card("t", "e", {}, {}, {}, {},
                             EvalSource("file:///eval", "ab", {**report, "engine": engine}), [])
        assert f"over every prompt; {named.format(proposal)} and verified" in served
        assert f"at temperature 0.8, {named.format(proposal)}: tau 2.000" in served

    # One decode has no interval, and the card says so rather than print one.
    one = {**report["sampled"],
           "drafters": {n: {**d, "tau_ci95": None} for n, d in report["sampled"]["drafters"].items()}}
    single = render_card("t", "e", {}, {}, {}, {}, EvalSource("file:///eval", "ab", {**report, "sampled": one}), [])
    assert "| none (1 decode) |" in single


def copy_eval(eval_dir: Path, dest: Path, created_at: str, checkpoint_sha256: str | None = None) -> Path:
    """Another verified eval artifact at `dest`: a copy of `eval_dir` whose manifest says it was made at `created_at`
    and, with `checkpoint_sha256`, pins that checkpoint content instead (at the same checkpoint URL)."""
    shutil.copytree(eval_dir, dest)
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    manifest["created_at"] = created_at
    if checkpoint_sha256 is not None:
        manifest["lineage"][0]["sha256"] = checkpoint_sha256
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    assert verify_artifact(open_store(dest)).state is State.VERIFIED
    return dest


def card_eval(card: str) -> str | None:
    """The URL of the eval artifact the card's figures are read from (None: the card gives no eval)."""
    found = re.search(r"of the eval artifact `([^`]+)` \(manifest sha256 `([0-9a-f]+)`\)", card)
    return found.group(1) if found else None


def test_without_eval_export_gives_the_latest_verified_eval_of_this_very_checkpoint_in_the_store(tmp_path, evaluated):
    run, eval_dir, _ = evaluated
    config = write_config(tmp_path, tiny_config(tmp_path))  # its store: tmp_path/store
    evals = tmp_path / "store" / "eval"
    # Newer than any eval of the checkpoint, and never given: an eval pinning other content at the same checkpoint URL
    # (a checkpoint trained again there), and one whose report changed since (it does not verify).
    copy_eval(eval_dir, evals / "other", "2026-03-04T00:00:00+00:00", checkpoint_sha256="0" * 64)
    rotten = copy_eval(eval_dir, evals / "rotten", "2026-03-05T00:00:00+00:00")
    (rotten / "report.json").write_text((rotten / "report.json").read_text() + " ")
    first, fresh = tmp_path / "first", tmp_path / "fresh"
    printed = export("--config", str(config), str(run), str(first))
    assert card_eval((first / "README.md").read_text()) is None
    (line,) = [x for x in printed.splitlines() if x.startswith("card: ")]
    assert "no verified eval of" in line and f"{open_store(rotten).url} (ArtifactError)" in line
    assert "/other" not in line  # never a candidate: its lineage pins other content

    older = copy_eval(eval_dir, evals / "older", "2026-03-01T00:00:00+00:00")
    newer = copy_eval(eval_dir, evals / "newer", "2026-03-02T00:00:00+00:00")
    printed = export("--config", str(config), str(run), str(fresh))
    card = (fresh / "README.md").read_text()
    assert card_eval(card) == open_store(newer).url and list(table(card)) == ["gsm8k", "mt_bench", "all"]
    assert f"(manifest sha256 `{verify_artifact(open_store(newer)).manifest_sha256}`)" in card
    report = json.loads((newer / "report.json").read_text())
    assert float(table(card)["all"][2]) == round(report["drafters"]["dflash"]["tau"], 3)  # that eval's figures
    (line,) = [x for x in printed.splitlines() if x.startswith("card: ")]
    assert line.startswith(f"card: figures from eval {open_store(newer).url}, the latest verified eval of ")
    assert f"passed over newer evals that do not verify: {open_store(rotten).url}" in line

    # An export already done whose card gives another eval (here none) has its card rewritten from the latest one ...
    export("--config", str(config), str(run), str(first))
    assert card_eval((first / "README.md").read_text()) == open_store(newer).url
    assert verify_artifact(open_store(first), check_inputs=True).state is State.VERIFIED
    # ... and one whose card gives it already is left as it is.
    manifest = (fresh / MANIFEST_NAME).read_bytes()
    assert "nothing written" in export("--config", str(config), str(run), str(fresh))
    assert (fresh / MANIFEST_NAME).read_bytes() == manifest

    # --eval names another: that one wins; --card-only without it takes the latest again.
    export("--config", str(config), str(run), str(fresh), "--eval", str(older))
    assert card_eval((fresh / "README.md").read_text()) == open_store(older).url
    export("--config", str(config), "--card-only", str(fresh))
    assert card_eval((fresh / "README.md").read_text()) == open_store(newer).url
