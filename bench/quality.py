"""Which training objective makes the better drafter for the same work: tau on held-out prompts, paired by seed.

Each objective trains the same drafter shape on the same tokenized rows with the same seeds, rows per step, steps and
lr, through `blockdraft train`; each drafter is then measured by `blockdraft eval` on the fixture's held-out prompts
(prompts.jsonl: conversations the target never trained on). Objectives:

- `ce`: the paper's recipe (hard-label CE, exponential slot decay, PyTorch's default init): the baseline;
- `distill`: soft targets, `train.distill_weight` (--distill-weight, default 0.5) at temperature 1;
- `dpace`: `dflash.loss_weighting = "dpace"` (D-PACE weights, alpha 0.5);
- `hf_normal`: `train.init = "hf_normal"` (normal(0, the target's initializer_range));
- `dflash2`: the DFlash2 drafter (`dflash.architecture = "dflash2"`, selector rank 64, top-K 16, alpha 1, a gold token
  outside the top-K injected into the selector's loss); `dflash2_skip`: the same, with no selector loss for such a slot;
- `ce_wall`: the DFlash baseline again, at DFlash2's wall time: its steps are the fixture's times the ratio of DFlash2's
  median step time to DFlash's, measured on this run's equal-step runs (so it runs after them);
- `packed`: the baseline with `train.packing` (the target computes each step's four rows without padding: one by one
  on SDPA, in one packed forward on flash attention); `packed_wall`: the same at the baseline's wall time (its steps:
  the fixture's times the ratio of ce's median step time to packed's).

Fixtures: `tiny` (8-layer Qwen3, one-layer B = 8 drafter), `hybrid` (Qwen3.5-style linear attention, a drafter of one
sliding-window and one full-attention layer) and `real` (SmolLM2-135M-Instruct from `make real-target`, a two-layer
B = 8 drafter, trained on the target's answers to the shipped prompt set, which `blockdraft demo --target real`
regenerates: `--real-completions`, and measured on its 43 held-out prompts).

Per fixture and objective it prints tau's mean and sd over the seeds and
the paired difference against `ce` (mean and sd of tau(objective, seed) - tau(ce, seed), and the mean as a share of ce's
mean tau); an objective may become a default only where that share is >= 3% on both tiny fixtures. Every run is checked
lossless.

    .venv/bin/python -m bench.quality                 # full size: 5 seeds, both fixtures, 2 workers
                                                      # (about 15 min on 2 cores)
    .venv/bin/python -m bench.quality --quick         # 1 seed, a few steps: checks that it runs, not the figures
    .venv/bin/python -m bench.quality --fixtures tiny --objectives ce,distill --seeds 3 --out runs.jsonl
    .venv/bin/python -m bench.quality --dflash2       # DFlash2 against DFlash: equal steps and equal wall time,
                                                      # both rules
    .venv/bin/python -m bench.quality --packing --fixtures tiny --seeds 3 --workers 1   # packed against padded rows
    .venv/bin/python -m bench.quality --dflash2 --fixtures real --objectives ce,dflash2,ce_wall --seeds 3 \
        --prompts 43 --temperature 0.6 --real-completions demo-work-real/store/completions   # after make demo-real
    .venv/bin/python -m bench.quality --dflash2 --fixtures real --objectives ce,dflash2,ce_wall --seeds 3 --steps 200 \
        --prompts 43 --max-new-tokens 16 --temperature 0.6 --target-dtype bfloat16 --eval-dtype float32 \
        --real-completions demo-work-real/store/completions --results runs.jsonl   # the real-target table in
                                                      # docs/PERFORMANCE.md (about 2 h 10 min); rerun to go on

With `--dflash2` it also prints the architecture table: per fixture the walk's tau (for DFlash the argmax's: it has no
walk), the unary argmax's tau of the same DFlash2 drafter on the same prompts, acceptance per draft position, candidate
recall over the last training steps, the median training step time and the drafter's parameter count; with
`--temperature T` also tau at T (top-p 0.95, top-k 20, the default engine rule) and n-gram's tau greedy and at T.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any, cast

# DFlash names its architecture: `dflash.architecture` defaults to DFlash2.
DFLASH = {"dflash": {"architecture": "dflash"}}
OBJECTIVES: dict[str, dict[str, dict[str, Any]]] = {
    "ce": DFLASH,
    "distill": {**DFLASH, "train": {"distill_weight": 0.5}},
    "dpace": {"dflash": {"architecture": "dflash", "loss_weighting": "dpace"}},
    "hf_normal": {**DFLASH, "train": {"init": "hf_normal"}},
    "dflash2": {"dflash": {"architecture": "dflash2", "selector_rank": 64, "selector_top_k": 16,
                           "selector_missing_gold": "inject"}},
    "dflash2_skip": {"dflash": {"architecture": "dflash2", "selector_rank": 64, "selector_top_k": 16,
                                "selector_missing_gold": "skip"}},
    "ce_wall": DFLASH,
    "packed": {**DFLASH, "train": {"packing": True}},
    "packed_wall": {**DFLASH, "train": {"packing": True}},
}
DFLASH2_OBJECTIVES = "ce,dflash2,dflash2_skip,ce_wall"
PACKING_OBJECTIVES = "ce,packed,packed_wall"
# Objectives trained after the others, at another's wall time: (its steps follow the step time of, relative to).
WALL = {"ce_wall": ("dflash2", "ce"), "packed_wall": ("ce", "packed")}
RECENT = 20  # training steps whose recall is averaged
# (drafter settings, training steps at full size): both at B = 8 with 32 anchors per row (`--anchors`) and 4 rows per
# step.
FIXTURES: dict[str, tuple[dict[str, Any], int]] = {
    "tiny": ({"num_draft_layers": 1}, 240),
    "hybrid": ({"num_draft_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32},
               120),
    "real": ({"num_draft_layers": 2}, 150),
}
THRESHOLD = 0.03  # the gain over ce, as a share of ce's mean tau, that makes an objective a default candidate


def fixture_dir(name: str) -> Path:
    """The fixture's target folder (the real one as `make real-target` made it: `main` verifies it once)."""
    from blockdraft.fixtures.hybrid import TINY_HYBRID_TARGET_DIR
    from blockdraft.fixtures.smollm2 import real_target_dir
    from blockdraft.fixtures.tiny import TINY_TARGET_DIR

    return {"tiny": TINY_TARGET_DIR, "hybrid": TINY_HYBRID_TARGET_DIR, "real": real_target_dir()}[name]


def mask_token_id(fixture: str) -> int:
    from blockdraft.pipeline import DemoTarget, mask_token_id_of

    return mask_token_id_of(cast(DemoTarget, fixture), fixture_dir(fixture))


def held_out_prompts(fixture: str) -> str:
    """Prompts absent from the training rows, as the demo measures them."""
    from blockdraft.pipeline import DemoTarget, prompt_files

    return str(prompt_files(cast(DemoTarget, fixture), fixture_dir(fixture))[1])


def base_settings(fixture: str, store: Path) -> dict[str, Any]:
    return {"target": {"path": str(fixture_dir(fixture))}, "store": {"url": str(store)},
            "tokenize": {"held_out_fraction": 0.0, "max_length": 1024}}


def tokenize(fixture: str, work: Path, real_completions: str) -> str:
    """The target's answers tokenized once (a tiny fixture's own completions, or the real target's regenerated ones at
    `real_completions`); every run trains on these rows."""
    from blockdraft.config import load_config
    from blockdraft.stages import tokenize as tokenize_stage

    out = work / f"{fixture}-tokenized"
    source = real_completions if fixture == "real" else str(fixture_dir(fixture) / "completions.jsonl")
    tokenize_stage.run(load_config(None, base_settings(fixture, work / "store")), source, str(out))
    return str(out)


def merged(*parts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for section, values in part.items():
            out.setdefault(section, {}).update(values)
    return out


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train one drafter (fixture, objective, seed) and evaluate it; runs in a worker process with one torch thread."""
    import torch

    from blockdraft.config import load_config
    from blockdraft.stages import eval as eval_stage
    from blockdraft.stages import train as train_stage
    from blockdraft.stages.eval.report import UNARY_NAME

    torch.set_num_threads(1)
    fixture, objective, seed, work = job["fixture"], job["objective"], job["seed"], Path(job["work"])
    name = f"{fixture}-{objective}-s{seed}"
    drafter, _ = FIXTURES[fixture]
    sampling = {"temperature": job["temperature"], "top_p": 0.95, "top_k": 20} if job["temperature"] > 0 else {}
    settings = merged(
        base_settings(fixture, work / name / "store"),
        {"target": {"dtype": job["target_dtype"]}} if job["target_dtype"] else {},
        {
            "dflash": {"block_size": 8, "mask_token_id": mask_token_id(fixture), "num_anchors": job["anchors"],
                       **drafter},
            "train": {"data": job["data"], "output": str(work / name / "run"), "log_dir": str(work / name / "logs"),
                      "max_steps": job["steps"], "batch_size": 4, "global_batch_size": 4, "lr": 3e-3,
                      "warmup_ratio": 0.05, "checkpoint_every": job["steps"], "seed": seed},
            "eval": {"num_prompts": job["prompts"], "untrained_baseline": False, **sampling},
        },
        OBJECTIVES[objective],
        {"train": {"distill_weight": job["distill_weight"]}} if objective == "distill" else {},
    )
    cfg = load_config(None, settings)
    t0 = time.perf_counter()
    trained = train_stage.run(cfg).details
    t1 = time.perf_counter()
    if job["eval_dtype"]:  # eval's target in its own dtype (a bfloat16 decode is slower than float32 on a CPU)
        cfg = load_config(None, merged(settings, {"target": {"dtype": job["eval_dtype"]}}))
    report = eval_stage.run(cfg, str(work / name / "run"), prompts=held_out_prompts(fixture),
                            max_new_tokens=job["max_new_tokens"]).details
    drafted = report.drafters["dflash"]
    recent = trained.metrics[-RECENT:]
    out = {
        "fixture": fixture, "objective": objective, "seed": seed, "steps": job["steps"],
        "padding_share": statistics.fmean(e["padding_share"] for e in trained.metrics),
        "supervised_per_step": statistics.fmean(e["supervised"] for e in trained.metrics),
        "supervised_per_s": statistics.median(e["supervised_tokens_per_s"] for e in trained.metrics[1:]
                                              or trained.metrics),
        "tau": drafted.tau, "tau_ngram": report.drafters["ngram"].tau, "lossless": report.lossless.ok,
        "position_acceptance": drafted.position_acceptance,
        "final_loss": trained.metrics[-1]["loss"], "tau_estimate": trained.metrics[-1]["tau_estimate"],
        "step_ms": 1000 * statistics.median(e["step_time_s"] for e in trained.metrics[1:] or trained.metrics),
        "params": sum(p.numel() for p in trained.drafter.parameters()),
        "train_s": round(t1 - t0, 1), "eval_s": round(time.perf_counter() - t1, 1),
    }
    if report.sampled is not None:
        out.update(tau_sampled=report.sampled.drafters["dflash"].metrics.tau,
                   tau_ngram_sampled=report.sampled.drafters["ngram"].metrics.tau)
    if "candidate_recall" in recent[-1]:
        out.update(candidate_recall=statistics.fmean(e["candidate_recall"] for e in recent),
                   walk_tau_estimate=trained.metrics[-1]["walk_tau_estimate"])
        argmax = report.drafters.get(UNARY_NAME)
        if argmax is not None:
            out.update(tau_argmax=argmax.tau, position_acceptance_argmax=argmax.position_acceptance)
    return out


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fixture and objective: tau mean and sd over seeds, and the paired difference against ce on the same seeds."""
    rows = []
    for fixture in dict.fromkeys(r["fixture"] for r in results):
        by = {(r["objective"], r["seed"]): r["tau"] for r in results if r["fixture"] == fixture}
        base = {seed: tau for (objective, seed), tau in by.items() if objective == "ce"}
        for objective in dict.fromkeys(o for o, _ in by):
            taus = [tau for (o, _), tau in sorted(by.items()) if o == objective]
            diffs = [by[objective, seed] - base[seed] for seed in sorted(base) if (objective, seed) in by]
            ce_mean = statistics.fmean(base.values()) if base else float("nan")
            row = {"fixture": fixture, "objective": objective, "seeds": len(taus), "tau_mean": statistics.fmean(taus),
                   "tau_sd": statistics.stdev(taus) if len(taus) > 1 else 0.0}
            if diffs and objective != "ce":
                gain = statistics.fmean(diffs) / ce_mean
                row.update(diff_mean=statistics.fmean(diffs),
                           diff_sd=statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                           gain=gain, wins=sum(d > 0 for d in diffs), meets_threshold=gain >= THRESHOLD)
            rows.append(row)
    return rows


def table(summary: list[dict[str, Any]]) -> str:
    lines = ["| fixture | objective | seeds | tau mean | tau sd | paired diff vs ce (mean +- sd) | gain | seeds better "
             "|",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary:
        paired = f"{r['diff_mean']:+.3f} +- {r['diff_sd']:.3f}" if "diff_mean" in r else "-"
        gain = f"{100 * r['gain']:+.1f}%" if "gain" in r else "-"
        wins = f"{r['wins']}/{r['seeds']}" if "wins" in r else "-"
        lines.append(f"| {r['fixture']} | {r['objective']} | {r['seeds']} | {r['tau_mean']:.3f} | {r['tau_sd']:.3f} | "
                     f"{paired} | {gain} | {wins} |")
    return "\n".join(lines)


def wall_steps(results: list[dict[str, Any]], fixture: str, steps: int, objective: str = "ce_wall") -> int:
    """The steps of a wall-time objective (`WALL`) on `fixture`: `steps` times the median over seeds of the ratio of
    the median step time of the objective whose wall time it takes to that of the one it repeats (ce_wall: DFlash at
    DFlash2's wall time). A seed's two runs start together, so the ratio within a seed compares steps made under much
    the same load, and the median of those ratios is not moved by one pair that met other load on a shared machine."""
    paced, base = WALL[objective]
    ms = {(r["objective"], r["seed"]): r["step_ms"] for r in results if r["fixture"] == fixture}
    ratios = [ms[paced, seed] / ms[base, seed] for (o, seed) in ms if o == base and (paced, seed) in ms]
    return round(steps * statistics.median(ratios))


def packing_table(results: list[dict[str, Any]]) -> str:
    """Packed against padded rows per fixture: steps, mean padding share, supervised slots per step and per second
    (median step), ms per step, tau greedy (and at T), each tau's paired gain over ce on the same seeds."""
    names = {"ce": "padded", "packed": "packed, equal steps", "packed_wall": "packed, equal wall time"}
    lines = ["| fixture | rows | steps | padding share | supervised per step | supervised per s | ms/step | "
             "tau mean +- sd | vs padded | tau at T | vs padded at T |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for fixture in dict.fromkeys(r["fixture"] for r in results):
        runs = {(r["objective"], r["seed"]): r for r in results if r["fixture"] == fixture}
        for objective in (o for o in names if any(k[0] == o for k in runs)):
            rs = [r for (o, _), r in sorted(runs.items()) if o == objective]
            taus = [r["tau"] for r in rs]
            sd = statistics.stdev(taus) if len(taus) > 1 else 0.0
            at_t, gain_t = "-", "-"
            if all("tau_sampled" in r for r in rs):
                at_t = f"{statistics.fmean(r['tau_sampled'] for r in rs):.3f}"
                diffs = [r["tau_sampled"] - runs["ce", r["seed"]]["tau_sampled"] for r in rs]
                gain_t = "-" if objective == "ce" else f"{statistics.fmean(diffs):+.3f}"
            lines.append(
                f"| {fixture} | {names[objective]} | {rs[0]['steps']} | "
                f"{statistics.fmean(r['padding_share'] for r in rs):.3f} | "
                f"{statistics.fmean(r['supervised_per_step'] for r in rs):.0f} | "
                f"{statistics.median(r['supervised_per_s'] for r in rs):,.0f} | "
                f"{statistics.median(r['step_ms'] for r in rs):.1f} | {statistics.fmean(taus):.3f} +- {sd:.3f} | "
                f"{paired_gain(runs, objective, 'ce')} | {at_t} | {gain_t} |"
            )
    return "\n".join(lines)


def paired_gain(runs: dict[tuple[str, int], dict[str, Any]], objective: str, base: str) -> str:
    """The mean paired difference of tau against `base` on the same seeds, as a share of base's mean, and the seeds
    won."""
    rs = [r for (o, _), r in sorted(runs.items()) if o == objective and (base, r["seed"]) in runs]
    if objective in ("ce", "ce_wall", base) or not rs:
        return "-"
    diffs = [r["tau"] - runs[base, r["seed"]]["tau"] for r in rs]
    share = statistics.fmean(diffs) / statistics.fmean(runs[base, r["seed"]]["tau"] for r in rs)
    return f"{100 * share:+.1f}% ({sum(d > 0 for d in diffs)}/{len(diffs)})"


def arch_table(results: list[dict[str, Any]]) -> str:
    """DFlash2 against DFlash per fixture: mean over seeds of each figure, and the paired gain of tau over each
    baseline."""
    names = {"ce": "DFlash, equal steps", "ce_wall": "DFlash, equal wall time", "dflash2": "DFlash2 (inject)",
             "dflash2_skip": "DFlash2 (skip)"}
    lines = ["| fixture | drafter | steps | tau (walk) mean +- sd | vs DFlash equal steps | vs DFlash equal wall | tau "
             "(argmax) | tau at T mean +- sd | n-gram greedy / at T | acceptance per position | candidate recall | "
             "ms/step | params |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for fixture in dict.fromkeys(r["fixture"] for r in results):
        runs = {(r["objective"], r["seed"]): r for r in results if r["fixture"] == fixture}
        for objective in (o for o in names if any(k[0] == o for k in runs)):
            rs = [r for (o, _), r in sorted(runs.items()) if o == objective]
            taus = [r["tau"] for r in rs]
            gain = partial(paired_gain, runs, objective)

            acc = [statistics.fmean(col) for col in zip(*(r["position_acceptance"] for r in rs), strict=True)]
            argmax = (
                f"{statistics.fmean(r['tau_argmax'] for r in rs):.3f}" if all("tau_argmax" in r for r in rs) else "-"
            )
            recall = (
                f"{statistics.fmean(r['candidate_recall'] for r in rs):.3f}"
                if all("candidate_recall" in r for r in rs)
                else "-"
            )
            sd = statistics.stdev(taus) if len(taus) > 1 else 0.0
            sampled, ngram = "-", f"{statistics.fmean(r['tau_ngram'] for r in rs):.3f}"
            if all("tau_sampled" in r for r in rs):
                at_t = [r["tau_sampled"] for r in rs]
                sampled = f"{statistics.fmean(at_t):.3f} +- {statistics.stdev(at_t) if len(at_t) > 1 else 0.0:.3f}"
                ngram += f" / {statistics.fmean(r['tau_ngram_sampled'] for r in rs):.3f}"
            lines.append(
                f"| {fixture} | {names[objective]} | {rs[0]['steps']} | {statistics.fmean(taus):.3f} +- {sd:.3f} | "
                f"{gain('ce')} | {gain('ce_wall')} | {argmax} | {sampled} | {ngram} | "
                f"{' '.join(f'{a:.2f}' for a in acc)} | {recall} | "
                f"{statistics.median(r['step_ms'] for r in rs):.1f} | {rs[0]['params']:,} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", default="tiny,hybrid")
    parser.add_argument("--objectives", help="comma-separated (default: ce,distill,dpace,hf_normal, or the preset of "
                                             "--dflash2 / --packing)")
    parser.add_argument("--dflash2", action="store_true", help="DFlash2 against DFlash: --objectives "
                                                               f"{DFLASH2_OBJECTIVES} unless given")
    parser.add_argument("--packing", action="store_true", help="packed against padded rows: --objectives "
                                                               f"{PACKING_OBJECTIVES} unless given")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, help="training steps for every fixture (default: each fixture's, see "
                                                  "FIXTURES)")
    parser.add_argument("--step-scale", type=float, default=1.0, help="each fixture's own steps times this (without "
                                                                      "--steps)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts per eval")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--distill-weight", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=0.0, help="also measure tau at this temperature (top-p "
                                                                       "0.95, top-k 20); 0: greedy only")
    parser.add_argument("--real-completions", default="demo-work-real/store/completions",
                        help="the real target's regenerated answers (a completions artifact), for --fixtures real")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel, one torch thread each")
    parser.add_argument("--anchors", type=int, default=32,
                        help="dflash.num_anchors for every run (fewer: a cheaper drafter step beside the target)")
    parser.add_argument("--target-dtype", choices=["float32", "bfloat16"], help="target.dtype for every run (default: "
                                                                               "the target config's)")
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], help="target.dtype for every eval (default: "
                                                                             "--target-dtype's)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 12 steps, 2 prompts x 24 tokens: a check that it "
                                                             "runs")
    parser.add_argument("--out", help="also write every run's figures to this JSONL file")
    parser.add_argument("--results", help="a JSONL file each run's figures are appended to as it ends; runs already "
                                          "in it (same fixture, objective, seed and steps) are taken from it, not run "
                                          "again, so a stopped bench goes on where it stopped")
    parser.add_argument("--work", help="keep every run's data, checkpoints and logs in this new folder (default: a "
                                       "temporary one, removed at the end)")
    args = parser.parse_args()
    fixtures, objectives = (
        args.fixtures.split(","),
        (args.objectives or (DFLASH2_OBJECTIVES if args.dflash2 else PACKING_OBJECTIVES if args.packing
                             else "ce,distill,dpace,hf_normal")).split(","),
    )
    unknown = [x for x in fixtures if x not in FIXTURES] + [x for x in objectives if x not in OBJECTIVES]
    if unknown or "ce" not in objectives:
        parser.error(f"unknown fixture or objective {unknown}" if unknown else "--objectives must include ce (the "
                                                                               "baseline)")
    for wall, (paced, base) in WALL.items():
        if wall in objectives and not {paced, base} <= set(objectives):
            parser.error(f"{wall} needs {paced} and {base} (its steps follow their step times)")
    seeds, prompts, new_tokens = (1, 2, 24) if args.quick else (args.seeds, args.prompts, args.max_new_tokens)
    started = time.perf_counter()
    if "real" in fixtures:
        from blockdraft.fixtures.smollm2 import stamp_problem

        if (problem := stamp_problem(fixture_dir("real"))) is not None:
            parser.error(f"the real target at {fixture_dir('real')} is not verified ({problem}): run `make "
                         "real-target` first")
    if args.work and Path(args.work).exists():
        parser.error(f"--work {args.work} exists: give a new folder (an earlier bench's runs there would stop train)")
    if args.work:
        Path(args.work).mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="blockdraft-quality-") as tmp:
        work = Path(args.work or tmp).absolute()
        data = {fixture: tokenize(fixture, work, args.real_completions) for fixture in fixtures}
        steps = {
            fixture: 12 if args.quick else args.steps or round(FIXTURES[fixture][1] * args.step_scale)
            for fixture in fixtures
        }

        def job(fixture: str, objective: str, seed: int, n: int) -> dict[str, Any]:
            return {"fixture": fixture, "objective": objective, "seed": seed, "work": str(work), "data": data[fixture],
                    "steps": n, "prompts": prompts, "max_new_tokens": new_tokens, "distill_weight": args.distill_weight,
                    "temperature": args.temperature, "target_dtype": args.target_dtype,
                    "eval_dtype": args.eval_dtype,
                    "anchors": args.anchors}

        results: list[dict[str, Any]] = []
        done = ([json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
                if args.results and Path(args.results).is_file() else [])

        def key(run: dict[str, Any]) -> tuple[Any, ...]:
            return run["fixture"], run["objective"], run["seed"], run["steps"]

        def run_all(jobs: list[dict[str, Any]]) -> None:
            """Each job's figures: from --results when it holds them, else run (and appended there)."""
            found = {key(r): r for r in done}
            results.extend(found[key(j)] for j in jobs if key(j) in found)
            for result in pool.map(run_one, [j for j in jobs if key(j) not in found]):
                results.append(result)
                print(json.dumps(result), flush=True)
                if args.results:
                    with open(args.results, "a") as out:
                        out.write(json.dumps(result) + "\n")

        with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
            run_all([
                job(f, o, seed, steps[f])
                for f in fixtures
                for seed in range(seeds)
                for o in objectives
                if o not in WALL
            ])
            for objective in (o for o in objectives if o in WALL):  # again, at another objective's wall time
                base = WALL[objective][1]
                wall = [job(f, objective, seed, wall_steps(results, f, steps[f], objective)) for f in fixtures
                        for seed in range(seeds)]
                # Where both step times are equal, the equal-step runs are the equal-wall ones: the same settings, so
                # they are not trained again.
                same = [j for j in wall if j["steps"] == steps[j["fixture"]]]
                for j in same:
                    again = next(r for r in results if (r["fixture"], r["objective"], r["seed"]) == (j["fixture"], base,
                                                                                                      j["seed"]))
                    results.append({**again, "objective": objective})
                run_all([j for j in wall if j not in same])
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    summary = summarise(results)
    print(table(summary))
    if "dflash2" in objectives:
        print(arch_table(results))
    if "packed" in objectives:
        print(packing_table(results))
    print(f"{len(results)} runs in {time.perf_counter() - started:.0f} s; all lossless: "
          f"{all(r['lossless'] for r in results)}")
    for r in summary:
        if "gain" in r:
            verdict = "meets" if r["meets_threshold"] else "does not meet"
            print(f"{r['fixture']} {r['objective']}: {100 * r['gain']:+.1f}% mean tau over ce, {verdict} the "
                  f"{100 * THRESHOLD:.0f}% bar")


if __name__ == "__main__":
    main()
