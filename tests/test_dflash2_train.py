"""Training a DFlash2 drafter (docs/DFLASH.md, "DFlash2 training"): `blockdraft train` with dflash.architecture =
"dflash2" learns and logs the selector's figures beside the unary ones (metrics.jsonl and the trackers' names); a DFlash
drafter warm-starts it exactly (the first forward is the DFlash drafter's, to 1e-6, and the selector keeps its own
initialisation); mismatched starts are refused in one line; the memory plan counts the codebooks, convolutions and
top-K tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.paths import GOLDEN_TARGET
from helpers.train_data import config_file, make_rows, write_tokenized
from transformers import AutoConfig

from blockdraft.config import DFlashConfig, load_config
from blockdraft.errors import ConfigError
from blockdraft.model import DFlashDrafter, DrafterSpec
from blockdraft.model.formats import checkpoint_key
from blockdraft.stages.train import run
from blockdraft.stages.train.metrics import tracked_scalars

DFLASH2 = 'architecture = "dflash2"\nselector_rank = 32\nselector_top_k = 8\n'


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(6, prompt_len=6, new_tokens=40, seed=0)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:4], rows[4:])


def dflash2_config(tmp: Path, data: str, dflash: str = DFLASH2, **train) -> Path:
    path = config_file(tmp, data, **train)
    # the helper's DFlash, replaced by `dflash`'s lines
    text = path.read_text().replace('architecture = "dflash"\n', "")
    path.write_text(text.replace("intermediate_size = 96\n", f"intermediate_size = 96\n{dflash}"))
    return path


def forward(drafter: DFlashDrafter, seed: int = 7) -> torch.Tensor:
    """One training-shaped forward: 3 blocks of B = 4 after 12 context positions."""
    g = torch.Generator().manual_seed(seed)
    spec = drafter.spec
    features = torch.randn(1, 12, spec.num_target_features * spec.hidden_size, generator=g)
    block = torch.randn(1, 12, spec.hidden_size, generator=g)
    positions = torch.tensor([[2, 3, 4, 5, 5, 6, 7, 8, 8, 9, 10, 11]])
    with torch.no_grad():
        return drafter(block, drafter.project_context(features), positions, torch.arange(12)[None])


def test_a_dflash2_run_learns_and_logs_the_selector_figures(tmp_path, data_url):
    cfg = load_config(dflash2_config(tmp_path, data_url, max_steps=30, checkpoint_every=30, batch_size=4, lr=5e-3))
    result = run(cfg).details
    entries = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(entries) == 30
    first, last = entries[0], entries[-1]
    for entry in (first, last):
        assert (
            len(entry["slot_loss"]) == len(entry["slot_selector_accuracy"]) == len(entry["slot_candidate_recall"]) == 3
        )
        assert 0.0 <= entry["selector_accuracy"] <= entry["candidate_recall"] <= 1.0
        assert entry["walk_tau_estimate"] >= 1.0 and entry["selector_loss"] > 0
    assert last["loss"] < 0.5 * first["loss"] and last["selector_loss"] < first["selector_loss"]
    assert last["candidate_recall"] > first["candidate_recall"]
    assert last["walk_tau_estimate"] > first["walk_tau_estimate"] + 0.5, (first["walk_tau_estimate"],
                                                                          last["walk_tau_estimate"])
    scalars = tracked_scalars(last)  # what TensorBoard and W&B get
    assert {"train/selector_loss", "train/candidate_recall", "train/selector_accuracy", "train/walk_tau_estimate",
            "train/slot_loss/1", "train/slot_selector_accuracy/3", "train/slot_candidate_recall/2"} <= scalars.keys()
    # the selector trained: its codebooks moved from their initialisation
    saved = DFlashDrafter.from_pretrained(tmp_path / "ckpt" / checkpoint_key(30))
    assert saved.spec.dflash2 is not None and saved.candidate_selector is not None
    assert result.drafter.candidate_selector is not None
    torch.testing.assert_close(saved.candidate_selector.successor_codebook,
                               result.drafter.candidate_selector.successor_codebook)


def test_a_dflash_drafter_warm_starts_dflash2_exactly(tmp_path, data_url):
    """train.init_from a DFlash export into a DFlash2 run (lr 0, one step): the checkpoint holds the DFlash tensors as
    they were, identity convolutions and an initialised selector, and its forward equals the DFlash drafter's."""
    dflash = DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, num_draft_layers=2, gamma=4.0,
                          intermediate_size=96)
    torch.manual_seed(5)
    saved = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(GOLDEN_TARGET), dflash))
    for p in saved.parameters():  # a trained-looking drafter, not the default init's
        p.data.add_(torch.randn_like(p) * 0.05)
    saved.save_pretrained(tmp_path / "dflash")
    path = dflash2_config(tmp_path, data_url, max_steps=1, checkpoint_every=1, lr=0.0)
    path.write_text(path.read_text() + f'init_from = "{(tmp_path / "dflash").as_posix()}"\n')
    run(load_config(path))
    warm = DFlashDrafter.from_pretrained(tmp_path / "ckpt" / checkpoint_key(1))
    assert warm.spec.dflash2 is not None and warm.candidate_selector is not None
    state = warm.state_dict()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert (diff := (forward(warm) - forward(saved)).abs().max()) <= 1e-6, diff
    assert warm.candidate_selector.predecessor_codebook.abs().max() > 0  # the selector's own initialisation, not zeros

    # control: a DFlash2 drafter whose convolutions are not the identity computes something else
    layer = warm.layers[0]
    with torch.no_grad():
        layer.attention_conv.base_kernel[0, 1] += 0.5  # type: ignore[union-attr]
    assert (forward(warm) - forward(saved)).abs().max() > 1e-3


def test_mismatched_warm_starts_are_refused_naming_the_field(tmp_path, data_url):
    torch.manual_seed(0)
    dflash2 = DFlashConfig(block_size=4, mask_token_id=511, num_draft_layers=2, gamma=4.0, intermediate_size=96,
                           architecture="dflash2", selector_rank=32, selector_top_k=8)
    DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(GOLDEN_TARGET), dflash2)).save_pretrained(
        tmp_path / "d2"
    )
    (tmp_path / "a").mkdir()
    into_dflash = config_file(tmp_path / "a", data_url, max_steps=1)
    into_dflash.write_text(into_dflash.read_text() + f'init_from = "{(tmp_path / "d2").as_posix()}"\n')
    with pytest.raises(ConfigError, match="is a DFlash2 drafter but dflash.architecture is 'dflash'"):
        run(load_config(into_dflash))
    (tmp_path / "b").mkdir()
    other_rank = dflash2_config(tmp_path / "b", data_url, dflash=DFLASH2.replace("32", "16"), max_steps=1)
    other_rank.write_text(other_rank.read_text() + f'init_from = "{(tmp_path / "d2").as_posix()}"\n')
    with pytest.raises(ConfigError, match="has selector_rank 32 but dflash.selector_rank is 16"):
        run(load_config(other_rank))


@pytest.mark.slow
def test_two_gloo_ranks_train_dflash2_as_one_process(tmp_path, data_url):
    """The selector's parameters are used by the loss, outside the DDP-wrapped forward: their gradients are still
    averaged over the ranks, so two ranks on half the rows each equal one process on all of them."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    run(load_config(dflash2_config(one, data_url, max_steps=3, checkpoint_every=3, batch_size=4, global_batch_size=4)))
    cfg2 = dflash2_config(two, data_url, max_steps=3, checkpoint_every=3, batch_size=2, global_batch_size=4,
                          drafters=["cpu", "cpu"])
    blockdraft = str(Path(sys.executable).with_name("blockdraft"))
    proc = subprocess.run([blockdraft, "train", "--config", str(cfg2), "--nproc", "2"], cwd=two, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    w1 = load_file(str(one / "ckpt" / checkpoint_key(3) / "model.safetensors"))
    w2 = load_file(str(two / "ckpt" / checkpoint_key(3) / "model.safetensors"))
    assert any(name.startswith("candidate_selector.") for name in w1)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=2e-5, msg=name)
