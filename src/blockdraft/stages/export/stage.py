"""`export`: a verified training checkpoint -> the z-lab drafter format that SGLang and vLLM load, as an artifact.

The export folder holds `config.json` + `model.safetensors` exactly as docs/DFLASH.md specifies (no embedding,
no LM head), `blockdraft-export.json` (the target, the resolved blockdraft config, the DFlash parameters, the
chat-template hash, thinking mode and data lineage the drafter was trained with), `serving.json` (the engine settings)
and `README.md` (the model card, `card.py`: the Hub's folder layout), and its manifest. `rewrite_card` writes the card
of an existing export again (after a new eval) through the store's `StageOutput.amend`. Without `--eval` the card gives
the latest verified eval of the checkpoint in the store (`evals.py`). The export's lineage pins what it read: the
checkpoint, and the eval its card gives (as a measured input: `status` says the export is stale when that eval is
replaced or no longer verifies, not when the eval's own prompts change).
The tensors are stored in the target's dtype (`target.dtype`, default the target config's own), as published drafters
are: SGLang under `--dtype auto` runs a drafter in the dtype its config.json names (float32 becoming float16), so an
fp32 export beside a bf16 target fails at the first request. The checkpoint keeps its fp32 master weights; only the
export casts.

It is written through `StageOutput` (docs/STORE.md, "Stage outputs and inputs"), keyed by the checkpoint (by content),
the target whose config it is checked against, the dtype and the location the serving settings name: a rerun with those
unchanged leaves the export as it is. What it pins (the resolved config, the target's name) passes `redact_settings`.
The card is a listed file that blockdraft alone writes: one edited by hand is refused in one line (`export.license` sets
the license), and a card rewrite that stops before its manifest is written is finished by `--card-only`.
"""

from __future__ import annotations

import json
import shlex
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoConfig

from blockdraft.config import BlockdraftConfig, StoreConfig
from blockdraft.errors import BlockdraftError, ExportError, redact_setting, redact_settings, safe_url
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.finite import describe_nonfinite, nonfinite_weights
from blockdraft.model.formats import (
    CONFIG_NAME,
    EXPORT_KIND,
    PINNED_CONFIG_NAME,
    PROVENANCE_NAME,
    SERVING_NAME,
    WEIGHTS_NAME,
    open_drafter_artifact,
    trained_on,
)
from blockdraft.model.spec import DFLASH, DFLASH2, DrafterSpec
from blockdraft.model.target import target_dtype
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.export.card import (
    CARD_NAME,
    DataSource,
    EvalSource,
    card_license,
    gives_eval,
    render_card,
)
from blockdraft.stages.export.evals import Held, latest_eval, open_eval
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import InputRef, State, VerifyReport, verify_artifact
from blockdraft.store.inputs import StageInput, open_input, recorded_manifest
from blockdraft.store.manifest import MEASURED
from blockdraft.store.output import StageOutput, refuse_nested, resume_amend, stage_key
from blockdraft.store.writable import os_error_of, require_folder, write_failed

STAGE = "export"
# 3: serving.json names the V2 model runner vLLM serves DFlash2 on (`vllm_env`)
PROVENANCE_FORMAT = "blockdraft-export/3"
# vLLM 0.32 serves a DFlash2 drafter only on its V2 model runner: its V1 runner refuses "DFlash candidate-head drafts".
VLLM_DFLASH2_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
VLLM_DFLASH2_NOTE = ("vLLM 0.32 serves a DFlash2 drafter only on its V2 model runner, whose candidate walk is a Triton "
                     "kernel (so a GPU); its V1 runner refuses the drafter.")


@dataclass
class ExportResult:
    """What an export holds beside the drafter: `serving` (serving.json: engine arguments and commands) and `provenance`
    (blockdraft-export.json: DFlash parameters, resolved config, data facts)."""

    serving: dict[str, Any]
    provenance: dict[str, Any]


def run(
    config: BlockdraftConfig, input: str, output: str, reporter: Reporter | None = None, *, force: bool = False,
    eval: str | None = None,
) -> StageResult:
    """Export the verified checkpoint at `input` (a folder or URL, or a training output holding step-* checkpoints) to
    `output` (a folder or s3:// URL); `details` is an ExportResult.

    `eval`: the eval artifact of this checkpoint whose figures the model card gives (refused when it is of another
    checkpoint); without it, the latest verified eval of this checkpoint in `config.store` (`latest_eval`), else the
    card says none was found. An export already done keeps its files; its card is rewritten (`rewrite_card`) from
    `eval` when given, else from the eval found when the card does not give that one already.

    The target model's config is read from `config.target.path` (`export --target`), else the target.path pinned in the
    checkpoint; the tensors are stored in `config.target.dtype`, default that target config's own dtype.
    Raises ArtifactError for an input that is not a verified drafter, ExportError for an inconsistent checkpoint or an
    unreadable target, SpecError for a drafter the target contradicts.
    """
    started = time.perf_counter()
    reporter = reporter or Reporter()
    in_store, out_store = open_store(input, config.store), open_store(output, config.store)
    require_folder(out_store, "export destination", "export into a folder")
    refuse_nested(in_store, out_store, "checkpoint")
    checkpoint = open_drafter_artifact(in_store)
    with tempfile.TemporaryDirectory(prefix="blockdraft-ckpt-") as tmp:
        resolved = redact_settings(_pinned_config(checkpoint, Path(tmp)))  # what the export pins names no credential
        target_path = config.target.path or resolved["target"]["path"]
        if not target_path:
            raise ExportError("neither the config nor the checkpoint names target.path; pass --target with the target "
                              "model's folder or hub id")
        target_config = _target_config(target_path)
        dtype = target_dtype(config.target.dtype, target_config)
        target = redact_setting(target_path)  # the target as the export names it (provenance, card, serving, key)
        key = {"target": target, "location": output, "dtype": dtype}
        out = StageOutput(out_store, EXPORT_KIND, stage_key(key, [checkpoint.ref]), force=force, reporter=reporter)
        done = out.done()
        if done is None:  # before the eval is looked for: a card edited by hand is the one line said
            refuse_edited_card(out.store, force, reporter)
        found = Held()  # which eval the card gives, said once the export is written or found done
        if eval:
            evaluation = open_eval(eval, checkpoint.ref, config.store, Path(tmp) / "eval", target)
        else:
            evaluation = latest_eval(checkpoint.ref, config.store, Path(tmp) / "eval", found, target)
        if done is not None:
            found.replay(reporter)
        if done is not None and eval is not None:
            reporter.say(f"{out.url} already holds the export of this checkpoint for this target; rewriting its card "
                         f"from {eval}")
            return rewrite_card(config, output, reporter, eval=eval, force=force)
        card = _stored_card(out) if done is not None else None
        if card is not None and config.export.license not in (None, card_license(card)):
            reporter.say(f"{out.url} already holds the export of this checkpoint for this target; rewriting its card "
                         f"with license {config.export.license}")
            return rewrite_card(config, output, reporter, eval=evaluation.url if evaluation else None, force=force)
        if card is not None and evaluation is not None and not gives_eval(card, evaluation):
            # The store holds a newer eval of this checkpoint than the one the card gives (or the card gives none).
            reporter.say(f"{out.url} already holds the export of this checkpoint for this target; rewriting its card "
                         f"from {evaluation.url}")
            return rewrite_card(config, output, reporter, eval=evaluation.url, force=force)
        if done is not None:
            reporter.say(f"{out.url} already holds the export of this checkpoint for this target; nothing written")
            return StageResult(STAGE, out.url, done, already_done=True, seconds=time.perf_counter() - started,
                               details=_stored(out))
        drafter = DFlashDrafter.from_pretrained(checkpoint.fetch([CONFIG_NAME, WEIGHTS_NAME], Path(tmp)))
    dflash = resolved["dflash"]
    _check_pinned(drafter.spec, dflash)
    with _one_line_write_errors():
        result = export_drafter(
            drafter,
            target_config,
            out,
            resolved_config=resolved,
            lineage=export_lineage(checkpoint.ref, evaluation),
            data_lineage=trained_on(checkpoint.manifest),  # not train.eval_data, pinned after it
            gamma=dflash["gamma"],
            location=output,
            target_path=target_path,
            store_config=config.store,
            dtype=dtype,
            evaluation=evaluation,
            license=config.export.license,
        )
    found.replay(reporter)
    result.seconds = time.perf_counter() - started
    return result


def export_drafter(
    drafter: DFlashDrafter,
    target_config: Any,
    out: StageOutput,
    resolved_config: dict[str, Any] | None = None,
    lineage: list[InputRef] | None = None,
    data_lineage: list[InputRef] | None = None,
    gamma: float | None = None,
    location: str | None = None,
    target_path: str | None = None,
    store_config: StoreConfig | None = None,
    dtype: str | None = None,
    evaluation: EvalSource | None = None,
    license: str | None = None,
) -> StageResult:
    """Check the drafter against the target's HF config, write the export files to `out`, commit them as an artifact.

    Refuses (SpecError) a mask id >= the target's embedding rows, layer ids outside the target, a hidden size that
    differs, and (ExportError) weights that hold NaN or infinite values, before anything is written. `lineage` pins the
    export's inputs (the checkpoint); `data_lineage` (the checkpoint's own inputs: the tokenized data) is described in
    blockdraft-export.json with the template and thinking fields of those inputs' manifests. `location` is where the
    drafter will be found (default: the output's URL): the serving settings name it, or for a store URL a local folder
    with the pull step. `dtype` is the stored dtype (None: `target_dtype`). `evaluation`: the eval whose figures the
    model card gives (None: the card says no eval was found); `license`: the card's (`export.license`). The target and
    the config are pinned as `redact_settings` writes them: no credential.
    """
    spec = drafter.spec
    spec.check_target(target_config)
    if bad := nonfinite_weights(drafter):  # a diverged drafter would verify and serve garbage
        raise ExportError(f"the drafter to export is not finite: {describe_nonfinite(bad)}; export a checkpoint of a "
                          "run that did not diverge (retrain with a lower train.lr)")
    dtype = target_dtype(dtype, target_config)
    endpoint = store_config.endpoint_url if store_config is not None else None
    target = redact_setting(target_path) if target_path else None
    serving = serving_settings(location or out.url, spec.block_size, target, dtype, endpoint, spec.architecture)
    provenance = {
        "format": PROVENANCE_FORMAT,
        "target": target,
        "dtype": dtype,
        "dflash": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
            "block_size": spec.block_size,
            "num_target_layers": spec.num_target_layers,
            "layer_types": list(spec.layer_types),
            "sliding_window": spec.sliding_window,
            "rope_scaling": spec.rope_scaling,
            "gamma": gamma,
            "architecture": spec.architecture,
            **(asdict(spec.dflash2) if spec.dflash2 is not None else {}),
        },
        "config": redact_settings(resolved_config or {}),
        "data": _data_facts(list(data_lineage or []), store_config),
    }
    out.begin()
    try:
        with tempfile.TemporaryDirectory(prefix="blockdraft-export-") as tmp:
            root = Path(tmp)
            paths = drafter.save_pretrained(root, dtype=getattr(torch, dtype))
            for name, payload in ((PROVENANCE_NAME, provenance), (SERVING_NAME, serving)):
                (root / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
                paths.append(root / name)
            counts = {"tensors": len(drafter.state_dict()), "parameters": sum(p.numel() for p in drafter.parameters())}
            card = render_card(
                target or "TARGET_MODEL", location or out.url, json.loads((root / CONFIG_NAME).read_text()), provenance,
                serving, counts, evaluation, verified_data(list(data_lineage or []), store_config), license,
            )
            (root / CARD_NAME).write_text(card)
            paths.append(root / CARD_NAME)
            report = out.publish(root, paths, config=resolved_config or {}, lineage=lineage or [], counts=counts)
    finally:
        out.release()  # a failed write gives the lease back too (a commit already did)
    return StageResult(STAGE, out.url, report, details=ExportResult(serving, provenance))


@contextmanager
def _one_line_write_errors() -> Iterator[None]:
    """A write the export's folders refuse (a full disk, a folder it may not write: the temp folder the files are made
    in, or a local destination) is one StoreError line; the temp files are gone by then and no manifest was written."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        error = os_error_of(exc)
        # a copy names its destination second
        written = (error.filename2 or error.filename) if error is not None else None
        # safetensors names no path: the temp folder
        folder = Path(written).parent if written else tempfile.gettempdir()
        failed = write_failed(exc, folder, "rerun the export (nothing was committed)")
        if failed is None:
            raise
        raise failed from None


def drafter_folder(location: str) -> tuple[str, bool]:
    """(the local folder the engines are given, whether it must be pulled first) for a drafter at `location`.

    The engines take a local folder or a hub id, never a URL: a local export (a path or file:// URL) is named by its
    absolute path; a store URL (s3://...) by `./NAME`, NAME its last path segment, which `blockdraft pull` fills."""
    if location.startswith("file://"):
        return str(Path(location.removeprefix("file://")).absolute()), False
    if "://" in location:
        name = PurePosixPath(location.split("://", 1)[1].rstrip("/")).name or "drafter"
        return f"./{name}", True
    return str(Path(location).absolute()), False


def serving_settings(
    location: str, block_size: int, target: str | None = None, dtype: str = "float32", endpoint_url: str | None = None,
    architecture: str = DFLASH,
) -> dict[str, Any]:
    """Engine settings for a drafter at `location` (a folder or URL) with block size B, beside a target running in
    `dtype`.

    SGLang drafts B tokens per block and gets `--dtype` (under `auto` it would take the drafter's dtype from
    config.json); vLLM counts B-1 and casts the drafter to the target's dtype itself. `pull_command` (None for a local
    export) fetches a store export into `drafter_dir`, the folder both commands name; `endpoint_url` is the S3 endpoint
    it needs, if any. Both engines serve a DFlash2 drafter with the DFlash command (config.json's architecture selects
    it); vLLM only on its V2 model runner: `vllm_env` (set in `vllm_command`) and `vllm_note` say so, empty and None for
    DFlash."""
    folder, pull = drafter_folder(location)
    sglang = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", folder,
              "--speculative-num-draft-tokens", str(block_size), "--dtype", dtype]
    vllm = {"method": "dflash", "model": folder, "num_speculative_tokens": block_size - 1}
    model = target or "TARGET_MODEL"
    # stored in the export: no credentials
    endpoint = ["--endpoint-url", safe_url(endpoint_url)] if endpoint_url else []
    env = dict(VLLM_DFLASH2_ENV) if architecture == DFLASH2 else {}
    return {
        "export_url": location if pull else f"file://{folder}",
        "drafter_dir": folder,
        "pull_command": shlex.join(["blockdraft", "pull", location, folder, *endpoint]) if pull else None,
        "dtype": dtype,
        "sglang_args": shlex.join(sglang),
        "vllm_speculative_config": vllm,
        "vllm_env": env,
        "vllm_note": VLLM_DFLASH2_NOTE if env else None,
        "sglang_command": shlex.join(["python", "-m", "sglang.launch_server", "--model-path", model, *sglang]),
        "vllm_command": shlex.join([*(f"{k}={v}" for k, v in env.items()), "vllm", "serve", model,
                                    "--speculative-config", json.dumps(vllm)]),
    }


def serving_lines(serving: dict[str, Any]) -> list[str]:
    """The serving settings as printed: the pull step first when the export is at a store URL, then both commands."""
    pull = [f"Pull:   {serving['pull_command']}"] if serving.get("pull_command") else []
    return [*pull, f"SGLang: {serving['sglang_command']}", f"vLLM:   {serving['vllm_command']}"]


def _pinned_config(checkpoint: StageInput, dest: Path) -> dict[str, Any]:
    """The resolved config the drafter was trained with, as its checkpoint pins it; ExportError for an artifact without
    it."""
    if PINNED_CONFIG_NAME not in {e.path for e in checkpoint.manifest.files}:
        raise ExportError(
            f"{checkpoint.store.url} lists no {PINNED_CONFIG_NAME}: it is not a blockdraft training checkpoint; pass a "
            "checkpoint or training output that `blockdraft train` wrote"
        )
    return json.loads((checkpoint.fetch([PINNED_CONFIG_NAME], dest) / PINNED_CONFIG_NAME).read_text())


def _check_pinned(spec: DrafterSpec, dflash: dict[str, Any]) -> None:
    """The checkpoint's resolved config and its config.json must agree on what the engines read."""
    pinned = {"mask_token_id": spec.mask_token_id, "target_layer_ids": spec.target_layer_ids,
              "block_size": spec.block_size,
              "layer_types": spec.layer_types, "sliding_window": spec.sliding_window, "architecture": spec.architecture}
    if spec.dflash2 is not None:
        pinned.update(asdict(spec.dflash2))
    for name, value in pinned.items():
        if dflash.get(name) is not None and dflash[name] != value:
            raise ExportError(
                f"checkpoint is inconsistent: dflash.{name} is {dflash[name]} in its {PINNED_CONFIG_NAME} but {value} "
                f"in its {CONFIG_NAME}; re-save the checkpoint from training"
            )


def _target_config(target_path: str) -> Any:
    try:
        return AutoConfig.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"cannot read the target's config at {target_path} ({type(exc).__name__}); pass --target PATH"
        ) from None


def _data_facts(lineage: list[InputRef], store_config: StoreConfig | None) -> list[dict[str, Any]]:
    """Per input artifact: its URL and pin, plus every template/thinking field its manifest records (config or
    counts)."""

    def find(tree: Any, prefix: str = "") -> dict[str, Any]:
        found: dict[str, Any] = {}
        if isinstance(tree, dict):
            for key, value in tree.items():
                name = f"{prefix}{key}"
                if "template" in key or "thinking" in key:
                    found[name] = value
                else:
                    found.update(find(value, name + "."))
        return found

    facts = []
    for ref in lineage:
        entry: dict[str, Any] = ref.model_dump(exclude_none=True)
        if ref.kind == "manifest":
            try:
                manifest = recorded_manifest(open_store(ref.url, store_config))
            except Exception as exc:  # provenance is best effort; the pin (sha256) is recorded either way
                entry["unreadable"] = type(exc).__name__
            else:
                if manifest is not None:
                    entry["kind_of_input"] = manifest.kind
                    entry.update(find({"config": manifest.config, "counts": manifest.counts}))
                    entry["inputs"] = _data_facts(manifest.lineage, store_config)
        facts.append(entry)
    return facts


def verified_data(lineage: list[InputRef], store_config: StoreConfig | None) -> list[DataSource]:
    """Each training data input, with its manifest's counts and tokenize settings when it verifies here with the very
    manifest the checkpoint pinned; else the reason its figures are left out."""
    sources = []
    for ref in lineage:
        source = DataSource(ref.url, ref.sha256)
        if ref.kind != "manifest":
            source.why = "a file without a manifest"
        else:
            try:
                found = open_input(ref.url, store_config)
            except (BlockdraftError, OSError):
                source.why = "it does not verify from here"
            else:
                if found.ref.sha256 != ref.sha256:
                    source.why = "it changed since the checkpoint was trained on it"
                else:
                    source.counts, source.run = (
                        dict(found.manifest.counts),
                        dict(found.manifest.config.get("tokenize_run") or {}),
                    )
        sources.append(source)
    return sources


def rewrite_card(
    config: BlockdraftConfig, export: str, reporter: Reporter | None = None, *, eval: str | None = None,
    force: bool = False,
) -> StageResult:
    """Write the model card of the verified export at `export` again, from `eval` (an eval of the exported checkpoint
    against its target; None: the latest verified eval of it in `config.store`, `latest_eval`), the training data as it
    verifies now and the license `export.license` names (None: the one the card gives now, when it verifies);
    an export a stopped rewrite left without its manifest is finished, a card edited by hand refused unless `force`;
    every other file stays as committed and the manifest is rewritten through `StageOutput.amend`. `details` is the
    export's ExportResult."""
    started = time.perf_counter()
    reporter = reporter or Reporter()
    current = _export_to_rewrite(export, config, reporter, force)
    with tempfile.TemporaryDirectory(prefix="blockdraft-card-") as tmp:
        root = Path(tmp) / "card"
        folder = current.fetch([CONFIG_NAME, PROVENANCE_NAME, SERVING_NAME], Path(tmp) / "export")
        provenance = json.loads((folder / PROVENANCE_NAME).read_text())
        if provenance.get("format") != PROVENANCE_FORMAT:
            raise ExportError(
                f"{current.store.url}'s {PROVENANCE_NAME} is format {provenance.get('format')!r}, not "
                f"{PROVENANCE_FORMAT!r}: an older blockdraft wrote it; export the checkpoint again (blockdraft export "
                "CHECKPOINT OUT --force)"
            )
        if not current.manifest.lineage:
            raise ExportError(f"{current.store.url} records no checkpoint it was exported from; export the checkpoint "
                              "again")
        checkpoint = current.manifest.lineage[0]
        target = provenance.get("target")
        found = Held()  # which eval the card gives, said once the card is written
        if eval:
            evaluation = open_eval(eval, checkpoint, config.store, Path(tmp) / "eval", target)
        else:
            evaluation = latest_eval(checkpoint, config.store, Path(tmp) / "eval", found, target)
        data = [InputRef(**{k: e[k] for k in InputRef.model_fields if k in e}) for e in provenance.get("data", [])]
        serving = json.loads((folder / SERVING_NAME).read_text())
        card = render_card(
            provenance["target"], current.store.url, json.loads((folder / CONFIG_NAME).read_text()), provenance,
            serving, dict(current.manifest.counts), evaluation, verified_data(data, config.store),
            config.export.license or _license_now(current),
        )
        root.mkdir()
        (root / CARD_NAME).write_text(card)
        with _one_line_write_errors():
            writer = StageOutput.amending(current, force=force, reporter=reporter)
            report = writer.amend(current, root, [root / CARD_NAME], lineage=export_lineage(checkpoint, evaluation))
    found.replay(reporter)
    return StageResult(STAGE, current.store.url, report, seconds=time.perf_counter() - started,
                       details=ExportResult(serving, provenance))


def export_lineage(checkpoint: InputRef, evaluation: EvalSource | None) -> list[InputRef]:
    """What an export read, for its lineage: the checkpoint (first: what it was exported from), then the eval whose
    figures its card gives, as a measured input, so replacing that eval makes the export stale."""
    if evaluation is None:
        return [checkpoint]
    return [checkpoint, InputRef(kind=MEASURED, url=evaluation.url, sha256=evaluation.manifest_sha256)]


def _export_to_rewrite(export: str, config: BlockdraftConfig, reporter: Reporter, force: bool) -> StageInput:
    """The export whose card `rewrite_card` writes: a verified one; one a card rewrite left without its manifest when it
    stopped (Ctrl-C, a crash), whose other files verify against the manifest it was amending (`resume_amend`): this
    rewrite finishes it; with `force`, one whose card alone no longer verifies (edited by hand), whose card it replaces.
    Anything else is refused as `open_input` refuses it."""
    store = open_store(export, config.store)
    resumed = resume_amend(store, EXPORT_KIND, [CARD_NAME])
    if resumed is not None:
        reporter.say(f"{store.url}: a rewrite of its card stopped before writing its manifest, and every other file "
                     "verifies against the manifest it replaced; finishing it")
        return resumed
    report = verify_artifact(store)
    if edited_card(report):
        refuse_edited_card(store, force, reporter, report)
        return StageInput(store, report)
    if report.state is State.VERIFIED and report.manifest is not None and report.manifest.kind == EXPORT_KIND:
        return StageInput(store, report)
    return open_input(store, kinds=[EXPORT_KIND], role="export")  # its one line for what else it is


def edited_card(report: VerifyReport) -> bool:
    """Whether `report` is of an export whose card alone does not verify: a README.md edited since it was written."""
    problems = report.problems
    return (report.state is State.CORRUPT and report.manifest is not None and report.manifest.kind == EXPORT_KIND
            and bool(problems) and all(p.path == CARD_NAME and p.state is State.CORRUPT for p in problems))


def refuse_edited_card(store: Store, force: bool, reporter: Reporter, report: VerifyReport | None = None) -> None:
    """ExportError (one line naming the fix) when the export at `store` holds a card edited by hand; with `force` a line
    says it is replaced. A card the user edited is theirs: it is never replaced without a word."""
    if not edited_card(report or verify_artifact(store)):
        return
    url = store.url.rstrip("/")
    if force:
        reporter.say(f"{url}/{CARD_NAME} was edited by hand; --force: writing the card again over it")
        return
    raise ExportError(
        f"{url}/{CARD_NAME} is not the card this export wrote (edited by hand?), so the export no longer verifies; "
        "blockdraft writes that file: set the license with export.license and write the card again with `blockdraft "
        f"export --card-only {url} --license LICENSE --force` (--force replaces your edits: keep a copy of anything "
        "else you added)"
    )


def _license_now(current: StageInput) -> str | None:
    """The license the export's card gives now, read only when the card verifies (a card edited by hand, or one a
    stopped rewrite left, is not read)."""
    if current.report.state is not State.VERIFIED or CARD_NAME not in {e.path for e in current.manifest.files}:
        return None
    with tempfile.TemporaryDirectory(prefix="blockdraft-card-") as tmp:
        return card_license((current.fetch([CARD_NAME], Path(tmp)) / CARD_NAME).read_text())


def _stored_card(out: StageOutput) -> str | None:
    """The model card of an export that is already done (verified), or None for an export made before the card was."""
    return out.store.read_bytes(CARD_NAME).decode() if out.store.exists(CARD_NAME) else None


def _stored(out: StageOutput) -> ExportResult:
    """The ExportResult of an export that is already done, read from its (verified) files."""
    return ExportResult(json.loads(out.store.read_bytes(SERVING_NAME)),
                        json.loads(out.store.read_bytes(PROVENANCE_NAME)))


__all__ = [
    "SERVING_NAME", "STAGE", "ExportResult", "drafter_folder", "export_drafter", "export_lineage", "rewrite_card",
    "run", "serving_lines", "serving_settings", "verified_data",
]
