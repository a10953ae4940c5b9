"""The command line as a user meets it: commands listed in pipeline order, user errors as one line and exit status 2."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from blockdraft.cli import PIPELINE_ORDER, app


def test_help_lists_the_commands_in_the_order_a_job_runs_them():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    listed = [name for name in re.findall(r"^│ ([\w-]+)\s", result.output, re.M) if name in PIPELINE_ORDER]
    assert listed == list(PIPELINE_ORDER)


def test_a_user_error_is_one_line_and_exit_status_2_without_a_traceback(tmp_path):
    missing = tmp_path / "nowhere.toml"
    result = CliRunner().invoke(app, ["train", "--config", str(missing)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "nowhere.toml does not exist" in lines[0]
    assert "Traceback" not in result.output


def test_a_stage_package_does_not_hide_its_launch_module_behind_a_function():
    """`blockdraft.stages.train.launch` is the module (what mock targets and readers find), not a re-exported
    function."""
    import types

    import blockdraft.stages.train
    import blockdraft.stages.train.launch  # noqa: F401

    assert isinstance(blockdraft.stages.train.launch, types.ModuleType)
