"""The decode loop of docs/DFLASH.md: golden vectors of the reference implementation, losslessness, acceptance,
cropping, stops."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers.decode import ngram_generate, speculative_generate
from helpers.paths import GOLDEN
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig

from blockdraft.config import BlockdraftConfig, DFlashConfig, EvalConfig
from blockdraft.decode.cached_target import CachedTarget
from blockdraft.decode.linear_state import check_rollback_supported
from blockdraft.decode.ngram import NgramProposer
from blockdraft.decode.speculative import DFlashProposer, greedy_decode, run_speculative
from blockdraft.errors import DecodeError
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.spec import DrafterSpec
from blockdraft.model.target import TargetHead, TargetModel
from blockdraft.stages.eval import divergence_tolerance, first_divergence

FP32_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def golden_target():
    return AutoModelForCausalLM.from_pretrained(GOLDEN / "target", attn_implementation="eager",
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def golden_drafter():
    return DFlashDrafter.from_pretrained(GOLDEN / "drafter").eval()


@pytest.fixture(scope="module")
def golden():
    return json.loads((GOLDEN / "golden.json").read_text())


def _new_tokens(case: dict) -> int:
    return len(case["spec_output"]) - len(case["prompt"])


def test_golden_decode_reproduces_reference_outputs_and_acceptance_lengths(golden_target, golden_drafter, golden):
    head = TargetHead.from_target(golden_target)
    for case in golden["decode"]:
        result = speculative_generate(golden_target, golden_drafter, head, case["prompt"], _new_tokens(case), [])
        assert result.tokens == case["spec_output"]
        assert result.acceptance_lengths == case["acceptance_lengths"]
        assert result.target_forwards == 1 + len(case["acceptance_lengths"])
        assert result.tau == pytest.approx(sum(case["acceptance_lengths"]) / len(case["acceptance_lengths"]))


def test_target_only_greedy_reproduces_reference_greedy_output(golden_target, golden):
    for case in golden["decode"]:
        result = greedy_decode(golden_target, case["prompt"], _new_tokens(case))
        assert result.tokens == case["greedy_output"]
        assert result.target_forwards == _new_tokens(case)  # the prefill yields the first token
        assert len(result.margins) == _new_tokens(case) and min(result.margins) > 0


def test_crop_rolls_the_target_cache_back_to_committed_positions(golden_target):
    ids = torch.tensor([[5, 17, 230, 41, 99, 7, 300]])
    full, _ = CachedTarget(golden_target).forward(ids, 0)
    cached = CachedTarget(golden_target, layer_ids=[1, 3, 5])
    cached.forward(ids[:, :3], 0)
    cached.forward(torch.tensor([[400, 401, 402]]), 3)  # a rejected block: its K/V must disappear
    cached.crop(3)
    assert cached.length == 3
    logits, features = cached.forward(ids[:, 3:], 3)
    torch.testing.assert_close(logits, full[:, 3:], atol=1e-5, rtol=1e-5)
    assert features.shape == (1, 4, 3 * 64)
    with pytest.raises(RuntimeError, match="cache holds"):
        cached.forward(ids[:, :1], 3)


def _random_target(seed: int, vocab: int, layers: int, init: float) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=init,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return Qwen3ForCausalLM(config).eval()


def _untrained_drafter(target, block_size: int, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    dflash = DFlashConfig(architecture="dflash", block_size=block_size, mask_token_id=target.config.vocab_size - 1,
                          num_draft_layers=2, gamma=4.0)
    return DFlashDrafter(DrafterSpec.from_target_config(target.config, dflash)).eval()


class NoisyOracle:
    """A test drafter that knows the greedy continuation and gets exactly the planned number of drafts right per
    cycle."""

    layer_ids = None

    def __init__(self, greedy_tokens: list[int], block_size: int, vocab: int, plan: list[int]):
        self.truth, self.block_size, self.vocab, self.plan = greedy_tokens, block_size, vocab, list(plan)
        self.mask_token_id = vocab - 1

    def propose(self, tokens, new_features, start):
        right = self.plan.pop(0)
        drafts = []
        for k in range(1, self.block_size):
            pos = start + k
            correct = self.truth[pos] if pos < len(self.truth) else 0
            drafts.append(correct if k <= right else (correct + 1) % self.vocab)
        return drafts


@pytest.mark.parametrize("seed,vocab,layers,block_size", [(0, 64, 6, 4), (1, 96, 6, 8), (2, 48, 8, 2), (3, 128, 6, 16)])
def test_spec_output_equals_target_greedy_for_random_targets_and_drafters(seed, vocab, layers, block_size):
    target = _random_target(seed, vocab, layers, init=0.3)
    head = TargetHead.from_target(target)
    drafter = _untrained_drafter(target, block_size, seed)
    rng = random.Random(seed)
    for p in range(3):
        prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(1, 12))]
        max_new = rng.randint(5, 40)
        reference = greedy_decode(target, prompt, max_new)
        runs = {
            "untrained": speculative_generate(target, drafter, head, prompt, max_new),
            "ngram": ngram_generate(target, prompt, max_new, [], block_size, vocab - 1),
        }
        plan = [rng.randint(0, block_size - 1) for _ in range(max_new + 1)]
        runs["oracle"] = run_speculative(target, NoisyOracle(reference.tokens, block_size, vocab, plan), prompt,
                                         max_new)
        for name, result in runs.items():
            found = first_divergence(name, p, result, reference, FP32_TOLERANCE)
            # Exact equality, or a divergence at a reported near-tie (batched vs one-at-a-time rounding).
            assert found is None or found.tolerated, found
            if found is None:
                assert len(result.new_tokens) == max_new
                assert sum(result.acceptance_lengths) >= max_new
                assert result.target_forwards == 1 + len(result.acceptance_lengths)
        # The oracle's accept counts are exactly as planned (the last cycle may reach past the known continuation).
        accepted = [n - 1 for n in runs["oracle"].acceptance_lengths]
        assert accepted[:-1] == plan[: len(accepted) - 1]


def test_stop_token_ends_the_output_like_greedy(golden_target, golden_drafter, golden):
    head = TargetHead.from_target(golden_target)
    case = golden["decode"][2]
    prompt_len = len(case["prompt"])
    stop = case["greedy_output"][prompt_len + 9]  # the 10th new token
    first = case["greedy_output"].index(stop, prompt_len)
    reference = greedy_decode(golden_target, case["prompt"], 24, [stop])
    result = speculative_generate(golden_target, golden_drafter, head, case["prompt"], 24, [stop])
    assert reference.tokens == case["greedy_output"][: first + 1]
    assert result.tokens == reference.tokens
    # The loop stops in the cycle that committed the stop token, not after 24 tokens.
    assert sum(result.acceptance_lengths) < sum(case["acceptance_lengths"])
    assert sum(result.acceptance_lengths) >= first + 1 - prompt_len


def test_ngram_proposer_copies_what_followed_the_latest_match():
    proposer = NgramProposer(block_size=5, pad_token_id=0, max_ngram=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3]
    # Suffix [7, 2, 3] is new; [2, 3] last occurred at 6..7, followed by 4, 6, 7, 2.
    assert proposer.propose(tokens, None, len(tokens) - 1) == [4, 6, 7, 2]
    # Continuation runs into the end: padded with the pad (mask) id.
    assert proposer.propose([8, 1, 8], None, 2) == [1, 8, 0, 0]
    assert proposer.propose([5], None, 0) == [0, 0, 0, 0]


def test_ngram_baseline_accepts_on_repetitive_text(golden_target, golden):
    case = golden["decode"][0]  # the target repeats "79 79 126": lookup should accept drafts
    result = ngram_generate(golden_target, case["prompt"], 24, [], block_size=4, pad_token_id=511)
    assert result.tokens == case["greedy_output"]
    assert result.tau > 1.0


def test_only_layer_kinds_without_a_rollback_are_refused_by_name():
    check_rollback_supported(Qwen3Config())
    check_rollback_supported(Qwen3NextConfig())  # linear attention: rolled back (tests/test_hybrid_decode.py)
    with pytest.raises(DecodeError, match=r"\['sliding_attention'\]"):
        check_rollback_supported(Qwen3Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]))


def test_cached_drafts_equal_a_fresh_full_context_draft_at_every_cycle():
    """The drafter cache grows by the committed positions only: each cycle's draft equals one computed from scratch over
    the target features of every committed position (features from one uncached target forward over the final text)."""
    target = _random_target(5, 64, 6, init=0.3)
    drafter = _untrained_drafter(target, 4, 5)
    head = TargetHead.from_target(target)
    seen: list[tuple[int, list[int], list[int]]] = []

    class Recording(DFlashProposer):
        def propose(self, tokens, new_features, start):
            drafts = super().propose(tokens, new_features, start)
            seen.append((start, tokens[start], drafts))
            return drafts

    result = run_speculative(target, Recording(drafter, head), [3, 14, 15, 9, 26], 30)
    features = TargetModel(target, drafter.spec.target_layer_ids).features(torch.tensor([result.tokens]))
    assert len(seen) == len(result.acceptance_lengths) > 5
    for start, anchor, drafts in seen:
        block = torch.tensor([[anchor] + [drafter.spec.mask_token_id] * 3])
        with torch.no_grad():
            hidden = drafter(head.embed(block), drafter.project_context(features[:, :start]),
                             torch.arange(start, start + 4)[None], torch.arange(start)[None])
        assert head.logits(hidden[:, 1:]).argmax(-1)[0].tolist() == drafts


def test_bf16_divergences_are_near_ties_within_the_bf16_tolerance(golden):
    tolerance = divergence_tolerance(EvalConfig(), torch.bfloat16)
    assert (
        tolerance == BlockdraftConfig().eval.divergence_margin_bf16 > divergence_tolerance(EvalConfig(), torch.float32)
    )
    target = AutoModelForCausalLM.from_pretrained(GOLDEN / "target", dtype=torch.bfloat16).eval()
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter", dtype=torch.bfloat16).eval()
    head = TargetHead.from_target(target)
    for i, case in enumerate(golden["decode"]):
        reference = greedy_decode(target, case["prompt"], 40)
        result = speculative_generate(target, drafter, head, case["prompt"], 40)
        found = first_divergence("dflash", i, result, reference, tolerance)
        assert found is None or found.tolerated, found
