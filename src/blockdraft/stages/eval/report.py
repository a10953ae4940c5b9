"""The eval report: `report.json` as a typed model, its two plots, and the short summary people read.

`EvalReport.to_json()` is exactly what `report.json` holds; its keys are the field names below, in this order, so the
JSON keeps the layout readers (the demo, scripts, docs) rely on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from blockdraft.stages.eval.metrics import Divergence, DrafterMetrics, GreedyMetrics
from blockdraft.stages.eval.sampled import SampledEval

REPORT_NAME = "report.json"
TAU_PLOT_NAME = "tau_histogram.png"
POSITION_PLOT_NAME = "position_acceptance.png"
SAMPLED_TAU_PLOT_NAME = "tau_histogram_sampled.png"  # the same two plots for the sampled decodes (eval.temperature > 0)
SAMPLED_POSITION_PLOT_NAME = "position_acceptance_sampled.png"
UNARY_NAME = "dflash_unary"  # a DFlash2 drafter proposing each slot's unary argmax instead of its selector's walk


class Lossless(BaseModel):
    """The token-for-token check against greedy: `ok` unless a divergence's margin is beyond `tolerance`."""

    ok: bool
    tolerance: float
    divergences: list[Divergence]


class PromptRow(BaseModel):
    """One prompt: its length, greedy's new tokens, and per drafter NAME the fields `tau_NAME` (float) and
    `acceptance_lengths_NAME` (a + 1 per cycle), kept as extra fields so the JSON row stays flat."""

    model_config = ConfigDict(extra="allow")

    index: int
    prompt_set: str
    prompt_len: int
    new_tokens: int


class PromptSetMetrics(BaseModel):
    """One prompt set's figures: its layout and source (as given), the greedy reference and each drafter's metrics over
    its prompts alone (tau, speedup, per-position acceptance), and whether none of its prompts diverged beyond
    tolerance."""

    layout: str
    source: str | None
    num_prompts: int
    greedy: GreedyMetrics
    drafters: dict[str, DrafterMetrics]
    lossless: bool


class EngineCheck(BaseModel):
    """The export served by a serving engine on the same prompts (`eval --engine`), beside our decode of the checkpoint.

    `drafts` and `accepted_per_position[k-1]` (tokens accepted at draft position k) come from the engine's own counters;
    `ours_cycles` and `ours_accepted_per_position` are the same counts from our decode. `outputs_equal_target_only`:
    prompts whose engine output with the drafter equals the engine's target-only output. `rule`: "exact" (both float32)
    or "within T" (lower precision), or at temperature "binomial 95%..." (docs/EVAL.md, "The engine check at
    temperature"); `temperature` 0 is greedy. `disagreement`: None when they agree, else the one line saying where they
    differ."""

    engine: str
    version: str
    dtype: str
    drafts: int
    accepted_per_position: list[int]
    tau: float
    outputs_equal_target_only: int
    num_prompts: int
    tokens_per_s: float
    target_only_tokens_per_s: float
    speedup: float = 0.0
    ours_cycles: int
    ours_accepted_per_position: list[int]
    ours_tau: float
    rule: str
    temperature: float = 0.0
    disagreement: str | None = None


class EvalReport(BaseModel):
    """What one eval run measured, and on what.

    `drafters` maps a drafter name (dflash, ngram, untrained) to its metrics over every prompt; for a DFlash2 drafter
    (`architecture` "dflash2") `dflash` is its candidate selector's walk and `dflash_unary` the same drafter proposing
    each slot's unary argmax, on the same prompts: what the selector earns. `prompt_sets`: the same per prompt set, by
    set name, in the order given. `checkpoint`, `target`, `prompts_source` (the sources as given) and `template_sha256`
    (the chat template the checkpoint's training rows were rendered with) say what the figures hold for; `evaluate`
    leaves them None, the stage fills them in. `sampled`: the same drafters at the eval's sampling settings (None at
    temperature 0); greedy is always measured, as the token-for-token check needs it.
    """

    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    max_new_tokens: int
    num_prompts: int
    stop_token_ids: list[int]
    target_dtype: str
    greedy: GreedyMetrics
    drafters: dict[str, DrafterMetrics]
    lossless: Lossless
    prompts: list[PromptRow]
    checkpoint: str | None = None
    target: str | None = None
    prompts_source: list[str] | None = None
    template_sha256: str | None = None
    engine: EngineCheck | None = None
    sampled: SampledEval | None = None
    prompt_sets: dict[str, PromptSetMetrics] = {}
    architecture: str = "dflash"

    def to_json(self) -> str:
        """`report.json`'s text. Python's encoder, so a margin of inf stays `Infinity` (pydantic's would write null)."""
        return json.dumps(self.model_dump(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> EvalReport:
        return cls.model_validate(json.loads(text))

    def counts(self) -> dict[str, Any]:
        """The figures the eval artifact's manifest records: prompts, the lossless verdict, tau per drafter."""
        return {
            "prompts": self.num_prompts,
            "lossless": self.lossless.ok,
            **{f"tau_{name}": round(m.tau, 4) for name, m in self.drafters.items()},
            **({f"tau_sampled_{name}": round(d.metrics.tau, 4) for name, d in self.sampled.drafters.items()}
               if self.sampled else {}),
            **({"engine_agrees": self.engine.disagreement is None, "tau_engine": round(self.engine.tau, 4)}
               if self.engine else {}),
        }


def write_report(report: EvalReport, folder: Path) -> list[Path]:
    """`report.json` and both plots in `folder`; returns their paths, the report first."""
    path = folder / REPORT_NAME
    path.write_text(report.to_json())
    return [path, *write_plots(report, folder)]


def write_plots(report: EvalReport, folder: Path) -> list[Path]:
    """The tau histogram and per-position acceptance, one bar group / line per drafter, greedy and (when it ran) sampled
    (with its 95% intervals); returns the PNG paths."""
    paths = _plots({n: (m, None) for n, m in report.drafters.items()}, report.block_size, folder / TAU_PLOT_NAME,
                   folder / POSITION_PLOT_NAME, "greedy")
    if report.sampled is not None:
        s = report.sampled
        settings = (f"temperature {s.temperature:g}, top-p {s.top_p:g}, top-k {s.top_k}, {s.proposal} drafts, "
                    f"{s.decodes} decodes")
        paths += _plots({n: (d.metrics, d.position_acceptance_ci95) for n, d in s.drafters.items()}, report.block_size,
                        folder / SAMPLED_TAU_PLOT_NAME, folder / SAMPLED_POSITION_PLOT_NAME, settings)
    return paths


def _plots(drafters: dict[str, tuple[DrafterMetrics, list[list[float]] | None]], block_size: int, tau_path: Path,
           position_path: Path, settings: str) -> list[Path]:
    # matplotlib is only needed here, and its backend must be chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / max(len(drafters), 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, (m, _)) in enumerate(drafters.items()):
        cycles = max(m.cycles, 1)
        xs = [j + (i - (len(drafters) - 1) / 2) * width for j in range(1, block_size + 1)]
        ax.bar(xs, [m.histogram[str(j)] / cycles for j in range(1, block_size + 1)], width,
               label=f"{name} (tau {m.tau:.2f})")
    ax.set_xlabel("tokens committed per cycle (accepted drafts + bonus)")
    ax.set_ylabel("fraction of cycles")
    ax.set_xticks(range(1, block_size + 1))
    ax.legend()
    ax.set_title(f"Acceptance length per draft/verify cycle ({settings})")
    fig.tight_layout()
    fig.savefig(tau_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (m, ci) in drafters.items():
        if ci is None:
            ax.plot(range(1, block_size), m.position_acceptance, marker="o", label=name)
        else:
            low = [r - c[0] for r, c in zip(m.position_acceptance, ci)]
            high = [c[1] - r for r, c in zip(m.position_acceptance, ci)]
            ax.errorbar(range(1, block_size), m.position_acceptance, yerr=[low, high], marker="o", capsize=3,
                        label=f"{name} (95%)")
    ax.set_xlabel("draft position k in the block")
    ax.set_ylabel("fraction of cycles accepting draft k")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(range(1, block_size))
    ax.legend()
    ax.set_title(f"Per-position acceptance ({settings})")
    fig.tight_layout()
    fig.savefig(position_path, dpi=100)
    plt.close(fig)
    return [tau_path, position_path]


def summary_lines(report: EvalReport) -> list[str]:
    """A short human summary: the greedy reference, one line per drafter over every prompt, one line per prompt set, the
    lossless verdict and each divergence."""
    greedy, lossless = report.greedy, report.lossless
    lines = [f"greedy\ttokens/s {greedy.tokens_per_s:.1f}\tforwards/token {greedy.target_forwards_per_token:.3f}"]
    for name, m in report.drafters.items():
        lines.append(
            f"{name}\ttau {m.tau:.3f}\ttokens/s {m.tokens_per_s:.1f}\tspeedup {m.speedup:.2f}x"
            f"\tforwards/token {m.target_forwards_per_token:.3f}"
        )
    walk, unary = report.drafters.get("dflash"), report.drafters.get(UNARY_NAME)
    if walk is not None and unary is not None and unary.tau > 0:
        lines.append(f"selector\twalk tau {walk.tau:.3f} vs unary argmax tau {unary.tau:.3f} "
                     f"({walk.tau / unary.tau - 1:+.1%})")
    for set_name, m in report.prompt_sets.items():
        lines.append(set_line(set_name, m))
    verdict = "ok" if lossless.ok else "FAILED"
    lines.append(f"lossless\t{verdict}\t{len(lossless.divergences)} divergence(s), tolerance {lossless.tolerance:g}")
    for d in lossless.divergences:
        lines.append(
            f"  {d.drafter} prompt {d.prompt_index} position {d.position}: spec {d.spec_token} vs target "
            f"{d.target_token}, top-2 margin {d.margin:.3g} ({'near-tie' if d.tolerated else 'beyond tolerance'})"
        )
    if report.sampled is not None:
        lines += sampled_lines(report)
    if report.engine is not None:
        lines += engine_lines(report.engine)
    return lines


def set_line(name: str, m: PromptSetMetrics) -> str:
    """One prompt set in the summary: the trained drafter's tau, speedup and per-position acceptance on its prompts."""
    d = m.drafters["dflash"]
    positions = " ".join(f"{a:.2f}" for a in d.position_acceptance)
    return (
        f"set {name}\t{m.layout}, {m.num_prompts} prompt(s)\ttau {d.tau:.3f}\tspeedup {d.speedup:.2f}x"
        f"\taccepted per position {positions}\tlossless {'ok' if m.lossless else 'FAILED'}"
    )


def sampled_lines(report: EvalReport) -> list[str]:
    """The sampled decodes beside greedy: per drafter, tau (95% interval) and speedup at temperature, greedy's tau
    after."""
    s = report.sampled
    assert s is not None
    lines = [f"sampled	temperature {s.temperature:g} top-p {s.top_p:g} top-k {s.top_k}, draft rule {s.proposal}: "
             f"{s.decodes} decodes ({s.samples_per_prompt} per prompt, seed {s.seed}); target-only tokens/s "
             f"{s.target_only.tokens_per_s:.1f}"]
    for name, d in s.drafters.items():
        greedy = report.drafters.get(name)
        # One decode has no interval (sampled.ratio_ci95): say so rather than print a zero-width one.
        interval = (f"[{d.tau_ci95[0]:.3f}, {d.tau_ci95[1]:.3f}]" if d.tau_ci95 is not None
                    else f"(no interval: {s.decodes} decode{'' if s.decodes == 1 else 's'})")
        lines.append(
            f"{name}	tau {d.metrics.tau:.3f} {interval} at T={s.temperature:g}"
            f"	speedup {d.metrics.speedup:.2f}x"
            + (f"	(greedy tau {greedy.tau:.3f}, {greedy.speedup:.2f}x)" if greedy else "")
        )
    return lines


def engine_lines(e: EngineCheck) -> list[str]:
    """The engine check in the summary: its acceptance beside ours, lossless in the engine, its own speedup."""
    verdict = "agrees" if e.disagreement is None else "DISAGREES"
    return [
        f"engine\t{e.engine} {e.version} {e.dtype}\ttau {e.tau:.3f} (ours {e.ours_tau:.3f})\tspeedup {e.speedup:.2f}x"
        f"\ttokens/s {e.tokens_per_s:.1f} (target-only {e.target_only_tokens_per_s:.1f})",
        f"engine\t{verdict} ({e.rule}): drafts {e.drafts} (ours {e.ours_cycles}), accepted per position "
        f"{e.accepted_per_position} (ours {e.ours_accepted_per_position}); "
        + (f"lossless in the engine {e.outputs_equal_target_only}/{e.num_prompts}" if not e.temperature
           else f"at T={e.temperature:g} over {e.num_prompts} sampled requests"),
    ]


__all__ = [
    "POSITION_PLOT_NAME", "REPORT_NAME", "SAMPLED_POSITION_PLOT_NAME", "SAMPLED_TAU_PLOT_NAME", "TAU_PLOT_NAME",
    "UNARY_NAME", "EngineCheck",
    "EvalReport", "engine_lines", "Lossless", "PromptRow", "PromptSetMetrics", "sampled_lines", "set_line",
    "summary_lines", "write_plots", "write_report",
]
