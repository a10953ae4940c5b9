"""Lossless speculative decoding on hybrid-attention targets (linear-attention layers with a recurrent state).

Two tiny fp32 fixtures built from config: a composite Qwen3.5 checkpoint (vision tower, M-RoPE) loaded as a causal LM,
and a Qwen3-Next model. For an untrained drafter, a briefly trained one and a noisy oracle that forces every acceptance
length 1..B, the speculative output equals target-only greedy; the same runs without the linear-state rollback diverge
(the negative control: it proves the test can fail and that the rollback is what makes the output right).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hybrid import VOCAB_SIZE, save_qwen3_5_composite, save_qwen3_next
from test_decode import NoisyOracle
from transformers import AutoModelForCausalLM, Qwen3Config

from blockdraft.config import DFlashConfig, EvalConfig, load_config
from blockdraft.decode.cached_target import CachedTarget
from blockdraft.decode.linear_state import LinearStateRollback, _Replay
from blockdraft.decode.speculative import DFlashProposer, greedy_decode, run_speculative
from blockdraft.errors import DecodeError
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.formats import find_resumable
from blockdraft.model.spec import DrafterSpec
from blockdraft.model.target import TargetHead, missing_kernels_warning
from blockdraft.stages import train as train_stage
from blockdraft.stages.eval import divergence_tolerance, first_divergence
from blockdraft.store import open_store

BLOCK = 4
MASK_ID = VOCAB_SIZE - 5  # below the composite's vision placeholder ids, above every id the tokenizer makes
PROMPTS = 3
NEW_TOKENS = 32

BUILDERS = {"qwen3_5_composite": save_qwen3_5_composite, "qwen3_next": save_qwen3_next}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def hybrid(request, tmp_path_factory):
    """(folder, fp32 causal LM, greedy references) for one fixture."""
    folder = BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "target")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(400) for _ in range(rng.randint(4, 12))] for _ in range(PROMPTS)]
    references = [greedy_decode(model, prompt, NEW_TOKENS) for prompt in prompts]
    return folder, model, prompts, references


def _untrained(model) -> DFlashDrafter:
    torch.manual_seed(1)
    dflash = DFlashConfig(architecture="dflash", block_size=BLOCK, mask_token_id=MASK_ID, num_draft_layers=2, gamma=4.0)
    return DFlashDrafter(DrafterSpec.from_target_config(model.config, dflash)).eval()


def _trained(folder, references, tmp_path) -> DFlashDrafter:
    """A drafter trained by the train stage on the target's own greedy continuations of the test prompts (it may
    memorise them: what matters here is that it accepts often and partly, not that it generalises)."""
    from helpers.train_data import write_tokenized

    rows = [
        {"input_ids": ref.tokens, "loss_mask": [0] * ref.prompt_len + [1] * len(ref.new_tokens),
         "source_id": f"row-{i}-{copy}"}
        for copy in range(8) for i, ref in enumerate(references)
    ]
    data = write_tokenized(tmp_path / "tokenized", rows[:-2], rows[-2:])
    cfg = load_config(None, {
        "target": {"path": str(folder)}, "store": {"url": str(tmp_path / "store")},
        "dflash": {"block_size": BLOCK, "mask_token_id": MASK_ID, "num_draft_layers": 2, "gamma": 4.0,
                   "num_anchors": 16},
        "train": {"data": data, "output": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"), "max_steps": 20,
                  "batch_size": 4, "global_batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.05, "checkpoint_every": 20,
                  "seed": 0},
    })
    train_stage.run(cfg)
    newest = find_resumable(open_store(str(tmp_path / "run")))
    assert newest is not None and newest.step == 20
    folder = newest.store.local_path()
    assert folder is not None
    return DFlashDrafter.from_pretrained(folder).eval()


def _runs(model, proposer_factory, prompts, rollback=True):
    return [run_speculative(model, proposer_factory(i), prompt, NEW_TOKENS, rollback_linear_state=rollback)
            for i, prompt in enumerate(prompts)]


def test_oracle_forcing_every_acceptance_length_is_lossless_and_diverges_without_rollback(hybrid):
    _folder, model, prompts, references = hybrid
    plans = [[(i + p) % BLOCK for i in range(NEW_TOKENS + 1)] for p in range(PROMPTS)]

    def oracle(i):
        return NoisyOracle(references[i].tokens, BLOCK, VOCAB_SIZE, plans[i])

    results = _runs(model, oracle, prompts)
    assert [r.tokens for r in results] == [r.tokens for r in references]
    seen = {n for r in results for n in r.acceptance_lengths}
    assert seen == set(range(1, BLOCK + 1))  # every acceptance length 1..B happened
    assert all(r.rollback_s > 0 for r in results)
    without = _runs(model, oracle, prompts, rollback=False)
    assert sum(r.tokens != ref.tokens for r, ref in zip(without, references, strict=True)) >= 2


def test_untrained_and_trained_drafters_are_lossless_on_hybrid_targets(hybrid, tmp_path):
    folder, model, prompts, references = hybrid
    head = TargetHead.from_target(model)
    untrained = _untrained(model)
    trained = _trained(folder, references, tmp_path)
    taus = {}
    for name, drafter in (("untrained", untrained), ("trained", trained)):
        results = _runs(model, lambda _i, d=drafter: DFlashProposer(d, head), prompts)
        assert [r.tokens for r in results] == [r.tokens for r in references], name
        taus[name] = sum(r.tau for r in results) / len(results)
    assert taus["trained"] > taus["untrained"], taus
    # Negative control with the trained drafter: partial acceptances happen, and without the rollback they corrupt the
    # state.
    without = _runs(model, lambda _i: DFlashProposer(trained, head), prompts, rollback=False)
    assert any(r.tokens != ref.tokens for r, ref in zip(without, references, strict=True))


def test_a_layer_whose_projections_never_ran_is_refused_not_skipped(hybrid):
    """A fused kernel that runs a linear layer without calling its projections leaves nothing to replay: refuse
    loudly."""
    _folder, model, prompts, _references = hybrid
    target = CachedTarget(model)
    assert isinstance(target.linear, LinearStateRollback)
    prompt = torch.tensor([prompts[0]])
    target.forward(prompt, 0)
    index, mixer = next(iter(target.linear.mixers.items()))
    name, projection = next((n, c) for n, c in mixer.named_children() if isinstance(c, torch.nn.Linear))
    frozen = projection(torch.zeros(1, BLOCK, projection.in_features))
    # stands in for a kernel: the layer runs, its projection's hook never fires
    setattr(mixer, name, _Replay(frozen, BLOCK))
    try:
        target.forward(torch.tensor([[1] * BLOCK]), prompt.shape[1])
    finally:
        setattr(mixer, name, projection)
    with pytest.raises(DecodeError, match=rf"layer {index} .*without calling its projections \['{name}'\]"):
        target.crop(prompt.shape[1] + 1)


def test_missing_linear_attention_kernels_warn_on_cuda_only(hybrid):
    _folder, model, _prompts, _references = hybrid
    line = missing_kernels_warning(model.config, "cuda:0")
    assert line is not None and "blockdraft[gpu]" in line and "flash-linear-attention" in line
    assert missing_kernels_warning(model.config, "cpu") is None
    assert missing_kernels_warning(Qwen3Config(), "cuda:0") is None


def test_bf16_divergences_on_hybrid_targets_are_reported_near_ties(hybrid):
    """bf16: verifying B tokens at once and decoding one at a time may round apart; any divergence is a near-tie."""
    folder, _model, prompts, _references = hybrid
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    tolerance = divergence_tolerance(EvalConfig(), torch.bfloat16)
    for p, prompt in enumerate(prompts):
        reference = greedy_decode(model, prompt, NEW_TOKENS)
        plan = [(i + p) % BLOCK for i in range(NEW_TOKENS + 1)]
        result = run_speculative(model, NoisyOracle(reference.tokens, BLOCK, VOCAB_SIZE, plan), prompt, NEW_TOKENS)
        found = first_divergence("oracle", p, result, reference, tolerance)
        assert found is None or found.tolerated, found
