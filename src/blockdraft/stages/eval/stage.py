"""The `eval` stage: real greedy speculative decoding of held-out prompts, checked token for token against target-only
greedy decoding, with acceptance metrics, the n-gram baseline, an untrained-drafter baseline and wall-clock speedup.

Output: an `eval` artifact holding `report.json`, `tau_histogram.png` and `position_acceptance.png`, committed through
the artifact core (manifest last, verified at the destination).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from blockdraft.config import BlockdraftConfig
from blockdraft.decode.cached_target import check_rollback_supported
from blockdraft.decode.ngram import NgramProposer
from blockdraft.decode.speculative import (
    DFlashProposer,
    GreedyResult,
    SpecResult,
    greedy_generate,
    run_speculative,
)
from blockdraft.errors import ArtifactError, ConfigError, DecodeError, EvalError
from blockdraft.model.formats import PINNED_CONFIG_NAME
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import InputRef, State, VerifyReport, publish_artifact, raw_input, uncommit, verify_artifact

REPORT_NAME = "report.json"
TAU_PLOT_NAME = "tau_histogram.png"
POSITION_PLOT_NAME = "position_acceptance.png"
UNTRAINED_SEED = 0



# ---------------------------------------------------------------------------------------------------------------------
# Comparing outputs


@dataclass
class Divergence:
    """Where a speculative output first departs from target-only greedy output.

    `position` is the absolute token index; `margin` the target's top-2 logit gap there in the greedy run (a near-tie
    when tiny); `tolerated` whether that margin is within the dtype's tolerance.
    """

    drafter: str
    prompt_index: int
    position: int
    new_token_index: int
    spec_token: int | None
    target_token: int | None
    margin: float
    tolerated: bool


def first_divergence(
    drafter: str, prompt_index: int, spec: SpecResult, greedy: GreedyResult, tolerance: float
) -> Divergence | None:
    """The first position where `spec.tokens` and `greedy.tokens` differ, or None when they are identical.

    Once two greedy sequences differ, every later position conditions on different text, so only the first
    difference says anything about the decode loop.
    """
    a, b = spec.tokens, greedy.tokens
    if a == b:
        return None
    common = min(len(a), len(b))
    position = next((i for i in range(common) if a[i] != b[i]), common)
    new_index = position - greedy.prompt_len
    margin = greedy.margins[new_index] if 0 <= new_index < len(greedy.margins) else float("inf")
    return Divergence(
        drafter=drafter,
        prompt_index=prompt_index,
        position=position,
        new_token_index=new_index,
        spec_token=a[position] if position < len(a) else None,
        target_token=b[position] if position < len(b) else None,
        margin=margin,
        tolerated=margin <= tolerance,
    )


def divergence_tolerance(cfg: BlockdraftConfig, dtype: torch.dtype) -> float:
    """The largest top-2 margin at which a divergence still counts as a rounding near-tie for this target dtype."""
    return cfg.eval.divergence_margin_fp32 if dtype == torch.float32 else cfg.eval.divergence_margin_bf16


# ---------------------------------------------------------------------------------------------------------------------
# Metrics


def acceptance_metrics(results: Sequence[SpecResult], block_size: int) -> dict[str, Any]:
    """Acceptance and cost of one drafter over many prompts.

    tau: mean of (accepted + 1) over every cycle of every prompt. histogram[j]: cycles that committed j tokens (1..B).
    position_acceptance[k-1]: fraction of cycles whose draft k was accepted (k = 1..B-1); conditional_acceptance[k-1]:
    the same among cycles that reached draft k. target_forwards_per_token: (prefill + verifies) / new tokens.
    """
    lengths = [n for r in results for n in r.acceptance_lengths]
    cycles = len(lengths)
    new_tokens = sum(len(r.new_tokens) for r in results)
    wall = sum(r.wall_s for r in results)
    histogram = {str(j): sum(1 for n in lengths if n == j) for j in range(1, block_size + 1)}
    reached = [sum(1 for n in lengths if n - 1 >= k) for k in range(0, block_size)]  # reached[k]: cycles with a >= k
    position = [reached[k] / cycles if cycles else 0.0 for k in range(1, block_size)]
    conditional = [reached[k] / reached[k - 1] if reached[k - 1] else 0.0 for k in range(1, block_size)]
    return {
        "tau": sum(lengths) / cycles if cycles else 0.0,
        "cycles": cycles,
        "histogram": histogram,
        "position_acceptance": position,
        "conditional_acceptance": conditional,
        "new_tokens": new_tokens,
        "target_forwards": sum(r.target_forwards for r in results),
        "target_forwards_per_token": sum(r.target_forwards for r in results) / new_tokens if new_tokens else 0.0,
        "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall else 0.0,
        "draft_s": sum(c.draft_s for r in results for c in r.cycles),
        "verify_s": sum(c.verify_s for r in results for c in r.cycles),
    }


def greedy_metrics(results: Sequence[GreedyResult]) -> dict[str, Any]:
    new_tokens = sum(len(r.new_tokens) for r in results)
    wall = sum(r.wall_s for r in results)
    forwards = sum(r.target_forwards for r in results)
    return {
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "target_forwards_per_token": forwards / new_tokens if new_tokens else 0.0,
        "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall else 0.0,
        "min_margin": min((m for r in results for m in r.margins), default=None),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint: fetch, verify, check against the given config


@dataclass
class Checkpoint:
    """A verified checkpoint or export artifact, its drafter files available in a local folder."""

    url: str
    folder: Path
    pinned: dict[str, Any]  # the resolved config the drafter was trained with
    export_config: dict[str, Any]  # the drafter's config.json
    lineage: InputRef
    template_sha256: str | None  # of the chat template its training rows were rendered with, from the data's manifest


def _fetch(store: Store, report: VerifyReport, dest: Path, names: Sequence[str]) -> None:
    """Copy the listed files of a verified remote artifact, checking each one's CRC64NVME on the bytes received."""
    listed = {e.path: e for e in report.manifest.files}
    for name in names:
        entry = listed[name]
        size, checksum = store.get_file(name, dest / name)
        if size != entry.size or checksum != entry.checksum:
            (dest / name).unlink(missing_ok=True)
            raise ArtifactError(f"{store.url}/{name} changed while downloading (size {size}, crc64nvme {checksum}); retry")


def open_checkpoint(url: str, cfg: BlockdraftConfig, workdir: Path) -> Checkpoint:
    """The verified drafter at `url` (folder, file:// or s3://): a training checkpoint, a training run's output (its
    newest verified step-* checkpoint) or an export; its drafter files are fetched with checksums when remote."""
    from blockdraft.model.drafter import CONFIG_NAME, WEIGHTS_NAME
    from blockdraft.model.formats import CHECKPOINT_KIND, EXPORT_KIND, PROVENANCE_NAME, open_drafter_artifact

    try:
        store, report = open_drafter_artifact(open_store(url, cfg.store))
    except ArtifactError as exc:
        raise EvalError(str(exc)) from None
    lineage = InputRef(kind="manifest", url=store.url, sha256=report.manifest_sha256)
    kind = report.manifest.kind
    pinned_name = {CHECKPOINT_KIND: PINNED_CONFIG_NAME, EXPORT_KIND: PROVENANCE_NAME}[kind]
    needed = [CONFIG_NAME, WEIGHTS_NAME, pinned_name]
    absent = [n for n in needed if n not in {e.path for e in report.manifest.files}]
    if absent:
        raise EvalError(f"{store.url} lacks {absent[0]}; re-save it with `blockdraft train` or `blockdraft export`")
    folder = store.local_path()
    if folder is None:
        folder = workdir / "checkpoint"
        _fetch(store, report, folder, needed)
    pinned = json.loads((folder / pinned_name).read_text())
    if kind == EXPORT_KIND:
        pinned = pinned.get("config") or {}
    return Checkpoint(
        url=store.url,
        folder=folder,
        pinned=pinned,
        export_config=json.loads((folder / CONFIG_NAME).read_text()),
        lineage=lineage,
        template_sha256=(pinned.get("data") or {}).get("template_sha256"),
    )


def chat_template_sha256(cfg: BlockdraftConfig) -> str | None:
    """sha256 of the chat template the config resolves to, computed as the tokenize stage does; None when there is none."""
    from blockdraft.data.tokenizer import resolve_tokenizer

    try:
        source, _ = resolve_tokenizer(cfg, None, None)
    except (ConfigError, OSError, ValueError):
        return None
    return source.template.sha256


def check_checkpoint_matches(cfg: BlockdraftConfig, checkpoint: Checkpoint, hf_config: Any) -> None:
    """Refuse a checkpoint whose pinned DFlash settings or chat template contradict the config given, naming the field.

    Compared: what the given config resolves to for this target (explicit values, else docs/DFLASH.md's defaults) against
    what the drafter was trained with (its config.json, and the resolved config pinned beside it). A field the given
    config leaves unset without a default (mask id) is taken from the checkpoint.
    """
    from blockdraft.errors import SpecError
    from blockdraft.model.spec import TargetShape, default_layer_ids, hybrid_layer_ids

    dflash = checkpoint.export_config.get("dflash_config") or {}
    pinned_dflash = checkpoint.pinned.get("dflash") or {}
    trained = {
        "dflash.mask_token_id": dflash.get("mask_token_id"),
        "dflash.target_layer_ids": dflash.get("target_layer_ids"),
        "dflash.block_size": dflash.get("block_size", checkpoint.export_config.get("block_size")),
    }
    for field, value in trained.items():
        name = field.split(".", 1)[1]
        pinned_value = pinned_dflash.get(name)
        if pinned_value is not None and value is not None and pinned_value != value:
            raise EvalError(
                f"checkpoint {checkpoint.url} is inconsistent: {field} is {pinned_value} in {PINNED_CONFIG_NAME} but {value} "
                "in the drafter's config.json; re-export the checkpoint"
            )
    given_ids = cfg.dflash.target_layer_ids
    if given_ids is None:
        shape = TargetShape.from_config(hf_config)
        try:
            if shape.is_hybrid:
                given_ids = hybrid_layer_ids(shape.layer_types, cfg.dflash.num_draft_layers)
            else:
                given_ids = default_layer_ids(shape.num_layers, cfg.dflash.num_draft_layers)
        except SpecError as exc:
            raise EvalError(str(exc)) from None
    given = {
        "dflash.mask_token_id": cfg.dflash.mask_token_id,
        "dflash.target_layer_ids": list(given_ids),
        "dflash.block_size": cfg.dflash.block_size,
    }
    for field, value in given.items():
        if value is not None and trained[field] is not None and value != trained[field]:
            raise EvalError(
                f"checkpoint {checkpoint.url} was trained with {field} = {trained[field]}, but the config given resolves it to "
                f"{value}; set {field} = {trained[field]} in the config (or evaluate a checkpoint trained with this config)"
            )
    if checkpoint.template_sha256 is not None:
        given_hash = chat_template_sha256(cfg)
        if given_hash is not None and given_hash != checkpoint.template_sha256:
            raise EvalError(
                f"checkpoint {checkpoint.url} was trained on rows rendered with chat template sha256 {checkpoint.template_sha256[:12]}, "
                f"but the config given resolves the template (target.chat_template) to sha256 {given_hash[:12]}; set "
                "target.chat_template to the template the drafter was trained with"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Prompts


def load_tokenizer(cfg: BlockdraftConfig):
    """The target's tokenizer (target.tokenizer, else target.path), or None when that folder has none."""
    from transformers import AutoTokenizer

    source = cfg.target.tokenizer or cfg.target.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None
    if cfg.target.chat_template:
        tokenizer.chat_template = Path(cfg.target.chat_template).read_text()
    return tokenizer


def _render_prompt(row: dict[str, Any], tokenizer, cfg: BlockdraftConfig, where: str) -> list[int]:
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise EvalError(f"{where}: input_ids must be a non-empty list of integers")
        return ids
    if tokenizer is None:
        raise EvalError(f"{where}: text prompts need a tokenizer, and none loads from the target; give input_ids or set target.tokenizer")
    if "messages" in row:
        kwargs = {}
        thinking = row.get("enable_thinking")
        if thinking is None and cfg.tokenize.thinking != "auto":
            thinking = cfg.tokenize.thinking == "on"
        if thinking is not None:
            kwargs["enable_thinking"] = bool(thinking)
        try:
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # a template raising on a malformed conversation is a bad prompt, not a bug here
            raise EvalError(f"{where}: the chat template rejects these messages ({exc}); fix the prompt") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(row.get("prompt"), str):
        return tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    raise EvalError(f"{where}: a prompt row needs 'input_ids', 'messages' or 'prompt'")


def prompts_from_jsonl(path: Path, tokenizer, cfg: BlockdraftConfig, limit: int) -> list[list[int]]:
    """Prompt token ids from a JSONL file: one object per line with `input_ids`, `messages` (rendered with the target's
    chat template and a generation prompt) or `prompt` (raw text)."""
    prompts: list[list[int]] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path.name} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalError(f"{where} is not valid JSON ({exc.msg}); fix that line") from None
            if not isinstance(row, dict):
                raise EvalError(f"{where} is not a JSON object; give one prompt object per line")
            prompts.append(_render_prompt(row, tokenizer, cfg, where))
            if len(prompts) >= limit:
                break
    return prompts


def _held_out_rows(root: Path):
    """The non-train rows of a tokenized artifact in `datasets.save_to_disk` layout (split column or DatasetDict)."""
    from datasets import Dataset, DatasetDict, concatenate_datasets, load_from_disk

    for candidate in (root, *sorted(p for p in root.iterdir() if p.is_dir())):
        if (candidate / "dataset_dict.json").is_file() or (candidate / "state.json").is_file():
            if candidate != root and candidate.name == "train":
                continue
            ds = load_from_disk(str(candidate))
            if isinstance(ds, DatasetDict):
                held = [ds[name] for name in ds if name != "train"]
                return concatenate_datasets(held) if held else None
            assert isinstance(ds, Dataset)
            if "split" in ds.column_names:
                return ds.filter(lambda s: s != "train", input_columns="split")
            if candidate != root:
                return ds
    return None


def prompts_from_tokenized(url: str, cfg: BlockdraftConfig, limit: int, workdir: Path) -> tuple[list[list[int]], InputRef]:
    """Prompts from the held-out split of a verified tokenized artifact: each row's ids before its first supervised token."""
    store = open_store(url, cfg.store)
    report = verify_artifact(store)
    if report.state is not State.VERIFIED:
        raise ArtifactError(f"prompts artifact {url} is {report.state.value}: {report.summary()}; fix or regenerate it first")
    lineage = InputRef(kind="manifest", url=store.url, sha256=report.manifest_sha256)
    local = store.local_path()
    if local is None:
        local = workdir / "prompts"
        _fetch(store, report, local, [e.path for e in report.manifest.files])
    ds = _held_out_rows(local)
    if ds is None or len(ds) == 0:
        raise EvalError(f"tokenized artifact {url} has no held-out rows; tokenize with tokenize.held_out_fraction > 0 or pass --prompts FILE")
    prompts: list[list[int]] = []
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        first = next((i for i, m in enumerate(mask) if m), None)
        if first:  # a row supervised from token 0 has no prompt to condition on
            prompts.append([int(t) for t in ids[:first]])
        if len(prompts) >= limit:
            break
    return prompts, lineage


def fetch_prompts_file(url: str, cfg: BlockdraftConfig, workdir: Path) -> tuple[Path, InputRef]:
    """A prompts JSONL (a local path, file:// or s3:// URL) as a local file, plus its lineage entry (key, size, checksum)."""
    from blockdraft.store.checksum import crc64nvme_file

    parent_url, _, name = url.rstrip("/").rpartition("/")
    store = open_store(parent_url or ".", cfg.store)
    info = store.head(name)
    if info is None:
        raise EvalError(f"prompts file {url} does not exist; pass an existing JSONL file")
    local = store.local_path()
    if local is not None:
        return local / name, raw_input(store, info)
    path = workdir / "prompts.jsonl"
    path.write_bytes(store.read_bytes(name))
    size, checksum = crc64nvme_file(path)
    if size != info.size or (info.checksum is not None and checksum != info.checksum):
        raise ArtifactError(f"prompts file {url} changed while downloading (size {size}); retry")
    return path, raw_input(store, info)


def stop_token_ids(hf_model, tokenizer) -> list[int]:
    """End-of-sequence ids: the generation config's eos ids, plus the tokenizer's eos token."""
    ids: set[int] = set()
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


# ---------------------------------------------------------------------------------------------------------------------
# Plots and the artifact


def write_plots(report: dict[str, Any], folder: Path) -> list[Path]:
    """tau histogram and per-position acceptance, one bar group / line per drafter; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = report["drafters"]
    block_size = report["block_size"]
    width = 0.8 / max(len(drafters), 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, m) in enumerate(drafters.items()):
        cycles = max(m["cycles"], 1)
        xs = [j + (i - (len(drafters) - 1) / 2) * width for j in range(1, block_size + 1)]
        ax.bar(xs, [m["histogram"][str(j)] / cycles for j in range(1, block_size + 1)], width, label=f"{name} (tau {m['tau']:.2f})")
    ax.set_xlabel("tokens committed per cycle (accepted drafts + bonus)")
    ax.set_ylabel("fraction of cycles")
    ax.set_xticks(range(1, block_size + 1))
    ax.legend()
    ax.set_title("Acceptance length per draft/verify cycle")
    fig.tight_layout()
    tau_path = folder / TAU_PLOT_NAME
    fig.savefig(tau_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, m in drafters.items():
        ax.plot(range(1, block_size), m["position_acceptance"], marker="o", label=name)
    ax.set_xlabel("draft position k in the block")
    ax.set_ylabel("fraction of cycles accepting draft k")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(range(1, block_size))
    ax.legend()
    ax.set_title("Per-position acceptance")
    fig.tight_layout()
    position_path = folder / POSITION_PLOT_NAME
    fig.savefig(position_path, dpi=100)
    plt.close(fig)
    return [tau_path, position_path]


def _default_output(cfg: BlockdraftConfig, checkpoint: Checkpoint, prompts: list[list[int]], max_new_tokens: int) -> str:
    key = json.dumps([checkpoint.lineage.sha256, prompts, max_new_tokens, cfg.digest("eval", "target")]).encode()
    return f"{cfg.store.url.rstrip('/')}/eval/{hashlib.sha256(key).hexdigest()[:16]}"


def commit_report(
    cfg: BlockdraftConfig, output: str, report: dict[str, Any], lineage: list[InputRef], workdir: Path
) -> None:
    """Write report.json and the plots, upload them, and commit the `eval` artifact (manifest last, verified)."""
    folder = workdir / "report"
    folder.mkdir()
    paths = [folder / REPORT_NAME, *write_plots(report, folder)]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    store = open_store(output, cfg.store)
    uncommit(store)  # a reader must never see an older manifest over the new files
    counts = {
        "prompts": report["num_prompts"],
        "lossless": report["lossless"]["ok"],
        **{f"tau_{name}": round(m["tau"], 4) for name, m in report["drafters"].items()},
    }
    publish_artifact(store, "eval", folder, paths, config=cfg.resolved(), lineage=lineage, counts=counts)


# ---------------------------------------------------------------------------------------------------------------------
# The stage


def _warm_up(hf_model, proposer, prompt: list[int]) -> None:
    """One short run of each path first, so one-time costs (allocations, kernel selection) do not land in one timing."""
    greedy_generate(hf_model, prompt, 2)
    run_speculative(hf_model, proposer, prompt, 2)


def evaluate(
    hf_model,
    drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stops: Sequence[int],
    tolerance: float,
    untrained_seed: int | None = UNTRAINED_SEED,
) -> dict[str, Any]:
    """Run target-only greedy, the DFlash drafter, the n-gram baseline and (with `untrained_seed`) a freshly initialised
    drafter of the same shape on every prompt; compare each speculative output with greedy; return the report body."""
    from blockdraft.model.drafter import DFlashDrafter
    from blockdraft.model.target import TargetHead

    check_rollback_supported(hf_model.config)
    param = next(drafter.parameters())
    head = TargetHead.from_target(hf_model, device=param.device).to(param.dtype)
    spec = drafter.spec
    makers = {
        "dflash": lambda: DFlashProposer(drafter, head),
        "ngram": lambda: NgramProposer(spec.block_size, spec.mask_token_id),
    }
    if untrained_seed is not None:
        torch.manual_seed(untrained_seed)
        untrained = DFlashDrafter(spec).to(device=param.device, dtype=param.dtype).eval()
        makers["untrained"] = lambda: DFlashProposer(untrained, head)

    _warm_up(hf_model, makers["dflash"](), list(prompts[0]))
    greedy: list[GreedyResult] = []
    spec_results: dict[str, list[SpecResult]] = {name: [] for name in makers}
    divergences: list[Divergence] = []
    per_prompt: list[dict[str, Any]] = []
    for index, prompt in enumerate(prompts):
        reference = greedy_generate(hf_model, prompt, max_new_tokens, stops)
        greedy.append(reference)
        row: dict[str, Any] = {"index": index, "prompt_len": len(prompt), "new_tokens": len(reference.new_tokens)}
        for name, make in makers.items():
            result = run_speculative(hf_model, make(), prompt, max_new_tokens, stops)
            spec_results[name].append(result)
            row[f"tau_{name}"] = result.tau
            row[f"acceptance_lengths_{name}"] = result.acceptance_lengths
            found = first_divergence(name, index, result, reference, tolerance)
            if found is not None:
                divergences.append(found)
        per_prompt.append(row)

    greedy_summary = greedy_metrics(greedy)
    drafters = {name: acceptance_metrics(results, spec.block_size) for name, results in spec_results.items()}
    for m in drafters.values():
        m["speedup"] = greedy_summary["wall_s"] / m["wall_s"] if m["wall_s"] else 0.0
    return {
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": list(spec.target_layer_ids),
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(prompts),
        "stop_token_ids": list(stops),
        "target_dtype": str(next(hf_model.parameters()).dtype).removeprefix("torch."),
        "greedy": greedy_summary,
        "drafters": drafters,
        "lossless": {
            "ok": all(d.tolerated for d in divergences),
            "tolerance": tolerance,
            "divergences": [asdict(d) for d in divergences],
        },
        "prompts": per_prompt,
    }


def run_eval(
    cfg: BlockdraftConfig,
    checkpoint: str,
    prompts: str | None = None,
    max_new_tokens: int | None = None,
    output: str | None = None,
) -> tuple[dict[str, Any], str]:
    """The `eval` stage. `prompts`: a JSONL file, or a tokenized artifact URL (its held-out rows); default eval.prompts,
    else the held-out rows of train.data. Returns (report, URL of the committed eval artifact)."""
    from blockdraft.errors import SpecError
    from blockdraft.model.drafter import DFlashDrafter
    from blockdraft.model.target import load_target, load_target_config

    if not cfg.target.path:
        raise EvalError("target.path is not set; eval needs the target model the drafter was trained for")
    max_new_tokens = max_new_tokens or cfg.eval.max_new_tokens
    hf_config = load_target_config(cfg.target.path)
    try:
        check_rollback_supported(hf_config)
    except DecodeError as exc:
        raise EvalError(str(exc)) from None

    workdir = Path(tempfile.mkdtemp(prefix="blockdraft-eval-"))
    try:
        ckpt = open_checkpoint(checkpoint, cfg, workdir)
        check_checkpoint_matches(cfg, ckpt, hf_config)
        tokenizer = load_tokenizer(cfg)
        source = prompts or cfg.eval.prompts or cfg.train.data
        if source is None:
            raise EvalError("no prompts: pass --prompts FILE.jsonl, set eval.prompts, or set train.data to a tokenized artifact")
        if source.endswith(".jsonl"):
            path, prompt_ref = fetch_prompts_file(source, cfg, workdir)
            prompt_ids = prompts_from_jsonl(path, tokenizer, cfg, cfg.eval.num_prompts)
        else:
            prompt_ids, prompt_ref = prompts_from_tokenized(source, cfg, cfg.eval.num_prompts, workdir)
        if not prompt_ids:
            raise EvalError(f"no prompts found in {source}; give at least one")

        target_device = cfg.placement.target_devices[0]
        drafter_device = cfg.placement.drafter_devices[0]
        hf_model = load_target(cfg.target.path, device=target_device, dtype=cfg.target.dtype)
        try:
            drafter = DFlashDrafter.from_pretrained(ckpt.folder, device=drafter_device, dtype=getattr(torch, cfg.target.dtype)).eval()
            drafter.spec.check_target(hf_model.config)
        except SpecError as exc:
            raise EvalError(f"checkpoint {checkpoint}: {exc}") from None
        vocab = drafter.spec.vocab_size
        bad = next((t for p in prompt_ids for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise EvalError(f"prompt token id {bad} is outside the target's vocabulary (0..{vocab - 1}); the prompts were tokenized for another model")

        tolerance = divergence_tolerance(cfg, next(hf_model.parameters()).dtype)
        report = evaluate(
            hf_model, drafter, prompt_ids, max_new_tokens, stop_token_ids(hf_model, tokenizer), tolerance,
            untrained_seed=UNTRAINED_SEED if cfg.eval.untrained_baseline else None,
        )
        report["checkpoint"] = checkpoint
        report["target"] = cfg.target.path
        report["prompts_source"] = source
        # What the consistency check compared, so a reader can trace the figures to the data and template they hold for.
        report["template_sha256"] = ckpt.template_sha256
        output = output or _default_output(cfg, ckpt, prompt_ids, max_new_tokens)
        commit_report(cfg, output, report, [ckpt.lineage, prompt_ref], workdir)
        return report, output
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A short human summary of a report: one line per drafter, the greedy reference, the lossless verdict."""
    g = report["greedy"]
    lines = [f"greedy\ttokens/s {g['tokens_per_s']:.1f}\tforwards/token {g['target_forwards_per_token']:.3f}"]
    for name, m in report["drafters"].items():
        lines.append(
            f"{name}\ttau {m['tau']:.3f}\ttokens/s {m['tokens_per_s']:.1f}\tspeedup {m['speedup']:.2f}x"
            f"\tforwards/token {m['target_forwards_per_token']:.3f}"
        )
    lossless = report["lossless"]
    verdict = "ok" if lossless["ok"] else "FAILED"
    lines.append(f"lossless\t{verdict}\t{len(lossless['divergences'])} divergence(s), tolerance {lossless['tolerance']:g}")
    for d in lossless["divergences"]:
        lines.append(
            f"  {d['drafter']} prompt {d['prompt_index']} position {d['position']}: spec {d['spec_token']} vs target "
            f"{d['target_token']}, top-2 margin {d['margin']:.3g} ({'near-tie' if d['tolerated'] else 'beyond tolerance'})"
        )
    return lines
