"""`export`: a verified training checkpoint -> the z-lab drafter format that SGLang and vLLM load, as an artifact.

The export folder holds `config.json` + `model.safetensors` exactly as docs/DFLASH.md specifies (no embedding,
no LM head), `blockdraft-export.json` (the resolved blockdraft config, the DFlash parameters, the chat-template hash,
thinking mode and data lineage the drafter was trained with) and `serving.json` (the engine settings), and its manifest.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.errors import ExportError, SpecError
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.formats import CONFIG_NAME, EXPORT_KIND, PINNED_CONFIG_NAME, PROVENANCE_NAME, open_drafter_artifact
from blockdraft.model.spec import DrafterSpec, default_gamma
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import (
    InputRef,
    VerifyReport,
    manifest_input,
    publish_artifact,
    read_manifest,
    uncommit,
)

SERVING_NAME = "serving.json"



@dataclass
class ExportResult:
    url: str
    report: VerifyReport
    serving: dict[str, Any]
    provenance: dict[str, Any]


def serving_settings(location: str, block_size: int, target: str | None = None) -> dict[str, Any]:
    """Engine settings for a drafter at `location` with block size B: SGLang drafts B tokens per block, vLLM counts B-1."""
    sglang = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", location,
              "--speculative-num-draft-tokens", str(block_size)]
    vllm = {"method": "dflash", "model": location, "num_speculative_tokens": block_size - 1}
    model = target or "TARGET_MODEL"
    return {
        "sglang_args": shlex.join(sglang),
        "vllm_speculative_config": vllm,
        "sglang_command": shlex.join(["python", "-m", "sglang.launch_server", "--model-path", model, *sglang]),
        "vllm_command": shlex.join(["vllm", "serve", model, "--speculative-config", json.dumps(vllm)]),
    }


def _data_facts(lineage: list[InputRef], store_settings: Any) -> list[dict[str, Any]]:
    """Per input artifact: its URL and pin, plus every template/thinking field its manifest records (config or counts)."""

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
                found = read_manifest(open_store(ref.url, store_settings))
            except Exception as exc:  # provenance is best effort; the pin (sha256) is recorded either way
                entry["unreadable"] = type(exc).__name__
            else:
                if found is not None:
                    manifest = found[0]
                    entry["kind_of_input"] = manifest.kind
                    entry.update(find({"config": manifest.config, "counts": manifest.counts}))
                    entry["inputs"] = _data_facts(manifest.lineage, store_settings)
        facts.append(entry)
    return facts


def export_drafter(
    drafter: DFlashDrafter,
    target_config: Any,
    out: Store,
    resolved_config: dict[str, Any] | None = None,
    lineage: list[InputRef] | None = None,
    data_lineage: list[InputRef] | None = None,
    gamma: float | None = None,
    location: str | None = None,
    target_path: str | None = None,
    store_settings: Any = None,
) -> ExportResult:
    """Check the drafter against the target's HF config, write the export files to `out`, commit them as an artifact.

    Refuses (SpecError) a mask id >= the target's embedding rows, layer ids outside the target, a hidden size that differs.
    `lineage` pins the export's inputs (the checkpoint); `data_lineage` (the checkpoint's own inputs: the tokenized data)
    is described in blockdraft-export.json with the template and thinking fields of those inputs' manifests.
    `location` is what the serving settings name as the drafter path (default: the store URL).
    """
    spec = drafter.spec
    spec.check_target(target_config)
    lineage = list(lineage or [])
    location = location or out.url
    serving = serving_settings(location, spec.block_size, target_path)
    provenance = {
        "format": "blockdraft-export/1",
        "dflash": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
            "block_size": spec.block_size,
            "num_target_layers": spec.num_target_layers,
            "gamma": gamma,
        },
        "config": resolved_config or {},
        "data": _data_facts(list(data_lineage or []), store_settings),
    }
    uncommit(out)
    with tempfile.TemporaryDirectory(prefix="blockdraft-export-") as tmp:
        root = Path(tmp)
        paths = drafter.save_pretrained(root)
        for name, payload in ((PROVENANCE_NAME, provenance), (SERVING_NAME, serving)):
            (root / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
            paths.append(root / name)
        counts = {"tensors": len(drafter.state_dict()), "parameters": sum(p.numel() for p in drafter.parameters())}
        report = publish_artifact(out, EXPORT_KIND, root, paths, config=resolved_config or {}, lineage=lineage, counts=counts)
    return ExportResult(out.url, report, serving, provenance)


def _check_pinned(spec: DrafterSpec, dflash: dict[str, Any]) -> None:
    """The checkpoint's resolved config and its config.json must agree on what the engines read."""
    pinned = {"mask_token_id": spec.mask_token_id, "target_layer_ids": spec.target_layer_ids, "block_size": spec.block_size}
    for name, value in pinned.items():
        if dflash.get(name) is not None and dflash[name] != value:
            raise ExportError(
                f"checkpoint is inconsistent: dflash.{name} is {dflash[name]} in its {PINNED_CONFIG_NAME} but {value} in its "
                f"{CONFIG_NAME}; re-save the checkpoint from training"
            )


def export(checkpoint: str, out: str, settings: Any = None, target: str | None = None) -> ExportResult:
    """Export the verified checkpoint at `checkpoint` (a folder or URL, or a training output holding step-* checkpoints)
    to `out` (a folder or s3:// URL). `settings` is a BlockdraftConfig (store access); `target` overrides where the
    target model's config is read from (default: target.path pinned in the checkpoint)."""
    from transformers import AutoConfig

    store_settings = getattr(settings, "store", None)
    ckpt_store, report = open_drafter_artifact(open_store(checkpoint, store_settings))
    if ckpt_store.url.rstrip("/") == open_store(out, store_settings).url.rstrip("/"):
        raise ExportError(f"export destination {out} is the checkpoint itself; pass another folder or URL")
    resolved = report.manifest.config or {}
    with tempfile.TemporaryDirectory(prefix="blockdraft-ckpt-") as tmp:
        folder = ckpt_store.local_path()
        if folder is None:
            folder = Path(tmp)
            from blockdraft.store.transfer import (
                pull,  # checksums recomputed from the bytes received
            )

            pull(ckpt_store.url, folder, store_settings)
        if (folder / PINNED_CONFIG_NAME).is_file():
            resolved = json.loads((folder / PINNED_CONFIG_NAME).read_text())
        drafter = DFlashDrafter.from_pretrained(folder)
    dflash = resolved.get("dflash", {})
    _check_pinned(drafter.spec, dflash)
    target_path = target or resolved.get("target", {}).get("path")
    if not target_path:
        raise ExportError("the checkpoint pins no target.path; pass --target with the target model's folder or hub id")
    try:
        target_config = AutoConfig.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the target's config at {target_path} ({type(exc).__name__}); pass --target PATH") from None
    gamma = dflash.get("gamma")
    if gamma is None:
        try:
            gamma = default_gamma(drafter.spec.block_size)
        except SpecError:
            gamma = None
    out_store = open_store(out, store_settings)
    return export_drafter(
        drafter,
        target_config,
        out_store,
        resolved_config=resolved,
        lineage=[manifest_input(ckpt_store)],
        data_lineage=list(report.manifest.lineage),
        gamma=gamma,
        location=out,
        target_path=target_path,
        store_settings=store_settings,
    )
