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

from blockdraft.config import BlockdraftConfig, EvalConfig, check_device
from blockdraft.decode.linear_state import check_rollback_supported
from blockdraft.decode.ngram import NgramProposer
from blockdraft.decode.speculative import DFlashProposer, GreedyResult, SpecResult, greedy_decode, run_speculative
from blockdraft.errors import ArtifactError, EvalError, SpecError, redact_setting
from blockdraft.model.drafter import CONFIG_NAME, WEIGHTS_NAME, DFlashDrafter
from blockdraft.model.target import TargetHead, load_target, load_target_config
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.eval.drafter_input import (
    Checkpoint,
    check_checkpoint_matches,
    drafter_folder_sha256,
    open_checkpoint,
)
from blockdraft.stages.eval.engine_check import check_in_engine, require_export
from blockdraft.stages.eval.metrics import (
    Divergence,
    acceptance_metrics,
    divergence_tolerance,
    first_divergence,
    greedy_metrics,
    with_speedup,
)
from blockdraft.stages.eval.prompt_sets import PLAIN
from blockdraft.stages.eval.prompts import (
    EvalPrompts,
    EvalSet,
    load_target_tokenizer,
    read_eval_prompts,
    stop_token_ids,
)
from blockdraft.stages.eval.report import (
    REPORT_NAME,
    UNARY_NAME,
    EvalReport,
    Lossless,
    PromptRow,
    PromptSetMetrics,
    write_report,
)
from blockdraft.stages.eval.sampled import check_seeds, evaluate_sampled, sampling_of
from blockdraft.store import open_store
from blockdraft.store.artifact import InputRef, VerifyReport
from blockdraft.store.output import StageOutput, refuse_nested, stage_key

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
    prompts: str | Sequence[str] | None = None,
    max_new_tokens: int | None = None,
    export: str | None = None,
) -> StageResult:
    """Evaluate the drafter at `input` (a checkpoint, a training output or an export) into `output` (default
    STORE/eval/<hash of checkpoint, prompts, settings>); `details` is the EvalReport.

    `prompts`: one source or several, each a prompt set (a .jsonl or .parquet file of a layout `prompt_sets` reads, a
    folder `datasets` saved, hf://datasets/NAME) or a tokenized artifact URL (its held-out rows); default eval.prompts,
    else the rows training held out: every row of train.eval_data when it is set, else train.data's held-out rows.
    eval.prompt_sets names each source's layout (default: recognised). `max_new_tokens`: default eval.max_new_tokens.
    Progress: ("eval", prompts done, prompts). A report
    whose lossless check failed is still committed: the caller decides what a divergence means (the CLI exits 1).
    """
    started = time.perf_counter()
    reporter = reporter or Reporter()
    if not config.target.path:
        raise EvalError("target.path is not set; eval needs the target model the drafter was trained for")
    max_new_tokens = max_new_tokens or config.eval.max_new_tokens
    hf_config = load_target_config(config.target.path)
    check_rollback_supported(hf_config)  # before anything is fetched: an unsupported layer kind is refused in seconds
    for device in config.placement.target_groups[0]:  # and a device this machine lacks
        check_device("placement.target_devices", device)
    check_device("placement.drafter_devices", config.placement.drafter_devices[0])
    served = require_export(config.eval, export) if config.eval.engine != "none" else None

    with tempfile.TemporaryDirectory(prefix="blockdraft-eval-") as tmp:
        workdir = Path(tmp)
        ckpt = open_checkpoint(input, config.store, workdir / "checkpoint")
        check_checkpoint_matches(config, ckpt, hf_config)
        tokenizer = load_target_tokenizer(config.target)
        # By default the rows training held out: train.eval_data's, every one (the prompts its decoded figure used),
        # else train.data's held-out split.
        sources = prompts or config.eval.prompts or config.train.eval_data or config.train.data
        whole = [sources] if isinstance(sources, str) and sources == config.train.eval_data else []
        chosen = read_eval_prompts(sources, config, tokenizer, workdir, config.eval.prompt_sets, every_split=whole)
        check_seeds(config.eval, len(chosen.ids))  # every sampled decode's seed, before any model loads
        url = output or _default_output(config, ckpt, chosen, max_new_tokens)
        out = StageOutput(url, KIND, _output_key(config, input, chosen, max_new_tokens, ckpt, served), config.store,
                          force=force, reporter=reporter)
        refuse_nested(open_store(input, config.store), out.store, "checkpoint")
        done = out.done()
        if done is not None:
            reporter.say(f"{out.url} already holds the eval of this checkpoint on these prompts with these settings; "
                         "nothing ran")
            stored = EvalReport.from_json(out.store.read_bytes(REPORT_NAME))
            return StageResult(STAGE, url, done, already_done=True, seconds=time.perf_counter() - started,
                               details=stored)

        report = _decode_and_measure(config, ckpt, chosen, max_new_tokens, tokenizer, reporter)
        if served is not None:
            assert config.target.path is not None  # refused above without one
            engine = check_in_engine(config.eval, served, config.target.path, chosen.ids, report, workdir, reporter)
            report = report.model_copy(update={"engine": engine})
        report = report.model_copy(update={
            # As given, but with any credential in them fingerprinted, as every pinned setting is.
            "checkpoint": redact_setting(input),
            "target": redact_setting(config.target.path),
            "prompts_source": [redact_setting(source) for source in chosen.sources],
            # What the consistency check compared, so a reader can trace the figures to the data and template they hold
            # for.
            "template_sha256": ckpt.template_sha256,
        })
        verified = _commit(out, report, config, [ckpt.ref, *chosen.refs], workdir / "report")
    return StageResult(STAGE, url, verified, seconds=time.perf_counter() - started, details=report)


def _commit(
    out: StageOutput, report: EvalReport, config: BlockdraftConfig, lineage: list[InputRef], folder: Path
) -> VerifyReport:
    """Write report.json and the plots into `folder`, then publish them as the eval artifact (manifest last,
    verified)."""
    out.begin()  # a reader must never see an older manifest over the new files
    folder.mkdir()
    return out.publish(folder, write_report(report, folder), config=config.resolved(), lineage=lineage,
                       counts=report.counts())


def _decode_and_measure(
    cfg: BlockdraftConfig, ckpt: Checkpoint, chosen: EvalPrompts, max_new_tokens: int, tokenizer: Any,
    reporter: Reporter
) -> EvalReport:
    """Load the target and the drafter on their devices, refuse prompts outside the vocabulary, and `evaluate`."""
    assert cfg.target.path is not None  # `run` refuses a config without one
    hf_model = load_target(cfg.target.path, device=cfg.placement.target_groups[0], dtype=cfg.target.dtype,
                           reporter=reporter)
    folder = ckpt.fetch_weights()
    drafters = {}
    for name, where, path in (("dflash", f"checkpoint {ckpt.url}", folder), ("baseline", "eval.baseline "
                                                                                         f"{cfg.eval.baseline}",
                                                                             cfg.eval.baseline)):
        if path is None:
            continue
        try:
            drafter = DFlashDrafter.from_pretrained(path, device=cfg.placement.drafter_devices[0], dtype=hf_model.dtype)
            drafter.spec.check_target(hf_model.config)
        except (SpecError, ArtifactError) as exc:
            raise type(exc)(f"{where}: {exc}") from None  # the same error, naming which drafter it is about
        except (SafetensorError, json.JSONDecodeError) as exc:
            # bytes that are not the export format (a plain folder is not verified)
            raise ArtifactError(
                f"{where}: {Path(path) / (CONFIG_NAME if isinstance(exc, ValueError) else WEIGHTS_NAME)} is not "
                f"readable ({exc}); give a drafter folder in the export format"
            ) from None
        drafters[name] = drafter.eval()
    drafter = drafters.pop("dflash")
    prompts = chosen.ids
    vocab = drafter.spec.vocab_size
    bad = next((t for p in prompts for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        raise EvalError(f"prompt token id {bad} is outside the target's vocabulary (0..{vocab - 1}); the prompts were "
                        "tokenized for another model")
    return evaluate(
        hf_model, drafter, prompts, max_new_tokens, stop_token_ids(hf_model, tokenizer),
        divergence_tolerance(cfg.eval, next(hf_model.parameters()).dtype),
        untrained_seed=UNTRAINED_SEED if cfg.eval.untrained_baseline else None,
        reporter=reporter,
        baselines=drafters,
        sets=chosen.sets,
        sampled=cfg.eval,
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
    sets: Sequence[EvalSet] | None = None,
    sampled: EvalConfig | None = None,
) -> EvalReport:
    """Run target-only greedy, the DFlash drafter (a DFlash2 drafter's walk, and as `UNARY_NAME` its unary argmax), the
    n-gram baseline, (with `untrained_seed`) a freshly initialised
    drafter of the same shape, and each of `baselines` (other drafters by name, e.g. a published one) on every prompt;
    compare each speculative output with greedy. `sets`: the prompt sets `prompts` is made of, in order (None: one set,
    `prompts`); the report gives each its own figures beside those over every prompt. With `sampled` at a temperature
    above 0, the same drafters also decode at its sampling settings (`EvalReport.sampled`). The report's `checkpoint`,
    `target`, `prompts_source` and `template_sha256` are left None. Progress: ("eval", prompts done, prompts)."""
    reporter = reporter or Reporter()
    param = next(drafter.parameters())
    head = TargetHead.from_target(hf_model, device=param.device).to(param.dtype)
    spec = drafter.spec
    makers = {
        "dflash": lambda: DFlashProposer(drafter, head),
        "ngram": lambda: NgramProposer(spec.block_size, spec.mask_token_id),
    }
    if spec.dflash2 is not None:  # the same drafter without its selector: the walk's gain on these prompts
        makers[UNARY_NAME] = lambda: DFlashProposer(drafter, head, use_selector=False)
    if untrained_seed is not None:
        torch.manual_seed(untrained_seed)
        untrained = DFlashDrafter(spec).to(device=param.device, dtype=param.dtype).eval()
        makers["untrained"] = lambda: DFlashProposer(untrained, head)
    block_sizes = dict.fromkeys(makers, spec.block_size)
    for name, other in (baselines or {}).items():
        makers[name] = lambda other=other: DFlashProposer(other, head)
        block_sizes[name] = other.spec.block_size

    spans = _set_spans(sets, len(prompts))
    set_of = [name for name, _, _, (start, stop) in spans for _ in range(start, stop)]
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
        rows.append(PromptRow(index=index, prompt_set=set_of[index], prompt_len=len(prompt),
                              new_tokens=len(reference.new_tokens), **per_drafter))
        reporter.progress(STAGE, index + 1, len(prompts))

    greedy_summary = greedy_metrics(greedy)
    per_set = {}
    for name, layout, source, (start, stop) in spans:
        set_greedy = greedy_metrics(greedy[start:stop])
        per_set[name] = PromptSetMetrics(
            layout=layout, source=None if source is None else redact_setting(source), num_prompts=stop - start,
            greedy=set_greedy,
            drafters={n: with_speedup(acceptance_metrics(r[start:stop], block_sizes[n]), set_greedy)
                      for n, r in spec_results.items()},
            lossless=all(d.tolerated for d in divergences if start <= d.prompt_index < stop),
        )
    sampling = sampling_of(sampled) if sampled is not None else None
    at_temperature = None
    if sampled is not None and sampling is not None:
        at_temperature = evaluate_sampled(hf_model, makers, block_sizes, prompts, max_new_tokens, stops, sampled,
                                          sampling, reporter)
    return EvalReport(
        architecture=spec.architecture,
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.target_layer_ids),
        max_new_tokens=max_new_tokens,
        num_prompts=len(prompts),
        stop_token_ids=list(stops),
        target_dtype=str(next(hf_model.parameters()).dtype).removeprefix("torch."),
        greedy=greedy_summary,
        drafters={
            name: with_speedup(acceptance_metrics(results, block_sizes[name]), greedy_summary)
            for name, results in spec_results.items()
        },
        lossless=Lossless(ok=all(d.tolerated for d in divergences), tolerance=tolerance, divergences=divergences),
        prompts=rows,
        prompt_sets=per_set,
        sampled=at_temperature,
    )


def _set_spans(sets: Sequence[EvalSet] | None, count: int) -> list[tuple[str, str, str | None, tuple[int, int]]]:
    """(name, layout, source, (first prompt, end)) of each set; None: every prompt in one set of unnamed source."""
    if sets is None:
        return [(PLAIN, PLAIN, None, (0, count))]
    spans, start = [], 0
    for s in sets:
        spans.append((s.name, s.layout, s.source, (start, start + len(s.ids))))
        start += len(s.ids)
    assert start == count, "the sets hold exactly the prompts decoded"
    return spans


def _warm_up(hf_model: Any, proposer: DFlashProposer, prompt: list[int]) -> None:
    """One short run of each path first, so one-time costs (allocations, kernel selection) do not land in one timing."""
    greedy_decode(hf_model, prompt, 2)
    run_speculative(hf_model, proposer, prompt, 2)


def target_settings(resolved: dict[str, Any]) -> dict[str, Any]:
    """The resolved target section as eval depends on it: [target.engine] is how training reads the target's features,
    which no eval figure depends on, so it is left out of eval's keys."""
    return {key: value for key, value in resolved["target"].items() if key != "engine"}


def eval_settings_digest(cfg: BlockdraftConfig) -> str:
    """sha256 of the eval and target settings (`target_settings`) that the default eval folder is named by."""
    resolved = cfg.resolved()
    data = {"eval": resolved["eval"], "target": target_settings(resolved)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _default_output(cfg: BlockdraftConfig, ckpt: Checkpoint, prompts: EvalPrompts, max_new_tokens: int) -> str:
    """STORE/eval/<16 hex>: one folder per checkpoint (by content), prompt sets and their ids, length and eval/target
    settings."""
    sets = [[s.name, s.ids] for s in prompts.sets]
    key = json.dumps([ckpt.ref.sha256, sets, max_new_tokens, eval_settings_digest(cfg)]).encode()
    return f"{cfg.store.url.rstrip('/')}/eval/{hashlib.sha256(key).hexdigest()[:16]}"


def _output_key(
    cfg: BlockdraftConfig, checkpoint: str, prompts: EvalPrompts, max_new_tokens: int, ckpt: Checkpoint,
    served: Path | None
) -> str:
    """What the report depends on: the settings that change its figures or its fields, and both inputs by content.

    Placement is in it because devices change the timings and, in low precision, the near-ties; tokenize.thinking
    because it renders `messages` prompts. The prompts are also keyed as given, since the report records them so; the
    checkpoint by the URL its store opens (a relative path, an absolute one and its file:// URL are one), so another
    spelling of it finds this eval done instead of replacing it under the same default URL (which an export's card may
    cite).
    """
    resolved = cfg.resolved()
    settings = {
        "eval": {**resolved["eval"], "max_new_tokens": max_new_tokens},
        "target": target_settings(resolved),
        "placement": resolved["placement"],
        "thinking": resolved["tokenize"]["thinking"],
        "checkpoint": open_store(checkpoint, cfg.store).url,
        "prompts": prompts.sources,
        "baseline_sha256": _drafter_digest(cfg.eval.baseline, "eval.baseline"),
        "engine_export_sha256": _drafter_digest(str(served) if served else None, "--export"),
    }
    return stage_key(settings, [ckpt.ref, *prompts.refs])


def _drafter_digest(folder: str | None, role: str) -> str | None:
    """`drafter_folder_sha256` of the baseline or the export served by the engine (None: no such folder)."""
    return None if folder is None else drafter_folder_sha256(folder, role)


__all__ = ["KIND", "STAGE", "UNTRAINED_SEED", "evaluate", "run"]
