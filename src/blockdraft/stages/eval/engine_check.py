"""`eval --engine`: the export served by the engine, once with the drafter and once target-only, on the prompts our own
decode just ran; the engine's acceptance compared with ours.

Agreement rule: equal drafts and tokens accepted at every draft position agree ("exact"); otherwise each position's
acceptance rate and tau must be within `eval.engine_tolerance_fp32` when both sides ran in float32,
`eval.engine_tolerance` below it. Float32 is not always exact: the engine's drafter kernels round differently from ours,
so a near-tie in the drafter's logits can flip one draft (measured in docs/PERFORMANCE.md, "engine"), and in bf16
near-ties in the target's logits flip too; `FLIPS` flipped drafts are allowed on top of the tolerance, which matters on
a few prompts only. An export that differs from its checkpoint moves the figures by far more. The engine's outputs with
the drafter must equal its own target-only outputs (lossless in the engine), whatever the precision. An engine that
reports no per-position counts (SGLang without its acceptance histogram) is held to tau alone, within the same
tolerance.

At temperature > 0 (`eval.temperature`), both sides sample, each decode with its own seed (ours `eval.seed + i`, and the
same number on the engine's request i), so their counts differ by chance and the rule is statistical: each position's
acceptance rate (pooled two-proportion z-test) and tau (two-sample z-test on the committed tokens per cycle) must differ
by less than z standard errors, z the normal quantile at 1 - alpha / (2 B) (`eval.engine_alpha` shared by the B - 1
positions and tau, Bonferroni). Cycles of one decode are not independent trials (they share a prompt and a history), so
each standard error is widened by the design effect measured on our decodes (`design_effects`): on the demo's drafter
at T 0.6 it was 2 to 7, and a binomial interval failed engines that agreed with our per-decode intervals. The engine's
outputs are not compared with its target-only outputs there: sampled outputs differ by chance; that speculative sampling
keeps the target's distribution is what `tests/test_sampling_rules.py` checks of our loop, under every draft rule.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

from blockdraft.config import EvalConfig
from blockdraft.decode.sampling import Sampling
from blockdraft.errors import EngineError
from blockdraft.model.drafter import CONFIG_NAME, WEIGHTS_NAME
from blockdraft.model.formats import SERVING_NAME
from blockdraft.model.spec import ARCHITECTURE_NAMES, DFLASH, DFLASH2
from blockdraft.reporter import Reporter
from blockdraft.stages.eval.engine import (
    EXPAND_FIX,
    ServedRun,
    cuda_here,
    engine_python,
    free_argv,
    free_port,
    generate,
    has_expand_fix,
    serving_together,
)
from blockdraft.stages.eval.engine_sglang import generate_sglang, sglang_argv, sglang_spec, sglang_version
from blockdraft.stages.eval.report import EngineCheck, EvalReport

FLIPS = 2  # drafts that a near-tie may flip between the engine's kernels and ours, on top of the tolerance


def require_export(cfg: EvalConfig, export: str | None) -> Path:
    """The export folder to serve, checked before any decoding: EngineError when it or the engine is missing."""
    python = engine_python(cfg)
    if cfg.temperature > 0:
        refuse_proposal(cfg)
        if cfg.engine == "vllm" and not cuda_here() and not has_expand_fix(python):
            raise EngineError(f"eval.temperature {cfg.temperature:g}: the vLLM at {python} verifies drafts at "
                              f"temperature with uninitialised settings on the CPU ({EXPAND_FIX}, fixed in PR 55006); "
                              "`make engine` patches it, or run the engine check greedy (eval.temperature = 0)")
    if export is None:
        raise EngineError(f"eval.engine {cfg.engine} needs the checkpoint's export: pass --export DIR (the CLI makes "
                          "one when omitted)")
    folder = Path(export.removeprefix("file://"))
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME, SERVING_NAME) if not (folder / name).is_file()]
    if missing:
        raise EngineError(
            f"--export {export} has no {', '.join(missing)}; pass a folder that `blockdraft export` wrote"
        )
    architectures = json.loads((folder / CONFIG_NAME).read_text()).get("architectures") or []
    refuse_unservable(cfg, DFLASH2 if ARCHITECTURE_NAMES[DFLASH2] in architectures else DFLASH)
    return folder


def refuse_proposal(cfg: EvalConfig) -> None:
    """EngineError when the engine checked at temperature does not serve `eval.proposal`'s draft rule."""
    serves = {"vllm": ("vllm", "vllm-probabilistic"), "sglang": ("sglang",)}[cfg.engine]
    if cfg.proposal not in serves:
        raise EngineError(f"eval.proposal {cfg.proposal} is not a draft rule {cfg.engine} serves; set eval.proposal to "
                          f"{' or '.join(serves)} (--proposal) to check {cfg.engine} at temperature")


def refuse_unservable(cfg: EvalConfig, architecture: str) -> None:
    """EngineError when `cfg.engine` cannot serve a drafter of `architecture` on this machine: vLLM 0.32 serves DFlash2
    only on its V2 model runner, whose candidate walk is a Triton kernel, so not on the CPU (its V1 runner refuses
    it)."""
    if cfg.engine == "vllm" and architecture == DFLASH2 and not cuda_here():
        raise EngineError(
            "vLLM 0.32 serves a DFlash2 drafter only on its V2 model runner (the candidate walk is a Triton kernel, "
            "GPU only) and this machine has no CUDA device; run `eval --engine vllm` on a GPU machine, or eval "
            "without --engine"
        )


def check_in_engine(cfg: EvalConfig, export: Path, target: str, prompts: Sequence[Sequence[int]], report: EvalReport,
                    workdir: Path, reporter: Reporter) -> EngineCheck:
    """Serve `export` beside `target` with the drafter and target-only, and compare with `report` (our decode)."""
    serving_json = json.loads((export / SERVING_NAME).read_text())
    dtype = str(serving_json.get("dtype") or report.target_dtype)
    positions = report.block_size - 1
    max_len = max(len(p) for p in prompts) + report.max_new_tokens + report.block_size + 16
    python = engine_python(cfg)
    sglang = cfg.engine == "sglang"
    sampled = report.sampled
    sampling = Sampling(sampled.temperature, sampled.top_p, sampled.top_k) if sampled is not None else None
    if sampled is not None:
        if sglang:
            raise EngineError("eval.engine sglang is checked greedy only in this version; set eval.temperature = 0 or "
                              "use --engine vllm")
        prompts = [p for p in prompts for _ in range(sampled.samples_per_prompt)]  # request i: prompt i // S, seed + i
    spec: Any = (sglang_spec(serving_json, export) if sglang
                 else {**serving_json["vllm_speculative_config"], "model": str(export.absolute())})
    if sampled is not None and not sglang:  # vLLM proposes by its draft_sample_method: the rule our decode ran
        spec["draft_sample_method"] = "probabilistic" if sampled.proposal == "vllm-probabilistic" else "greedy"
    version = sglang_version(python) if sglang else ""
    argvs: dict[str, list[str]] = {}
    for name, drafter in (("drafter", spec), ("target-only", None)):
        if sglang:
            argvs[name] = sglang_argv(python, target, free_port(), dtype, max_len, drafter, cfg.engine_args)
        else:
            argvs[name] = free_argv(python, cfg.engine, target, dtype, max_len, drafter, cfg.engine_args)
    # Without CUDA both servers start side by side (each start is mostly one core's work); on a GPU one after the
    # other, as each server takes the device's memory for its KV cache.
    together = [list(argvs)] if not cuda_here() else [[name] for name in argvs]
    runs: dict[str, ServedRun] = {}
    for names in together:
        for name in names:
            reporter.say(f"engine: starting {cfg.engine} {name} ({dtype})")
        with serving_together({name: argvs[name] for name in names}, workdir, cfg) as servers:
            for name, server in servers.items():
                reporter.say(f"engine: serving {len(prompts)} prompts {name}")
                args = (server, prompts, report.max_new_tokens, report.stop_token_ids, positions, reporter,
                        f"engine {name}")
                if sglang:
                    runs[name] = generate_sglang(*args, version)
                else:
                    runs[name] = generate(*args, sampling=sampling, seed=sampled.seed if sampled is not None else 0)
    reporter.say("engine: comparing with our decode")
    return compare(cfg, runs["drafter"], runs["target-only"], report, dtype)


def ours(report: EvalReport) -> tuple[int, list[int]]:
    """(cycles, tokens accepted at each draft position) of our decode of the dflash drafter, counted as the engine
    counts them."""
    lengths = [n for decode in _our_decodes(report) for n in decode]
    return len(lengths), [sum(1 for n in lengths if n - 1 >= k) for k in range(1, report.block_size)]


def _our_decodes(report: EvalReport) -> list[list[int]]:
    """a + 1 of every cycle of each dflash decode the engine is compared with (the sampled ones at temperature > 0), as
    the engine counts them: our loop runs one more cycle when its anchor is already the `max_new_tokens`-th new token
    (its output is cut to the limit), a step the engine never schedules, so such a cycle is left out."""
    if report.sampled is not None:
        decodes = report.sampled.drafters["dflash"].acceptance_lengths
    else:
        decodes = [getattr(row, "acceptance_lengths_dflash", None) or [] for row in report.prompts]
    counted: list[list[int]] = []
    for decode in decodes:
        kept, produced = [], 1  # the prefill's token
        for n in decode:
            if produced >= report.max_new_tokens:
                break
            kept.append(n)
            produced += n
        counted.append(kept)
    return counted


def design_effects(decodes: Sequence[Sequence[int]], positions: int) -> list[float]:
    """How much wider than a binomial's the sampling variance of each draft position's acceptance rate, and last of tau,
    is across `decodes` (each a list of a + 1 per cycle): cycles of one decode share its prompt and its history, so they
    are not independent trials. Each figure is the ratio estimator's variance over decodes (as in the report's
    intervals) divided by the variance the cycles would give as independent trials, at least 1; 1 with fewer than two
    decodes, where no spread between decodes can be measured."""
    decodes = [d for d in decodes if d]
    effects = [1.0] * (positions + 1)
    n = len(decodes)
    cycles = [len(d) for d in decodes]
    total = sum(cycles)
    if n < 2 or total == 0:
        return effects
    series = [[[1.0 if a - 1 >= k else 0.0 for a in d] for d in decodes] for k in range(1, positions + 1)]
    series.append([[float(a) for a in d] for d in decodes])
    for j, values in enumerate(series):
        sums = [sum(v) for v in values]
        r = sum(sums) / total
        between = sum((y - r * x) ** 2 for y, x in zip(sums, cycles)) / (n * (n - 1)) / (total / n) ** 2
        within = sum((a - r) ** 2 for v in values for a in v) / (total - 1) / total if total > 1 else 0.0
        effects[j] = max(1.0, between / within) if within > 0 else 1.0
    return effects


def compare(cfg: EvalConfig, with_drafter: ServedRun, target_only: ServedRun, report: EvalReport,
            dtype: str) -> EngineCheck:
    cycles, accepted = ours(report)
    if report.sampled is not None:
        return _compare_sampled(cfg, with_drafter, target_only, report, dtype, cycles, accepted)
    float32 = dtype == "float32" and report.target_dtype == "float32"
    tolerance = cfg.engine_tolerance_fp32 if float32 else cfg.engine_tolerance
    per_position = bool(with_drafter.accepted_per_position)
    exact = per_position and with_drafter.drafts == cycles and with_drafter.accepted_per_position == accepted
    within = f"within {tolerance:g} ({'float32' if float32 else 'below float32'})"
    new_tokens = sum(len(o) for o in with_drafter.outputs)
    check = EngineCheck(
        engine=cfg.engine,
        version=with_drafter.version,
        dtype=dtype,
        drafts=with_drafter.drafts,
        accepted_per_position=with_drafter.accepted_per_position,
        tau=_tau(with_drafter.drafts, [with_drafter.accepted]),
        outputs_equal_target_only=sum(a == b for a, b in zip(with_drafter.outputs, target_only.outputs)),
        num_prompts=len(with_drafter.outputs),
        tokens_per_s=new_tokens / with_drafter.seconds if with_drafter.seconds else 0.0,
        target_only_tokens_per_s=(sum(len(o) for o in target_only.outputs) / target_only.seconds
                                  if target_only.seconds else 0.0),
        ours_cycles=cycles,
        ours_accepted_per_position=accepted,
        ours_tau=_tau(cycles, accepted),
        rule=("exact" if exact else within if per_position
              else f"tau {within}: {cfg.engine} reported no per-position counts"),
    )
    check.speedup = check.tokens_per_s / check.target_only_tokens_per_s if check.target_only_tokens_per_s else 0.0
    check.disagreement = disagreement(check, exact, tolerance)
    return check


def _compare_sampled(cfg: EvalConfig, with_drafter: ServedRun, target_only: ServedRun, report: EvalReport, dtype: str,
                     cycles: int, accepted: list[int]) -> EngineCheck:
    assert report.sampled is not None
    z = NormalDist().inv_cdf(1 - cfg.engine_alpha / (2 * report.block_size))
    check = EngineCheck(
        engine=cfg.engine, version=with_drafter.version, dtype=dtype, drafts=with_drafter.drafts,
        accepted_per_position=with_drafter.accepted_per_position,
        tau=_tau(with_drafter.drafts, [with_drafter.accepted]),
        outputs_equal_target_only=sum(a == b for a, b in zip(with_drafter.outputs, target_only.outputs)),
        num_prompts=len(with_drafter.outputs),
        tokens_per_s=sum(len(o) for o in with_drafter.outputs) / with_drafter.seconds if with_drafter.seconds else 0.0,
        target_only_tokens_per_s=(sum(len(o) for o in target_only.outputs) / target_only.seconds
                                  if target_only.seconds else 0.0),
        ours_cycles=cycles, ours_accepted_per_position=accepted, ours_tau=_tau(cycles, accepted),
        rule=f"binomial {1 - cfg.engine_alpha:.0%}, z {z:.2f} (T={report.sampled.temperature:g}, "
             f"{report.sampled.proposal} drafts)",
        temperature=report.sampled.temperature,
    )
    check.speedup = check.tokens_per_s / check.target_only_tokens_per_s if check.target_only_tokens_per_s else 0.0
    check.disagreement = sampled_disagreement(check, z, design_effects(_our_decodes(report), report.block_size - 1))
    return check


def _length_variance(drafts: int, accepted: Sequence[int]) -> float:
    """Variance of a + 1 over cycles, from the cycles that accepted each draft position (acceptance is a prefix, so
    accepted[k-1] counts the cycles with a >= k)."""
    if drafts == 0:
        return 0.0
    reached = [drafts, *accepted, 0]
    counts = [reached[a] - reached[a + 1] for a in range(len(accepted) + 1)]  # cycles with exactly a accepted
    mean = sum((a + 1) * c for a, c in enumerate(counts)) / drafts
    return sum(c * (a + 1 - mean) ** 2 for a, c in enumerate(counts)) / drafts


def sampled_disagreement(check: EngineCheck, z: float, effects: Sequence[float] | None = None) -> str | None:
    """At temperature: one line naming the positions (or tau) whose engine and our figures differ by more than z
    standard errors, or None. `effects`: each position's and tau's design effect (`design_effects`, measured on our
    decodes, which sample the same prompts at the same settings as the engine's requests): the binomial standard errors
    are widened by its square root."""
    n1, n2 = check.drafts, check.ours_cycles
    if n1 == 0 or n2 == 0:
        return (f"the engine ran {n1} drafts and our decode {n2} cycles at temperature {check.temperature:g}: nothing "
                "to compare")
    effects = list(effects) if effects is not None else [1.0] * (len(check.accepted_per_position) + 1)
    off = []
    for k, (a1, a2) in enumerate(zip(check.accepted_per_position, check.ours_accepted_per_position)):
        pooled = (a1 + a2) / (n1 + n2)
        se = math.sqrt(effects[k] * pooled * (1 - pooled) * (1 / n1 + 1 / n2))
        if abs(a1 / n1 - a2 / n2) > z * se:
            off.append(k + 1)
    tau_se = math.sqrt(effects[-1] * (_length_variance(n1, check.accepted_per_position) / n1
                                      + _length_variance(n2, check.ours_accepted_per_position) / n2))
    tau_off = abs(check.tau - check.ours_tau) > z * tau_se
    if not off and not tau_off:
        return None
    where = f"at draft position(s) {', '.join(map(str, off))}" if off else "in tau"
    return (f"the engine disagrees with our decode {where} ({check.rule}): engine {n1} drafts, accepted "
            f"{check.accepted_per_position}, tau {check.tau:.3f}; ours {n2} cycles, accepted "
            f"{check.ours_accepted_per_position}, tau {check.ours_tau:.3f}")


def _tau(drafts: int, accepted: Sequence[int]) -> float:
    """Mean tokens committed per cycle: 1 + accepted drafts per cycle."""
    return 1.0 + sum(accepted) / drafts if drafts else 0.0


def disagreement(check: EngineCheck, exact: bool, tolerance: float) -> str | None:
    """One line saying where the engine and our decode differ beyond the rule, or None when they agree."""
    if check.outputs_equal_target_only != check.num_prompts:
        return (f"the engine's outputs with the drafter differ from its target-only outputs on "
                f"{check.num_prompts - check.outputs_equal_target_only} of {check.num_prompts} prompts: not lossless "
                "in the engine")
    if exact:
        return None
    theirs, ours_ = check.accepted_per_position, check.ours_accepted_per_position
    rate = [a / check.drafts if check.drafts else 0.0 for a in theirs]
    ours_rate = [b / check.ours_cycles if check.ours_cycles else 0.0 for b in ours_]
    cycles = max(1, min(check.drafts, check.ours_cycles))
    # `FLIPS` drafts flipped by near-ties move a rate by up to FLIPS / cycles and tau by up to FLIPS * B / cycles: on a
    # few prompts that alone can pass the tolerance, so it is allowed on top of it.
    off = [k + 1 for k, (a, b) in enumerate(zip(rate, ours_rate)) if abs(a - b) > tolerance + FLIPS / cycles]
    tau_slack = tolerance * max(check.ours_tau, 1.0) + FLIPS * (len(ours_) + 1) / cycles
    if not off and abs(check.tau - check.ours_tau) <= tau_slack:
        return None
    where = f"at draft position(s) {', '.join(map(str, off))}" if off else "in tau"
    return (f"the engine disagrees with our decode {where} ({check.rule}): engine {check.drafts} drafts, accepted "
            f"{theirs}, tau {check.tau:.3f}; ours {check.ours_cycles} cycles, accepted {ours_}, tau "
            f"{check.ours_tau:.3f}")


__all__ = ["check_in_engine", "compare", "design_effects", "disagreement", "ours", "refuse_proposal",
           "refuse_unservable", "require_export", "sampled_disagreement"]
