"""Eval's inputs and sampling settings, fourth ring (issue 47): the sets as the Hub and their authors ship them are read
(MBPP's `sanitized` config, MT-Bench's `mt_bench_prompts`, Alpaca's JSON array, HumanEval's gzipped JSONL, a folder of
Parquet files), and what cannot be decoded ends in one line before any model loads, with nothing written: a prompts file
that is not UTF-8, an empty prompt, a seed past what torch takes, a temperature below the floor, sampling flags given to
a greedy eval. One sampled decode reports no interval rather than a zero-width one.

Every set is written here, in the layout its source ships it in, with the rows of the fixtures in
tests/fixtures/prompt-sets, so the token ids it reads can be compared with those of the fixture's own layout.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.paths import FIXTURES
from helpers.tiny_run import make_tiny_run, tiny_config, write_config
from transformers import AutoTokenizer
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import EvalConfig, load_config
from blockdraft.errors import ConfigError, EvalError
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages.eval import EvalReport
from blockdraft.stages.eval.prompts import read_eval_prompts
from blockdraft.stages.eval.sampled import SEED_LIMIT, check_seeds, ratio_ci95, refuse_idle_sampling

pytestmark = pytest.mark.fault

SETS = FIXTURES / "prompt-sets"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return make_tiny_run(tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TARGET_DIR)


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SETS / name).read_text().splitlines()]


def _read(tmp_path: Path, tokenizer, *sources: str | Path, layouts: tuple[str, ...] = ()):
    cfg = load_config(None, tiny_config(tmp_path, eval={"num_prompts": 5}))
    work = tmp_path / f"work-{len(list(tmp_path.glob('work-*')))}"
    work.mkdir()
    return read_eval_prompts([str(s) for s in sources], cfg, tokenizer, work, layouts)


def _eval(tmp_path: Path, run: Path, *args: object):
    """`blockdraft eval` of the tiny run, its store and --output under `tmp_path`."""
    config = write_config(tmp_path, tiny_config(tmp_path, eval={"untrained_baseline": False}))
    return CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(run), "--max-new-tokens", "4",
                                    "--output", str(tmp_path / "eval"), *map(str, args)])


def _refused(result, tmp_path: Path) -> str:
    """The one error line of a refused eval (exit 2, no traceback, no model loaded), which wrote nothing."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, (result.exit_code, result.output)
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    assert not (tmp_path / "eval").exists() and not (tmp_path / "store" / "eval").exists()
    return lines[0]


# ---- case 8: MBPP in the Hub's `sanitized` layout (`prompt` + `test_list`) is MBPP, not plain text


def test_mbpp_in_the_hubs_sanitized_layout_is_read_as_mbpp_auto_and_named(tmp_path, tokenizer):
    full = pq.read_table(SETS / "mbpp.parquet").to_pylist()
    sanitized = tmp_path / "sanitized.parquet"  # the Hub's mbpp `sanitized` config: its text in `prompt`
    pq.write_table(pa.Table.from_pylist([
        {"source_file": "x.py", "task_id": r["task_id"], "prompt": r["text"], "code": r["code"], "test_imports": [],
         "test_list": r["test_list"]} for r in full]), sanitized)
    expected = _read(tmp_path, tokenizer, SETS / "mbpp.parquet").sets[0]
    for layouts in ((), ("mbpp",)):
        found = _read(tmp_path, tokenizer, sanitized, layouts=layouts).sets[0]
        assert (found.name, found.layout, found.ids) == ("mbpp", "mbpp", expected.ids)  # a chat turn, as MBPP's `text`
    with pytest.raises(EvalError, match=r"not the mbpp \(text\) of the mbpp layout \(nor mbpp \(prompt, sanitized\)\)"):
        _read(tmp_path, tokenizer, SETS / "gsm8k.parquet", layouts=("mbpp",))


# ---- case 24: MT-Bench in the Hub's `mt_bench_prompts` layout (`prompt` a list of turns)


def test_mt_bench_in_the_hubs_mt_bench_prompts_layout_is_read_by_its_first_turn(tmp_path, tokenizer):
    hub = tmp_path / "mt_bench_prompts.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": r["turns"], "prompt_id": r["question_id"], "category": r["category"], "reference": []}
        for r in _rows("mt_bench.jsonl")]), hub)
    expected = _read(tmp_path, tokenizer, SETS / "mt_bench.jsonl").sets[0]
    for layouts in ((), ("mt_bench",)):
        found = _read(tmp_path, tokenizer, hub, layouts=layouts).sets[0]
        assert (found.layout, found.ids) == ("mt_bench", expected.ids)
    # A `prompt` of text is still the plain layout's raw text, never taken for MT-Bench.
    assert _read(tmp_path, tokenizer, SETS / "plain.jsonl").sets[0].layout == "plain"


# ---- case 16: Alpaca's JSON array file and HumanEval's gzipped JSONL, as their authors ship them


def test_alpacas_json_array_and_humanevals_gzipped_jsonl_are_read_as_their_sets(tmp_path, tokenizer):
    alpaca = tmp_path / "alpaca_data.json"
    alpaca.write_text(json.dumps(_rows("alpaca.jsonl"), indent=4))
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(humaneval, "wt", encoding="utf-8") as f:
        f.write((SETS / "humaneval.jsonl").read_text())
    lines_as_json = tmp_path / "math500.json"  # JSON Lines under a .json name, as many sets are
    lines_as_json.write_text((SETS / "math500.jsonl").read_text())
    found = _read(tmp_path, tokenizer, alpaca, humaneval, lines_as_json).sets
    expected = _read(tmp_path, tokenizer, SETS / "alpaca.jsonl", SETS / "humaneval.jsonl", SETS / "math500.jsonl").sets
    assert [(s.layout, s.ids) for s in found] == [(s.layout, s.ids) for s in expected]
    assert [s.layout for s in found] == ["alpaca", "humaneval", "math500"]

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(humaneval.read_bytes()[:-20])
    with pytest.raises(EvalError, match=r"^cut.jsonl.gz does not read as a gzip file \(.*\); give it whole"):
        _read(tmp_path, tokenizer, cut)
    scalars = tmp_path / "scalars.json"
    scalars.write_text('[{"prompt": "a"}, 3]')
    with pytest.raises(EvalError, match=r"^scalars.json item 2 is not a JSON object"):
        _read(tmp_path, tokenizer, scalars)


# ---- case 17: a prompts file that is not UTF-8


def test_a_prompts_file_that_is_not_utf8_is_one_line_naming_the_line_and_the_byte(tmp_path, tiny_run, tokenizer):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "ok"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    line = _refused(_eval(tmp_path, tiny_run, "--prompts", latin1), tmp_path)
    assert line == "error: latin1.jsonl line 2 is not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8"
    zipped, array = tmp_path / "latin1.jsonl.gz", tmp_path / "latin1.json"
    zipped.write_bytes(gzip.compress(latin1.read_bytes()))
    array.write_bytes('[{"prompt": "caf\u00e9"}]'.encode("latin-1"))
    for path, where in ((zipped, "line 2"), (array, "line 1")):
        with pytest.raises(EvalError, match=rf"^{path.name} {where} is not UTF-8 text"):
            _read(tmp_path, tokenizer, path)


# ---- case 18: an empty prompt


def test_an_empty_prompt_is_refused_naming_its_row_before_any_model_loads(tmp_path, tiny_run):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n{"prompt": ""}\n')
    line = _refused(_eval(tmp_path, tiny_run, "--prompts", prompts), tmp_path)
    assert line == ("error: prompts.jsonl line 2: the prompt is empty (it renders to no tokens); give it text, or "
                    "remove that row")


# ---- case 19: a seed that torch's generators cannot take for every decode


def test_a_seed_past_what_torch_takes_for_every_decode_is_refused_up_front(tmp_path, tiny_run):
    with pytest.raises(ConfigError, match=rf"--seed {SEED_LIMIT}: must be < {SEED_LIMIT} \(it sets eval.seed\)"):
        load_config(None, {"eval": {"seed": SEED_LIMIT}})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n{"prompt": "Again"}\n')
    result = _eval(tmp_path, tiny_run, "--prompts", prompts, "--temperature", "0.7", "--seed", SEED_LIMIT - 1)
    assert _refused(result, tmp_path) == (
        f"error: eval.seed {SEED_LIMIT - 1} + 2 sampled decodes passes {SEED_LIMIT - 1}, the largest seed torch takes "
        f"(decode i is seeded with seed + i); give a seed of at most {SEED_LIMIT - 2}")
    # The largest seed that fits: its last decode is seeded with 2**64 - 1; greedy evals never seed.
    def sampled(seed: int) -> EvalConfig:
        return EvalConfig(temperature=0.7, seed=seed, samples_per_prompt=2)

    check_seeds(sampled(SEED_LIMIT - 4), 2)
    check_seeds(EvalConfig(seed=SEED_LIMIT - 1), 2)
    with pytest.raises(EvalError, match=f"give a seed of at most {SEED_LIMIT - 4}"):
        check_seeds(sampled(SEED_LIMIT - 3), 2)


# ---- case 20: a temperature so small that logits / T leave float32


def test_a_temperature_below_the_floor_is_refused_at_load_naming_the_floor(tmp_path, tiny_run):
    line = _refused(_eval(tmp_path, tiny_run, "--prompts", SETS / "plain.jsonl", "--temperature", "1e-45"), tmp_path)
    assert line.startswith("error: --temperature 1e-45: must be 0 (greedy) or at least 0.01")
    assert "(it sets eval.temperature)" in line
    assert load_config(None, sets=["eval.temperature=0.01"]).eval.temperature == 0.01
    assert load_config(None, sets=["eval.temperature=0"]).eval.temperature == 0


# ---- case 25: sampling flags given to a greedy eval


def test_sampling_flags_given_with_temperature_0_are_refused_in_one_line(tmp_path, tiny_run):
    line = _refused(_eval(tmp_path, tiny_run, "--prompts", SETS / "plain.jsonl", "--top-p", "0.9", "--top-k", "20",
                          "--samples-per-prompt", "4"), tmp_path)
    assert line == ("error: --top-p, --top-k, --samples-per-prompt set only the decodes at temperature, and "
                    "eval.temperature is 0 (greedy only), so they would change nothing; add --temperature T above 0 to "
                    "sample, or drop them")
    line = _refused(_eval(tmp_path, tiny_run, "--prompts", SETS / "plain.jsonl", "--set", "eval.seed=3"), tmp_path)
    assert line.startswith("error: --set eval.seed=3 set only the decodes at temperature") and "drop it" in line
    # A config file may keep sampling settings for the runs that raise the temperature; with 0 they are not refused.
    refuse_idle_sampling(load_config(None, {"eval": {"top_p": 0.9, "samples_per_prompt": 4}}).eval, [])


# ---- case 23: a folder of Parquet files, as a Hub snapshot holds a set's config


def test_a_folder_of_parquet_files_is_read_as_a_set_by_split(tmp_path, tokenizer):
    gsm8k = pq.read_table(SETS / "gsm8k.parquet").to_pylist()
    main, blobs = tmp_path / "gsm8k" / "main", tmp_path / "blobs"
    main.mkdir(parents=True)
    blobs.mkdir()
    # As the Hub's cache keeps a snapshot: its file a link to a blob outside the folder.
    pq.write_table(pa.Table.from_pylist(gsm8k[:1]), blobs / "0123abcd")
    (main / "test-00000-of-00001.parquet").symlink_to(blobs / "0123abcd")
    pq.write_table(pa.Table.from_pylist(gsm8k[1:]), main / "train-00000-of-00001.parquet")
    expected = _read(tmp_path, tokenizer, SETS / "gsm8k.parquet").sets[0].ids
    test, train = _read(tmp_path, tokenizer, main, f"{main}?split=train").sets
    assert (test.layout, test.ids, train.ids) == ("gsm8k", expected[:1], expected[1:])
    assert test.ref.kind == "dataset" and len(test.ref.sha256 or "") == 64
    with pytest.raises(EvalError, match=r"holds Parquet files only in its folders main; pass one of them as --prompts"):
        _read(tmp_path, tokenizer, tmp_path / "gsm8k")
    with pytest.raises(EvalError, match=r"has splits \['test', 'train'\] .*; name one as .*\?split=NAME"):
        _read(tmp_path, tokenizer, f"{main}?split=validation")


# ---- case 14: one sampled decode has no 95% interval


def test_one_sampled_decode_reports_no_interval_and_the_summary_says_so(tmp_path, tiny_run):
    assert ratio_ci95([3.0], [2.0]) is None  # one decode: no spread to estimate an error from
    low, high = ratio_ci95([3.0, 5.0], [2.0, 2.0]) or (0.0, 0.0)
    assert low < 2.0 < high
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n')
    result = _eval(tmp_path, tiny_run, "--prompts", prompts, "--temperature", "0.7")
    assert result.exit_code == 0, result.output
    sampled = EvalReport.from_json((tmp_path / "eval" / "report.json").read_text()).sampled
    assert sampled is not None and sampled.decodes == 1
    for name, d in sampled.drafters.items():
        assert d.tau_ci95 is None and d.position_acceptance_ci95 is None
        assert f"{name}\ttau {d.metrics.tau:.3f} (no interval: 1 decode) at T=0.7" in result.output
