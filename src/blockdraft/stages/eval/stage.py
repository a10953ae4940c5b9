"""The `eval` stage: real greedy speculative decoding of held-out prompts, checked token for token against target-only
greedy decoding, with acceptance metrics, the n-gram baseline, an untrained-drafter baseline and wall-clock speedup.

Output: an `eval` artifact holding `report.json` (`EvalReport`), `tau_histogram.png` and `position_acceptance.png`,
written through `StageOutput` (docs/STORE.md, "Stage outputs and inputs"). Its key is the config that changes the report
(eval, target, placement, thinking, the checkpoint and prompts as given) and its lineage (the checkpoint and the prompts
by content), so a rerun with both unchanged returns the stored report without loading the target.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from blockdraft.config import BlockdraftConfig, check_device
from blockdraft.decode.linear_state import check_rollback_supported
from blockdraft.decode.ngram import NgramProposer
from blockdraft.decode.speculative import DFlashProposer, GreedyResult, SpecResult, greedy_decode, run_speculative
from blockdraft.errors import ArtifactError, EvalError, SpecError
from blockdraft.model.drafter import CONFIG_NAME, WEIGHTS_NAME, DFlashDrafter
from blockdraft.model.target import TargetHead, load_target, load_target_config
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.eval.drafter_input import Checkpoint, check_checkpoint_matches, open_checkpoint
from blockdraft.stages.eval.engine_check import check_in_engine, require_export
from blockdraft.stages.eval.metrics import (
    Divergence,
    acceptance_metrics,
    divergence_tolerance,
    first_divergence,
    greedy_metrics,
    with_speedup,
)
from blockdraft.stages.eval.prompts import EvalPrompts, load_target_tokenizer, read_eval_prompts, stop_token_ids
from blockdraft.stages.eval.report import REPORT_NAME, EvalReport, Lossless, PromptRow, write_report
from blockdraft.store import open_store
from blockdraft.store.artifact import InputRef, VerifyReport
from blockdraft.store.stage_io import StageOutput, refuse_nested, stage_key

STAGE = "eval"
KIND = "eval"
UNTRAINED_SEED = 0


def run(
    config: BlockdraftConfig,
    input: str,
    output: str | None = None,
    reporter: Reporter | None = None,
    *,
    force: bool = False,
    prompts: str | None = None,
    max_new_tokens: int | None = None,
    export: str | None = None,
) -> StageResult:
    """Evaluate the drafter at `input` (a checkpoint, a training output or an export) into `output` (default
    STORE/eval/<hash of checkpoint, prompts, settings>); `details` is the EvalReport.

    `prompts`: a JSONL file, or a tokenized artifact URL (its held-out rows); default eval.prompts, else the held-out rows
    of train.data. `max_new_tokens`: default eval.max_new_tokens. Progress: ("eval", prompts done, prompts). A report
    whose lossless check failed is still committed: the caller decides what a divergence means (the CLI exits 1).
    """
    started = time.perf_counter()
    reporter = reporter or Reporter()
    if not config.target.path:
        raise EvalError("target.path is not set; eval needs the target model the drafter was trained for")
    max_new_tokens = max_new_tokens or config.eval.max_new_tokens
    hf_config = load_target_config(config.target.path)
    check_rollback_supported(hf_config)  # before anything is fetched: an unsupported layer kind is refused in seconds
    check_device("placement.target_devices", config.placement.target_devices[0])  # and a device this machine lacks
    check_device("placement.drafter_devices", config.placement.drafter_devices[0])
    served = require_export(config.eval, export) if config.eval.engine != "none" else None

    with tempfile.TemporaryDirectory(prefix="blockdraft-eval-") as tmp:
        workdir = Path(tmp)
        ckpt = open_checkpoint(input, config.store, workdir / "checkpoint")
        check_checkpoint_matches(config, ckpt, hf_config)
        tokenizer = load_target_tokenizer(config.target)
        chosen = read_eval_prompts(prompts or config.eval.prompts or config.train.data, config, tokenizer, workdir)
        url = output or _default_output(config, ckpt, chosen.ids, max_new_tokens)
        out = StageOutput(url, KIND, _output_key(config, input, chosen, max_new_tokens, ckpt, served), config.store, force=force, reporter=reporter)
        refuse_nested(open_store(input, config.store), out.store, "checkpoint")
        done = out.done()
        if done is not None:
            reporter.say(f"{out.url} already holds the eval of this checkpoint on these prompts with these settings; nothing ran")
            stored = EvalReport.from_json(out.store.read_bytes(REPORT_NAME))
            return StageResult(STAGE, url, done, already_done=True, seconds=time.perf_counter() - started, details=stored)

        report = _decode_and_measure(config, ckpt, chosen.ids, max_new_tokens, tokenizer, reporter)
        if served is not None:
            assert config.target.path is not None  # refused above without one
            engine = check_in_engine(config.eval, served, config.target.path, chosen.ids, report, workdir, reporter)
            report = report.model_copy(update={"engine": engine})
        report = report.model_copy(update={
            "checkpoint": input,
            "target": config.target.path,
            "prompts_source": chosen.source,
            # What the consistency check compared, so a reader can trace the figures to the data and template they hold for.
            "template_sha256": ckpt.template_sha256,
        })
        verified = _commit(out, report, config, [ckpt.ref, chosen.ref], workdir / "report")
    return StageResult(STAGE, url, verified, seconds=time.perf_counter() - started, details=report)


def _commit(out: StageOutput, report: EvalReport, config: BlockdraftConfig, lineage: list[InputRef], folder: Path) -> VerifyReport:
    """Write report.json and the plots into `folder`, then publish them as the eval artifact (manifest last, verified)."""
    out.begin()  # a reader must never see an older manifest over the new files
    folder.mkdir()
    return out.publish(folder, write_report(report, folder), config=config.resolved(), lineage=lineage, counts=report.counts())


def _decode_and_measure(
    cfg: BlockdraftConfig, ckpt: Checkpoint, prompts: list[list[int]], max_new_tokens: int, tokenizer: Any, reporter: Reporter
) -> EvalReport:
    """Load the target and the drafter on their devices, refuse prompts outside the vocabulary, and `evaluate`."""
    assert cfg.target.path is not None  # `run` refuses a config without one
    hf_model = load_target(cfg.target.path, device=cfg.placement.target_devices[0], dtype=cfg.target.dtype, reporter=reporter)
    folder = ckpt.fetch_weights()
    drafters = {}
    for name, where, path in (("dflash", f"checkpoint {ckpt.url}", folder), ("baseline", f"eval.baseline {cfg.eval.baseline}", cfg.eval.baseline)):
        if path is None:
            continue
        try:
            drafter = DFlashDrafter.from_pretrained(path, device=cfg.placement.drafter_devices[0], dtype=hf_model.dtype)
            drafter.spec.check_target(hf_model.config)
        except (SpecError, ArtifactError) as exc:
            raise type(exc)(f"{where}: {exc}") from None  # the same error, naming which drafter it is about
        except (SafetensorError, json.JSONDecodeError) as exc:  # bytes that are not the export format (a plain folder is not verified)
            raise ArtifactError(
                f"{where}: {Path(path) / (CONFIG_NAME if isinstance(exc, ValueError) else WEIGHTS_NAME)} is not readable ({exc}); "
                "give a drafter folder in the export format"
            ) from None
        drafters[name] = drafter.eval()
    drafter = drafters.pop("dflash")
    vocab = drafter.spec.vocab_size
    bad = next((t for p in prompts for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        raise EvalError(f"prompt token id {bad} is outside the target's vocabulary (0..{vocab - 1}); the prompts were tokenized for another model")
    return evaluate(
        hf_model, drafter, prompts, max_new_tokens, stop_token_ids(hf_model, tokenizer),
        divergence_tolerance(cfg.eval, next(hf_model.parameters()).dtype),
        untrained_seed=UNTRAINED_SEED if cfg.eval.untrained_baseline else None,
        reporter=reporter,
        baselines=drafters,
    )


def evaluate(
    hf_model: Any,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stops: Sequence[int],
    tolerance: float,
    untrained_seed: int | None = UNTRAINED_SEED,
    reporter: Reporter | None = None,
    baselines: dict[str, DFlashDrafter] | None = None,
) -> EvalReport:
    """Run target-only greedy, the DFlash drafter (a DFlash2 drafter's walk, and as `UNARY_ARGMAX` its unary argmax), the
    n-gram baseline, (with `untrained_seed`) a freshly initialised
    drafter of the same shape, and each of `baselines` (other drafters by name, e.g. a published one) on every prompt;
    compare each speculative output with greedy. The report's `checkpoint`, `target`, `prompts_source` and
    `template_sha256` are left None. Progress: ("eval", prompts done, prompts)."""
    reporter = reporter or Reporter()
    param = next(drafter.parameters())
    head = TargetHead.from_target(hf_model, device=param.device).to(param.dtype)
    spec = drafter.spec
    makers = {
        "dflash": lambda: DFlashProposer(drafter, head),
        "ngram": lambda: NgramProposer(spec.block_size, spec.mask_token_id),
    }
    if drafter.candidate_selector is not None:  # DFlash2: the same drafter's unary argmax beside its walk
        makers[UNARY_ARGMAX] = lambda: DFlashProposer(drafter, head, use_selector=False)
    if untrained_seed is not None:
        torch.manual_seed(untrained_seed)
        untrained = DFlashDrafter(spec).to(device=param.device, dtype=param.dtype).eval()
        makers["untrained"] = lambda: DFlashProposer(untrained, head)
    block_sizes = dict.fromkeys(makers, spec.block_size)
    for name, other in (baselines or {}).items():
        makers[name] = lambda other=other: DFlashProposer(other, head)
        block_sizes[name] = other.spec.block_size

    _warm_up(hf_model, makers["dflash"](), list(prompts[0]))
    greedy: list[GreedyResult] = []
    spec_results: dict[str, list[SpecResult]] = {name: [] for name in makers}
    divergences: list[Divergence] = []
    rows: list[PromptRow] = []
    reporter.progress(STAGE, 0, len(prompts))
    for index, prompt in enumerate(prompts):
        reference = greedy_decode(hf_model, prompt, max_new_tokens, stops)
        greedy.append(reference)
        per_drafter: dict[str, Any] = {}
        for name, make in makers.items():
            result = run_speculative(hf_model, make(), prompt, max_new_tokens, stops)
            spec_results[name].append(result)
            per_drafter[f"tau_{name}"] = result.tau
            per_drafter[f"acceptance_lengths_{name}"] = result.acceptance_lengths
            found = first_divergence(name, index, result, reference, tolerance)
            if found is not None:
                divergences.append(found)
        rows.append(PromptRow(index=index, prompt_len=len(prompt), new_tokens=len(reference.new_tokens), **per_drafter))
        reporter.progress(STAGE, index + 1, len(prompts))

    greedy_summary = greedy_metrics(greedy)
    return EvalReport(
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.target_layer_ids),
        max_new_tokens=max_new_tokens,
        num_prompts=len(prompts),
        stop_token_ids=list(stops),
        target_dtype=str(next(hf_model.parameters()).dtype).removeprefix("torch."),
        greedy=greedy_summary,
        drafters={
            name: with_speedup(acceptance_metrics(results, block_sizes[name]), greedy_summary) for name, results in spec_results.items()
        },
        lossless=Lossless(ok=all(d.tolerated for d in divergences), tolerance=tolerance, divergences=divergences),
        prompts=rows,
    )


# The report's name for a DFlash2 drafter proposing its unary argmax instead of the walk: what the selector earns.
UNARY_ARGMAX = "dflash_argmax"


def _warm_up(hf_model: Any, proposer: DFlashProposer, prompt: list[int]) -> None:
    """One short run of each path first, so one-time costs (allocations, kernel selection) do not land in one timing."""
    greedy_decode(hf_model, prompt, 2)
    run_speculative(hf_model, proposer, prompt, 2)


def _default_output(cfg: BlockdraftConfig, ckpt: Checkpoint, prompts: list[list[int]], max_new_tokens: int) -> str:
    """STORE/eval/<16 hex>: one folder per checkpoint (by content), prompt ids, length and eval/target settings."""
    key = json.dumps([ckpt.ref.sha256, prompts, max_new_tokens, cfg.digest("eval", "target")]).encode()
    return f"{cfg.store.url.rstrip('/')}/eval/{hashlib.sha256(key).hexdigest()[:16]}"


def _output_key(
    cfg: BlockdraftConfig, checkpoint: str, prompts: EvalPrompts, max_new_tokens: int, ckpt: Checkpoint, served: Path | None
) -> str:
    """What the report depends on: the settings that change its figures or its fields, and both inputs by content.

    Placement is in it because devices change the timings and, in low precision, the near-ties; tokenize.thinking because
    it renders `messages` prompts. The checkpoint and prompts are also keyed as given, since the report records them so.
    """
    resolved = cfg.resolved()
    settings = {
        "eval": {**resolved["eval"], "max_new_tokens": max_new_tokens},
        "target": resolved["target"],
        "placement": resolved["placement"],
        "thinking": resolved["tokenize"]["thinking"],
        "checkpoint": checkpoint,
        "prompts": prompts.source,
        "baseline_sha256": _drafter_digest(cfg.eval.baseline, "eval.baseline"),
        "engine_export_sha256": _drafter_digest(str(served) if served else None, "--export"),
    }
    return stage_key(settings, [ckpt.ref, prompts.ref])


def _drafter_digest(folder: str | None, role: str) -> str | None:
    """sha256 over a drafter folder's config.json and weights (the baseline, the export served by the engine), so a
    changed one is a new eval (None: no such folder)."""
    if folder is None:
        return None
    digest = hashlib.sha256()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        path = Path(folder) / name
        if not path.is_file():
            raise ArtifactError(f"{role} {folder} has no {name}; give a drafter folder in the export format")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


__all__ = ["KIND", "STAGE", "UNTRAINED_SEED", "evaluate", "run"]
