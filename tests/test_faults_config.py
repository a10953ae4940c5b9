"""Config and connection faults end in one line that names the cause and the fix: a device this machine lacks, a
number that makes no sense, a bad flag value (named as the flag, not as the file), a store URL of an unknown scheme,
and an S3 endpoint that refuses connections (the line names the object's full s3:// URL)."""

from __future__ import annotations

import os
import socket

import botocore.exceptions as bex
import pytest
import torch
from helpers.artifacts import commit_files
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, StoreConfig, check_device, is_s3_url, load_config
from blockdraft.errors import ConfigError, StoreError
from blockdraft.store import open_store
from blockdraft.store.s3_client import describe_error

CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def load(tmp_path, text: str) -> BlockdraftConfig:
    (tmp_path / "c.toml").write_text(text)
    return load_config(tmp_path / "c.toml")


# ---- devices ----


@pytest.mark.parametrize("device", ["gpu0", "tpu:9", "cuda:", "cuda:-1", "CUDA", "cuda0", ""])
@pytest.mark.parametrize("field", ["target_devices", "drafter_devices"])
def test_a_malformed_device_string_fails_at_load_naming_the_field_and_the_forms(tmp_path, device, field):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, f'[placement]\n{field} = ["cpu", "{device}"]\n')
    message = one_line(err)
    assert f"'placement.{field}'" in message and f"'{device}' is not a device" in message
    assert "cpu, cuda, cuda:N or mps" in message


def test_well_formed_devices_load_whatever_this_machine_has(tmp_path):
    """A config is often written on another machine than it runs on: cuda:7 loads; the stage that places models
    checks."""
    cfg = load(tmp_path, '[placement]\ntarget_devices = ["cuda:7"]\n'
                         'drafter_devices = ["cpu", "cuda", "mps", "cuda:1"]\n')
    assert cfg.placement.target_devices == ["cuda:7"]
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "[placement]\ndrafter_devices = []\n")
    assert "'placement.drafter_devices'" in one_line(err)


def test_a_cuda_device_this_machine_lacks_is_one_line_saying_what_torch_sees():
    """cuda:N past the last GPU (cuda:0 on a CPU-only torch) names the field, the value, what torch sees and the fix."""
    missing = f"cuda:{CUDA_COUNT}"
    with pytest.raises(ConfigError) as err:
        check_device("placement.target_devices", missing)
    message = one_line(err)
    assert message.startswith(f"placement.target_devices lists '{missing}' but torch sees ")
    seen = "no CUDA device" if CUDA_COUNT == 0 else f"{CUDA_COUNT} CUDA device(s)"
    assert seen in message and "list devices this machine has" in message
    assert check_device("placement.target_devices", "cpu") == "cpu"


@pytest.mark.parametrize("field", ["drafter_devices", "target_devices"])
def test_training_placement_refuses_a_missing_device_before_torch_sees_it(tmp_path, monkeypatch, field):
    from blockdraft.stages.train.ranks import resolve_placement

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = load(tmp_path, f'[placement]\n{field} = ["cuda:{CUDA_COUNT}"]\n')
    with pytest.raises(ConfigError) as err:
        resolve_placement(cfg.placement)
    assert one_line(err).startswith(f"placement.{field} lists 'cuda:{CUDA_COUNT}'")
    assert resolve_placement(load(tmp_path, "").placement).drafter_device == torch.device("cpu")


def test_eval_refuses_a_missing_device_in_one_line(tmp_path):
    """Through the command line: exit 2, one line naming the field, before any checkpoint is fetched."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 8}')
    config = tmp_path / "c.toml"
    config.write_text(f'[target]\npath = "{target}"\n[placement]\ndrafter_devices = ["cuda:{CUDA_COUNT}"]\n')
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(tmp_path / "nowhere"), "--config", str(config)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"placement.drafter_devices lists 'cuda:{CUDA_COUNT}'" in lines[0] and "Traceback" not in result.output


# ---- numbers ----


@pytest.mark.parametrize(
    "text, field",
    [
        ("[train]\nmax_steps = -5\n", "train.max_steps"),
        ("[train]\nmax_steps = 0\n", "train.max_steps"),
        ("[train]\nlr = -0.001\n", "train.lr"),
        ("[train]\nweight_decay = -1\n", "train.weight_decay"),
        ("[train]\ngrad_clip = 0\n", "train.grad_clip"),
        ("[train]\ncheckpoint_every = 0\n", "train.checkpoint_every"),
        ("[dflash]\nmask_token_id = -1\n", "dflash.mask_token_id"),
        ("[dflash]\ngamma = 0\n", "dflash.gamma"),
        ("[dflash]\nhead_dim = 0\n", "dflash.head_dim"),
        ("[dflash]\ntarget_layer_ids = [-2, 1]\n", "dflash.target_layer_ids.0"),
        ("[eval]\ndivergence_margin_fp32 = -1\n", "eval.divergence_margin_fp32"),
        ("[store]\npart_size_mib = 6000\n", "store.part_size_mib"),
    ],
)
def test_a_nonsense_number_fails_at_load_naming_its_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    message = one_line(err)
    assert f"field '{field}'" in message and "fix that field in the file" in message


# ---- flags ----


def test_a_bad_flag_value_names_the_flag_not_the_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"tokenize": {"max_length": -3}})
    message = one_line(err)
    assert message.startswith("--max-length -3: must be >= 2") and "in the file" not in message
    # A file's own mistake still names the file and its field, even with flags given.
    (tmp_path / "c.toml").write_text("[train]\nmax_steps = -5\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.toml", {"tokenize": {"max_length": 64}})
    assert f"config {tmp_path / 'c.toml'}: field 'train.max_steps'" in one_line(err)


def test_a_bad_flag_value_through_the_cli_is_one_line_naming_the_flag(tmp_path):
    result = CliRunner().invoke(app, ["tokenize", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--max-length",
                                      "-3"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "--max-length -3: must be >= 2" in lines[0] and "in the file" not in lines[0]
    result = CliRunner().invoke(app, ["tokenize", str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                                      "--held-out-fraction", "1.5"])
    assert result.exit_code == 2 and "--held-out-fraction 1.5: must be < 1" in result.output, result.output


# ---- store URLs ----

BAD_URLS = ["gs://bucket/x", "http://example.com/x", "s3:/typo", "S3://bucket/x", "s3://", "s3:///prefix", "file://"]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_store_url_of_an_unknown_form_fails_at_load_and_at_open(tmp_path, url):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, f'[store]\nurl = "{url}"\n')
    message = one_line(err)
    assert "'store.url'" in message and "use s3://bucket/prefix, file://path or a plain path" in message
    with pytest.raises(StoreError) as err:
        open_store(url)
    assert url in one_line(err) and "use s3://bucket/prefix, file://path or a plain path" in str(err.value)


def test_good_store_urls_load_and_open(tmp_path):
    for url in ("s3://bucket", "s3://bucket/a/b", f"file://{tmp_path}", str(tmp_path), "relative/folder", "./x"):
        assert load(tmp_path, f'[store]\nurl = "{url}"\n').store.url == url
    assert open_store(f"file://{tmp_path}").local_path() == tmp_path


def test_is_s3_url_is_the_one_rule_for_an_s3_location():
    """`is_s3_url` is what every caller asks (the backend `open_store` picks, preflight's probe, a bare push name under
    store.url, a single prompts object): the lower-case scheme with two slashes, nothing else."""
    assert is_s3_url("s3://bucket") and is_s3_url("s3://bucket/a/b")
    for url in ("S3://bucket/x", "s3:/typo", "file://s3://x", "/data/s3://x", "relative/s3", "gs://bucket/x"):
        assert not is_s3_url(url)


# ---- S3 connection errors name the object ----


@pytest.fixture
def closed_endpoint(monkeypatch, tmp_path) -> str:
    """An endpoint on a loopback port that nothing listens on (connections are refused at once), with dummy keys."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:  # no AWS setting of this machine may leak in
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAULTSCONFIG")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "faults-config-secret-key-0123456789")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_refused_connection_names_the_full_url_of_every_object(closed_endpoint):
    store = open_store("s3://bucket/some/key/prefix", StoreConfig(endpoint_url=closed_endpoint))
    with pytest.raises(StoreError) as err:
        store.read_bytes("x.json")
    message = one_line(err)
    assert "s3://bucket/some/key/prefix/x.json" in message and f"S3 endpoint {closed_endpoint} unreachable" in message
    # Later requests of the same connection fail at once, each naming its own object, not the first one's.
    with pytest.raises(StoreError) as err:
        store.head("y/model.safetensors")
    assert "s3://bucket/some/key/prefix/y/model.safetensors" in one_line(err) and "x.json" not in str(err.value)
    with pytest.raises(StoreError) as err:
        list(store.list())
    assert "while listing s3://bucket/some/key/prefix/" in one_line(err)
    assert "faults-config-secret-key" not in str(err.value)


def test_pull_from_a_refused_endpoint_names_the_source(closed_endpoint, tmp_path):
    result = CliRunner().invoke(app, ["pull", "s3://bucket/runs/tok", str(tmp_path / "here"), "--endpoint-url",
                                      closed_endpoint])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "s3://bucket/runs/tok/" in lines[0] and closed_endpoint in lines[0]


def test_push_to_a_refused_endpoint_names_the_destination(closed_endpoint, tmp_path):
    local = commit_files(tmp_path / "art", {"a.bin": b"abc"})
    result = CliRunner().invoke(app, ["push", str(local), "s3://bucket/runs/art", "--endpoint-url", closed_endpoint])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "s3://bucket/runs/art/" in lines[0] and closed_endpoint in lines[0]


@pytest.mark.parametrize(
    "exc",
    [
        bex.ReadTimeoutError(endpoint_url="http://127.0.0.1:1/b/k"),
        bex.EndpointConnectionError(endpoint_url="http://127.0.0.1:1/b/k"),
        bex.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1/b/k"),
        bex.ConnectionClosedError(endpoint_url="http://127.0.0.1:1/b/k"),
    ],
)
def test_every_transfer_connection_line_names_the_object(exc):
    """The transfer client's lines (a connection lost after the probe answered) name the object as the probe's do."""
    line = str(describe_error(exc, "s3://b/p/shard-00003.arrow", "http://127.0.0.1:1", "downloading"))
    assert "while downloading s3://b/p/shard-00003.arrow" in line
