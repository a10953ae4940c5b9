"""The one config: the README's example validates, flags override the file, mistakes are one line naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from blockdraft.config import load_config
from blockdraft.errors import ConfigError

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_config_validates(tmp_path):
    block = re.search(r"```toml\n(.*?)```", README.read_text(), re.S).group(1)
    (tmp_path / "c.toml").write_text(block)
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.dflash.mask_token_id == 151669 and cfg.placement.drafter_devices == ["cuda:2", "cuda:3"]
    assert cfg.resolved()["train"]["epochs"] == 6  # resolved config carries every field, defaults included


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


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")
