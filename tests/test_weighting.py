"""Position-aware loss weighting (dflash.loss_weighting): the D-PACE weights as published, what they mean, how the loss
normalises them, and that the choice is pinned in the run like gamma. Also the drafter's initial weights
(train.init)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.train_data import config_file, make_rows, write_tokenized
from transformers import Qwen3Config

from blockdraft.config import load_config
from blockdraft.errors import ConfigError
from blockdraft.model import DFlashDrafter, DrafterSpec
from blockdraft.model.drafter import RMSNorm
from blockdraft.model.formats import PINNED_CONFIG_NAME, checkpoint_key
from blockdraft.model.weight_init import init_drafter, initializer_range
from blockdraft.stages.train import run
from blockdraft.stages.train.loss import Objective, block_loss, dpace_weights


def ce_of(probabilities: list[float]) -> torch.Tensor:
    return -torch.log(torch.tensor(probabilities))


def test_dpace_weights_by_hand():
    # One block of 4: slot 0 is the anchor (unsupervised). Drafter probabilities of the labels 1.0, 0.5, 0.0 smooth with
    # alpha 0.5 to s = 1, 0.75, 0.5; prefix products 1, 0.75, 0.375; each slot weighs the sum of the prefixes from it
    # on.
    w = dpace_weights(ce_of([0.3, 1.0, 0.5, 1e-30]), torch.tensor([0, 1, 1, 1]), 4, 0.5)
    torch.testing.assert_close(w, torch.tensor([0.0, 2.125, 1.125, 0.375]))
    # An unsupervised slot passes the product through unchanged and weighs nothing; blocks are independent.
    w = dpace_weights(ce_of([0.3, 0.5, 0.1, 0.5] * 2), torch.tensor([0, 1, 0, 1, 0, 0, 1, 1]), 4, 0.5)
    torch.testing.assert_close(w, torch.tensor([0.0, 0.75 + 0.75 * 0.75, 0.0, 0.75 * 0.75, 0.0, 0.0,
                                                0.55 + 0.55 * 0.75, 0.55 * 0.75]))


def test_a_perfect_drafter_weighs_each_slot_by_the_tokens_it_gates():
    # q = 1 everywhere: slot k of B = 16 gates itself and every later slot, B - k tokens, whatever alpha.
    for alpha in (0.1, 0.5, 1.0):
        w = dpace_weights(torch.zeros(16), torch.arange(16) > 0, 16, alpha)
        assert w.tolist() == [0.0] + [float(16 - k) for k in range(1, 16)]


def test_dpace_weight_is_the_gradient_of_the_expected_acceptance_length():
    # E[tau] - 1 = sum_j prod_{i<=j} s_i; its derivative in log s_k is the D-PACE weight of slot k.
    g = torch.Generator().manual_seed(0)
    q = torch.rand(8, generator=g) * 0.9 + 0.05
    mask = torch.ones(8)
    mask[0] = 0
    alpha = 0.3
    log_s = torch.log((1 - alpha) * q + alpha).requires_grad_(True)
    expected = (torch.cumprod(torch.where(mask > 0, log_s.exp(), torch.ones(8)), 0) * mask).sum()
    (grad,) = torch.autograd.grad(expected, log_s)
    torch.testing.assert_close(dpace_weights(-torch.log(q), mask, 8, alpha), grad * mask)


def test_weights_flatten_as_the_drafter_improves():
    # A weak drafter's weight falls off steeply along the block; a strong one's much less: the weights follow
    # acceptance.
    mask = torch.arange(8) > 0
    weak = dpace_weights(ce_of([0.2] * 8), mask, 8, 0.5)
    strong = dpace_weights(ce_of([0.9] * 8), mask, 8, 0.5)
    assert (weak[7] / weak[1]) < 0.05 < 0.1 < (strong[7] / strong[1])


def test_dpace_loss_divides_by_the_supervised_slot_count_and_ignores_gamma():
    g = torch.Generator().manual_seed(2)
    hidden, head = torch.randn(1, 8, 6, generator=g), torch.randn(10, 6, generator=g)
    labels = torch.randint(0, 10, (1, 8), generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.float32)
    decays = [mask, mask * torch.tensor([0.0, 1.0, 0.7, 0.5] * 2)]  # the batch's gamma decay only marks supervision
    outs = [block_loss(hidden, labels, w, head, None, 4, 1, objective=Objective(weighting="dpace")) for w in decays]
    assert torch.equal(outs[0].loss, outs[1].loss) and outs[0].weight_sum.item() == 5.0
    ce = torch.nn.functional.cross_entropy(hidden[0] @ head.T, labels[0], reduction="none")
    torch.testing.assert_close(outs[0].loss, (dpace_weights(ce, mask[0], 4, 0.5) * ce).sum() / 5)
    assert (Objective(weighting="dpace").normaliser(decays[1]).item() == 5.0
            and Objective().normaliser(decays[1]).item() == pytest.approx(3.9))


@pytest.mark.slow
def test_weighting_is_pinned_in_the_checkpoint_and_a_resume_with_another_is_refused(tmp_path):
    rows = make_rows(4, prompt_len=6, new_tokens=24, seed=1)
    data = write_tokenized(tmp_path / "tokenized", rows[:3], rows[3:])
    path = config_file(tmp_path, data, max_steps=2, checkpoint_every=2)
    path.write_text(path.read_text().replace("gamma = 4.0",
                                             'gamma = 4.0\nloss_weighting = "dpace"\ndpace_alpha = 0.25'))
    run(load_config(path))
    pinned = json.loads((tmp_path / "ckpt" / checkpoint_key(2) / PINNED_CONFIG_NAME).read_text())
    assert pinned["dflash"]["loss_weighting"] == "dpace" and pinned["dflash"]["dpace_alpha"] == 0.25
    path.write_text(
        path.read_text()
        .replace('loss_weighting = "dpace"', 'loss_weighting = "exponential"')
        .replace("max_steps = 2", "max_steps = 4")
    )
    with pytest.raises(ConfigError, match="another run .differs in dflash"):
        run(load_config(path))


def test_hf_normal_init_draws_every_linear_from_the_target_range_and_pytorch_leaves_the_defaults():
    target = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=300, initializer_range=0.05)
    spec = DrafterSpec(hidden_size=256, intermediate_size=512, num_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=512, vocab_size=300, block_size=4, mask_token_id=299,
                       target_layer_ids=[1, 3, 5], num_target_layers=8, gamma=4.0)
    torch.manual_seed(0)
    default = DFlashDrafter(spec)
    torch.manual_seed(0)
    untouched = DFlashDrafter(spec)
    init_drafter(untouched, "pytorch", target)
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), untouched.state_dict().values(),
                                                 strict=True))
    # PyTorch's default: uniform with std 1/sqrt(3 * fan_in), so fc (3 * 256 inputs) starts sqrt(3)x smaller than a
    # 256-input layer
    assert default.fc.weight.std().item() == pytest.approx((3 * 768) ** -0.5, rel=0.05)

    torch.manual_seed(0)
    hf = DFlashDrafter(spec)
    for norm in (m for m in hf.modules() if isinstance(m, RMSNorm)):
        norm.weight.data.fill_(3.0)  # a trained-looking norm, to see it reset
    init_drafter(hf, "hf_normal", target)
    linears = [m.weight for m in hf.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 1 + 2 * 7  # fc, and per layer q, k, v, o, gate, up, down
    for weight in linears:  # the same std whatever the fan-in, mean 0
        assert weight.std().item() == pytest.approx(0.05, rel=0.08) and abs(weight.mean().item()) < 0.01
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in hf.modules() if isinstance(m, RMSNorm))
    torch.manual_seed(0)
    again = DFlashDrafter(spec)
    init_drafter(again, "hf_normal", target)  # the seed fixes it (the norms were reset either way)
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), again.state_dict().values(), strict=True))

    assert initializer_range(Qwen3Config()) == 0.02
    with pytest.raises(ValueError, match="train.init"):
        init_drafter(hf, "xavier", target)
