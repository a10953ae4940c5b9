"""Benchmark the pipelined training step: the target's forward for step N+1 overlapping the drafter's step N.

    python -m bench.train --pipeline            # CPU: target and drafter one thread each, on 2 free cores
    python -m bench.train --pipeline --steps 20 --rounds 2 --seq-len 256   # a quick look
    python -m bench.train --pipeline --preset qwen3-8b            # one GPU: Qwen3-8B-shaped target and drafter

The target is a random-init Qwen3 built from a config (no weights to download) with as many layers as make its forward
take about as long as the drafter's step (measured first), as on the real job (about 148 vs 169 TFLOP per 3072-token row
for a 27B target and its 5-layer drafter). The same `Prefetcher` and step (`accumulate`, then AdamW) as `blockdraft train`
run four loops over the same batches, each side in the thread it has when pipelined, taking turns a slice of steps each
(`--rounds` slices), so that a shared machine's changing load hits all four alike:

- target alone (t): the producer thread makes every step's features, the training thread only takes them;
- drafter alone (d): the training thread steps over those features, the producer thread idle;
- unpipelined (`pipeline_depth` 0): the target, then the drafter, one after the other on the training thread;
- pipelined (`pipeline_depth` 1): the target in the producer thread, one step ahead of the drafter.

Prints `pipeline ratio = X` = pipelined step time / (t + d) beside its floor max(t, d) / (t + d) (the pipelined step can
be no shorter than its longer side), medians over each slice's steps after its first two, and checks that the drafter's losses
are bit-equal in the three loops that train (same batches, same order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from blockdraft.model import DFlashDrafter, DrafterSpec, TargetHead, TargetModel
from blockdraft.model.block_sparse import resolve_attention
from blockdraft.stages.train.batch import BlockBatch, anchor_generator, build_block_batch
from blockdraft.stages.train.prefetch import Prefetcher, SideStreams, StepInputs
from blockdraft.stages.train.step import DraftForward, MicroBatch, accumulate


def random_target(layers: int, args: argparse.Namespace, device: torch.device, seed: int):
    """A random-init Qwen3 causal LM of `layers` decoder layers in the preset's shape, frozen, on `device` (bf16 on CUDA,
    fp32 on the CPU)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=layers,
        num_attention_heads=args.hidden // args.head_dim, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=40960, tie_word_embeddings=False,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def make_drafter(target, layer_ids: list[int], drafter_layers: int, block_size: int) -> tuple[DFlashDrafter, TargetHead]:
    cfg = target.config
    spec = DrafterSpec(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=drafter_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192, vocab_size=cfg.vocab_size, block_size=block_size,
        mask_token_id=cfg.vocab_size - 1, target_layer_ids=layer_ids, num_target_layers=cfg.num_hidden_layers, gamma=7.0,
    )
    torch.manual_seed(1)
    device = next(target.parameters()).device
    return DFlashDrafter(spec).to(device), TargetHead.from_target(target, device)


def trainer_step(drafter: DFlashDrafter, head: TargetHead):
    """The trainer's optimizer step on one micro-batch (`accumulate`, then AdamW); returns the step's loss, read on the
    host, so a call ends when the drafter's device has."""
    model, optimizer = DraftForward(drafter), torch.optim.AdamW(drafter.parameters(), lr=1e-4)

    def step(inputs: tuple[BlockBatch, torch.Tensor]) -> float:
        batch, features = inputs
        micro = [MicroBatch(batch, features, tokens=int(batch.input_ids.numel()))]
        totals, weight_sum, _ = accumulate(model, drafter, head, micro, 64, grad_clip=1.0, world_size=1)
        optimizer.step()
        return float(totals[0] / weight_sum)

    return step


def median_time(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# qwen3-8b: a random-init Qwen3-8B-shaped target (36 layers, H 4096) and the published 5-layer drafter shape, both on
# one GPU (the target on its own stream), at 3072 tokens x 512 anchors x B 16.
PRESETS = {
    "cpu": dict(seq_len=512, hidden=256, intermediate=768, head_dim=64, kv_heads=2, vocab=4096, anchors=32, drafter_layers=1,
                target_layers=None, device="cpu", steps=50, rounds=5),
    "qwen3-8b": dict(seq_len=3072, hidden=4096, intermediate=12288, head_dim=128, kv_heads=8, vocab=151936, anchors=512,
                     drafter_layers=5, target_layers=36, device="cuda", steps=32, rounds=4),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for name in ("steps", "rounds", "seq-len", "hidden", "intermediate", "head-dim", "kv-heads", "vocab", "anchors", "drafter-layers"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--target-layers", type=int, help="default: the preset's, or (cpu) as many as balance the drafter")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device")
    parser.add_argument("--attention", choices=["auto", "dense", "flex"], default="auto")
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    attention = resolve_attention(args.attention, device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core for each side: the target's thread and the drafter's
    load = os.getloadavg()[0]

    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(0, args.vocab - 1, (args.seq_len,), generator=g), torch.ones(args.seq_len, dtype=torch.long))
            for _ in range(args.steps)]

    def batch_of(step: int):
        return build_block_batch([rows[step]], num_anchors=args.anchors, block_size=args.block_size,
                                 mask_token_id=args.vocab - 1, gamma=7.0, generators=[anchor_generator(0, 0, step)],
                                 attention=attention)

    def setup(layers: int):
        target = random_target(layers, args, device, seed=0)
        layer_ids = sorted({1, layers - 2}) if layers > 3 else [0]
        drafter, head = make_drafter(target, layer_ids, args.drafter_layers, args.block_size)
        return TargetModel(target, layer_ids), drafter, head

    streams = SideStreams(device, device)

    def features_of(target: TargetModel, step: int) -> StepInputs:
        """What the trainer's `inputs_of` does: the batch to the device and the target's features, on side streams."""
        with streams.active():
            batch = batch_of(step).to(device)
            features = target.features(batch.input_ids, batch.attention_mask_context.long())
        return StepInputs([(batch, features)], streams.record())

    def ready(inputs: StepInputs):
        inputs.wait(device)
        return inputs.micro[0]

    layers = args.target_layers
    if layers is None:  # balance: the drafter's step time, then target layers to match it (linear in layers)
        probe_layers = 4
        probe_target, drafter, head = setup(probe_layers)
        probe_step = trainer_step(drafter, head)
        inputs = ready(features_of(probe_target, 0))
        probe_step(inputs)
        drafter_alone = median_time(lambda: probe_step(inputs), 5, device)
        probe = median_time(lambda: ready(features_of(probe_target, 0)), 5, device)
        layers = max(4, round((probe_layers - 1) * drafter_alone / probe) + 1)  # the forward runs to layer L-2

    target, drafter, head = setup(layers)  # the target is frozen: every loop shares it
    loops = {"drafter": trainer_step(drafter, head)}
    for name in ("unpipelined", "pipelined"):  # the same initial weights (make_drafter seeds them)
        loops[name] = trainer_step(*make_drafter(target.model, target.layer_ids, args.drafter_layers, args.block_size))
    times: dict[str, list[float]] = {name: [] for name in ("target", *loops)}
    losses: dict[str, list[float]] = {name: [] for name in loops}

    def run(name: str, first: int, stop: int, depth: int) -> list:
        """Steps [first, stop) of one loop, each step timed on the training thread; returns what the steps took in."""
        taken = []
        with Prefetcher(lambda s: features_of(target, s), first, stop, depth) as feed:
            for s in range(first, stop):
                t0 = time.perf_counter()
                inputs = ready(feed.get(s))
                if name != "target":
                    losses[name].append(loops[name](inputs))  # reading the loss waits for the drafter's device
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                taken.append(inputs)
        return taken

    # The loops take turns over the steps, a slice each per round, so a shared machine's changing load hits all alike.
    # The first two steps of a slice fill the pipeline and are left out of the medians.
    per_round = args.steps // args.rounds
    kept: dict[str, list[float]] = {name: [] for name in times}
    for first in range(0, per_round * args.rounds, per_round):
        stop = first + per_round
        made = run("target", first, stop, 1)  # the producer thread makes the features, the training thread only takes them
        mark = len(times["drafter"])
        for inputs in made:  # the training thread steps over features already made, the producer thread idle
            t0 = time.perf_counter()
            losses["drafter"].append(loops["drafter"](inputs))
            times["drafter"].append(time.perf_counter() - t0)
        del made
        run("unpipelined", first, stop, 0)  # the target, then the drafter, both on the training thread
        run("pipelined", first, stop, 1)  # the target in the producer thread, one step ahead of the drafter
        for name in kept:
            kept[name] += times[name][-per_round + 2 :] if name != "drafter" else times[name][mark + 2 :]
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    t, d, serial, piped = (statistics.median(kept[name]) for name in ("target", "drafter", "unpipelined", "pipelined"))
    ratio, floor = piped / (t + d), max(t, d) / (t + d)
    report = {
        "preset": args.preset, "device": str(device), "attention": attention, "peak_memory_gib_three_drafters": peak_gib,
        "load_1min_before": load, "load_1min_after": os.getloadavg()[0], "torch_threads": torch.get_num_threads(),
        "seq_len": args.seq_len, "hidden": args.hidden, "target_layers": layers, "drafter_layers": args.drafter_layers,
        "anchors": args.anchors, "block_size": args.block_size, "steps": per_round * args.rounds, "rounds": args.rounds,
        "target_forward_s": t, "drafter_step_s": d, "balance": t / d, "unpipelined_step_s": serial, "pipelined_step_s": piped,
        "unpipelined_ratio": serial / (t + d), "pipeline_ratio": ratio, "pipeline_floor": floor,
        "pipelined_over_unpipelined": piped / serial,
        "losses_bit_equal": losses["drafter"] == losses["unpipelined"] == losses["pipelined"],
    }
    print(json.dumps(report))
    print(f"target forward {t * 1e3:.1f} ms, drafter step {d * 1e3:.1f} ms, each alone on its own thread "
          f"(balance {report['balance']:.2f}); unpipelined step {serial * 1e3:.1f} ms, pipelined {piped * 1e3:.1f} ms")
    print(f"losses over {report['steps']} steps bit-equal (alone, unpipelined, pipelined): {report['losses_bit_equal']}")
    print(f"pipeline ratio = {ratio:.3f} (floor max(t, d) / (t + d) = {floor:.3f})")


if __name__ == "__main__":
    main()
