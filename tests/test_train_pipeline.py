"""The training loop's pipelining and gradient accumulation change speed only, never the numbers.

- `Prefetcher`: items in order, at most `depth` ahead, an error raised at the step that needed it, a clean stop.
- A run with the target running ahead (`train.pipeline_depth` 2) is bit-equal to one without (0): losses and weights.
- A global batch split into micro-batches (`train.global_batch_size` > `train.batch_size`) equals the same rows in one
  pass, in one process and across two gloo ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.train_data import config_file, logged_losses, make_rows, write_tokenized
from safetensors.torch import load_file

from blockdraft.config import BlockdraftConfig, load_config
from blockdraft.errors import ConfigError
from blockdraft.model import DFlashDrafter, DrafterSpec, TargetHead
from blockdraft.model.formats import checkpoint_key
from blockdraft.stages.train import run
from blockdraft.stages.train.data import anchor_generator, build_block_batch
from blockdraft.stages.train.step import DraftForward, MicroBatch, Prefetcher, accumulate


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(10, prompt_len=6, new_tokens=40, seed=1)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:8], rows[8:])


def test_prefetcher_gives_items_in_order_and_runs_at_most_depth_ahead():
    made: list[int] = []
    with Prefetcher(lambda step: made.append(step) or step * 10, start=3, stop=9, depth=2) as feed:
        assert feed.get(3) == 30
        time.sleep(0.3)  # the producer fills its queue, then waits
        assert max(made) <= 3 + 1 + 2  # the item handed out, one in the producer's hand, two queued
        assert [feed.get(step) for step in range(4, 9)] == [40, 50, 60, 70, 80]
    assert made == list(range(3, 9))
    with pytest.raises(ValueError, match="asked for step 4, expected 3"):
        Prefetcher(lambda step: step, 3, 9, 0).get(4)


def test_prefetcher_depth_zero_makes_each_item_in_the_callers_thread():
    threads: list[str] = []
    feed = Prefetcher(lambda step: threads.append(threading.current_thread().name) or step, 0, 3, depth=0)
    assert [feed.get(s) for s in range(3)] == [0, 1, 2]
    assert threads == [threading.current_thread().name] * 3


def test_prefetcher_raises_the_producers_error_at_the_step_that_needed_it_and_stops():
    def make(step: int) -> int:
        if step == 2:
            raise RuntimeError("target forward failed at step 2")
        return step

    with Prefetcher(make, 0, 10, depth=1) as feed:
        assert [feed.get(0), feed.get(1)] == [0, 1]
        with pytest.raises(RuntimeError, match="step 2"):
            feed.get(2)
    assert feed._thread is not None and not feed._thread.is_alive()


def test_prefetcher_closes_while_its_producer_waits_on_a_full_queue():
    feed = Prefetcher(lambda step: step, 0, 1000, depth=1)
    assert feed.get(0) == 0
    time.sleep(0.2)
    feed.close()  # would hang if the producer stayed blocked on its full queue
    assert feed._thread is not None and not feed._thread.is_alive()


def _final_weights(folder: Path, steps: int) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "ckpt" / checkpoint_key(steps) / "model.safetensors"))


def test_pipelined_run_is_bit_equal_to_the_unpipelined_one(tmp_path, data_url):
    runs = {}
    for depth in (0, 2):
        folder = tmp_path / f"depth{depth}"
        folder.mkdir()
        run(load_config(config_file(folder, data_url, max_steps=8, checkpoint_every=4, batch_size=2,
                                    pipeline_depth=depth)))
        runs[depth] = (logged_losses(folder / "logs"), _final_weights(folder, 8))
    (losses0, weights0), (losses2, weights2) = runs[0], runs[2]
    assert sorted(losses0) == list(range(1, 9)) and losses2 == losses0  # exact floats, every step
    assert weights2.keys() == weights0.keys()
    assert all(torch.equal(weights2[name], weights0[name]) for name in weights0)


def test_accumulated_micro_batches_equal_the_global_batch_in_one_pass(tmp_path, data_url):
    runs = {}
    for micro in (4, 1):
        folder = tmp_path / f"micro{micro}"
        folder.mkdir()
        result = run(load_config(config_file(folder, data_url, max_steps=6, checkpoint_every=6, batch_size=micro,
                                             global_batch_size=4)))
        runs[micro] = (logged_losses(folder / "logs"), _final_weights(folder, 6), result.details.metrics)
    (l4, w4, m4), (l1, w1, m1) = runs[4], runs[1]
    assert sorted(l1) == sorted(l4) == list(range(1, 7))
    for step in l4:
        assert l1[step] == pytest.approx(l4[step], rel=1e-5)
    assert [e["tokens"] for e in m1] == [e["tokens"] for e in m4]  # the same rows, counted once each
    assert [e["slot_accuracy"] for e in m1] == [e["slot_accuracy"] for e in m4]
    for name in w4:  # after 6 AdamW steps, whose normalisation magnifies rounding in the smallest gradients
        torch.testing.assert_close(w1[name], w4[name], rtol=1e-4, atol=2e-5)


def test_accumulated_gradients_equal_one_pass_over_the_same_rows():
    torch.manual_seed(0)
    spec = DrafterSpec(
        hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512, vocab_size=97, block_size=4, mask_token_id=96,
        target_layer_ids=[1, 2], num_target_layers=4, gamma=4.0,
    )
    drafter = DFlashDrafter(spec)
    head = TargetHead(torch.nn.Embedding(97, 32), torch.nn.Linear(32, 97, bias=False))
    g = torch.Generator().manual_seed(1)
    rows = [(torch.randint(0, 96, (n,), generator=g), torch.tensor([0] * 3 + [1] * (n - 3))) for n in (20, 31, 12, 26)]
    features = [torch.randn(1, n, 64, generator=g) for n in (20, 31, 12, 26)]

    def micro(indices: list[int]) -> MicroBatch:
        batch = build_block_batch([rows[i] for i in indices], num_anchors=5, block_size=4, mask_token_id=96, gamma=4.0,
                                  generators=[anchor_generator(0, 0, i) for i in indices])
        width = batch.input_ids.shape[1]
        padded = torch.cat(
            [torch.nn.functional.pad(features[i], (0, 0, 0, width - features[i].shape[1])) for i in indices]
        )
        return MicroBatch(batch, padded, batch.num_tokens)

    def grads(parts: list[list[int]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sums, weight_sum, _ = accumulate(DraftForward(drafter), drafter, head, [micro(p) for p in parts], 2, 1e9, 1)
        gradients = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        return sums["weighted_term"] / weight_sum, gradients

    loss_one, one = grads([[0, 1, 2, 3]])
    for split in ([[0], [1], [2], [3]], [[0, 1], [2, 3]]):
        loss, acc = grads(split)
        assert loss == pytest.approx(float(loss_one), rel=1e-6)
        assert acc.keys() == one.keys() and len(one) == len(list(drafter.parameters()))
        for name in one:
            torch.testing.assert_close(acc[name], one[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_two_gloo_ranks_accumulating_equal_one_process_on_the_global_batch(tmp_path, data_url):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    run(load_config(config_file(one, data_url, max_steps=4, checkpoint_every=4, batch_size=4, global_batch_size=4)))
    cfg2 = config_file(two, data_url, max_steps=4, checkpoint_every=4, batch_size=1, global_batch_size=4,
                       drafters=["cpu", "cpu"])
    blockdraft = str(Path(sys.executable).with_name("blockdraft"))
    proc = subprocess.run([blockdraft, "train", "--config", str(cfg2), "--nproc", "2"], cwd=two, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    l1, l2 = logged_losses(one / "logs"), logged_losses(two / "logs")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5)
    w1, w2 = _final_weights(one, 4), _final_weights(two, 4)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=2e-5, msg=name)  # as test_train.py's DDP check


def test_a_global_batch_that_does_not_split_over_the_ranks_is_one_line_naming_both_fields(tmp_path):
    with pytest.raises(ValueError, match=r"global_batch_size 32 is not a multiple of train.batch_size 3 x 2 drafter "
                                         r"rank\(s\) = 6"):
        BlockdraftConfig.model_validate({"train": {"batch_size": 3}, "placement": {"drafter_devices": ["cpu", "cpu"]}})
    path = tmp_path / "c.toml"
    path.write_text('[train]\nbatch_size = 5\nglobal_batch_size = 12\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message and "set train.global_batch_size to 10 or 15" in message
    assert BlockdraftConfig().train.global_batch_size == 32  # rows per optimizer step by default
