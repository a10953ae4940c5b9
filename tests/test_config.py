"""The one config: docs/CONFIG.md's example and the README quickstart's config validate, flags override the file,
mistakes are one line naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from blockdraft.config import load_config
from blockdraft.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_the_config_pages_example_validates(tmp_path):
    block = re.search(r"```toml\n(.*?)```", (ROOT / "docs" / "CONFIG.md").read_text(), re.S).group(1)
    (tmp_path / "c.toml").write_text(block)
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.dflash.mask_token_id == 151669 and cfg.placement.drafter_devices == ["cuda:2", "cuda:3"]
    assert cfg.resolved()["train"]["epochs"] == 6  # resolved config carries every field, defaults included


def test_the_readme_quickstarts_config_validates(tmp_path):
    """The config the README's quickstart writes (its heredoc) loads, with the paths its commands use."""
    block = re.search(r"cat > try/blockdraft.toml <<'EOF'\n(.*?)\nEOF\n", (ROOT / "README.md").read_text(),
                      re.S).group(1)
    (tmp_path / "c.toml").write_text(block)
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.store.url == "s3://drafters/tiny" and cfg.train.data == "try/train-node/tokenized"
    assert cfg.dflash.mask_token_id == 448 and cfg.generate.thinking == "on"


def test_the_readmes_dflash2_table_validates(tmp_path):
    """The README's [dflash] table for the published Qwen3.8-27B DFlash2 shape loads as a DFlash2 drafter of that
    shape."""
    block = re.search(r"## A DFlash2 drafter.*?```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (tmp_path / "c.toml").write_text(block)
    d = load_config(tmp_path / "c.toml").dflash
    assert ((d.architecture, d.block_size, d.mask_token_id, d.num_draft_layers, d.sliding_window)
            == ("dflash2", 8, 248070, 5, 2048))
    assert d.layer_types == ["sliding_attention"] * 5
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) == (2, 16, 256, 16)


def test_flags_override_the_file_and_none_flags_do_not(tmp_path):
    (tmp_path / "c.toml").write_text("[tokenize]\nmax_length = 100\nthinking = 'on'\n")
    cfg = load_config(tmp_path / "c.toml", {"tokenize": {"max_length": 50, "thinking": None}})
    assert cfg.tokenize.max_length == 50 and cfg.tokenize.thinking == "on"


@pytest.mark.parametrize(
    "text, field",
    [
        ("[tokenize]\nthinking = 'maybe'\n", "tokenize.thinking"),
        ("[dflash]\nblock_size = 1\n", "dflash.block_size"),
        ("[trian]\nlr = 1\n", "trian"),
    ],
)
def test_a_bad_field_is_one_line_naming_it(tmp_path, text, field):
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.toml")
    assert f"'{field}'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("ids", "why"), [("[5, 1, 3]", "5 before 1"), ("[3, 3]", "3 repeated")])
def test_target_layer_ids_must_be_strictly_ascending_and_unique(tmp_path, ids, why):
    """The engines read the target's layers in order, once each: other ids fail at load, one line naming the field."""
    (tmp_path / "c.toml").write_text(f"[dflash]\ntarget_layer_ids = {ids}\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.toml")
    message = str(err.value)
    assert "'dflash.target_layer_ids'" in message and f"strictly ascending and unique ({why})" in message
    assert "\n" not in message
    (tmp_path / "ok.toml").write_text("[dflash]\ntarget_layer_ids = [1, 3, 5]\n")
    assert load_config(tmp_path / "ok.toml").dflash.target_layer_ids == [1, 3, 5]


def test_target_dtype_defaults_to_the_target_configs_own(tmp_path):
    assert load_config().target.dtype is None  # resolved against the target's config.json where it is used
    (tmp_path / "c.toml").write_text("[target]\ndtype = 'bfloat16'\n")
    assert load_config(tmp_path / "c.toml").target.dtype == "bfloat16"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


@pytest.mark.parametrize(("text", "item"),
                         [("[tokenize]\nmax_lenght = 5\n", "tokenize.max_lenght=5"),
                          ("[trian]\nlr = 1\n", "trian.lr=1"),
                          ("[train]\ntarget_engine = 'vllm'\n[target.engine]\nurll = 'http://h:1'\n",
                           "target.engine.urll=http://h:1")])
def test_a_mistyped_name_in_the_file_gets_the_same_suggestion_as_set(tmp_path, text, item):
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError) as in_file:
        load_config(tmp_path / "c.toml")
    with pytest.raises(ConfigError) as in_set:
        load_config(None, sets=[item])
    said = str(in_set.value).removeprefix(f"--set {item}: ")
    assert "did you mean" in said and (f"config {tmp_path / 'c.toml'}: {said}; fix that name in the file"
                                       == str(in_file.value))


def test_the_engine_table_inside_target_is_set_by_file_and_by_dotted_set_items(tmp_path):
    (tmp_path / "c.toml").write_text("[train]\ntarget_engine = 'vllm'\n[target.engine]\ntensor_parallel_size = 4\n")
    cfg = load_config(tmp_path / "c.toml", sets=["target.engine.enable_expert_parallel=true",
                                                 "target.engine.args=--max-num-seqs,8"])
    assert cfg.target.engine.launch_args() == ["--tensor-parallel-size", "4", "--enable-expert-parallel",
                                               "--max-num-seqs", "8"]
    url = load_config(tmp_path / "c.toml", sets=["target.engine.url=http://10.0.0.5:8000"]).target.engine.url
    assert url == "http://10.0.0.5:8000"


@pytest.mark.parametrize(("sets", "said"), [
    (["target.engine.tensor_parallel_size=2"],
     "target.engine.tensor_parallel_size is set, and train.target_engine = 'hf' runs the target in the trainer, "
     "without an engine; set train.target_engine = 'vllm' or drop [target.engine]"),
    (["train.target_engine=vllm", "target.engine.url=10.0.0.5:8000"],
     "target.engine.url must be the http(s) URL of a vLLM server, e.g. http://10.0.0.5:8000 (got '10.0.0.5:8000')"),
    (["train.target_engine=vllm", "target.engine.tensor_parallel_size=0"],
     "--set target.engine.tensor_parallel_size=0: must be >= 1 (it sets target.engine.tensor_parallel_size); pass a "
     "valid value"),
    (["train.target_engine=vllm", "target.engine.url=http://10.0.0.5:8000/v1"],
     "--set target.engine.url=http://10.0.0.5:8000/v1: target.engine.url must be the server's root, "
     "http(s)://host:port, with no path (/v1 is added per request), query or user:password (got another form) (it "
     "sets target.engine.url); pass a valid value"),
    (["target.engine=5"], "--set target.engine=5: target.engine is a table; set one of its keys: url, "),
    (['dflash.target_layer_ids=[1,"x"]'], '--set dflash.target_layer_ids=[1,"x"]: Input should be a valid integer'),
    (["train.lr.x=5"], "--set train.lr.x=5: train.lr is a setting, not a table; write it as --set train.lr=value"),
])
def test_a_bad_engine_setting_is_one_line_naming_it(sets, said):
    with pytest.raises(ConfigError) as refused:
        load_config(None, sets=sets)
    assert said in str(refused.value) and "\n" not in str(refused.value) and "top level" not in str(refused.value)
    if sets[-1].startswith(("target.engine.url", "dflash")):  # an override's error names it, not a file
        assert str(refused.value).startswith(f"--set {sets[-1]}: ")
