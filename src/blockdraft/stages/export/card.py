"""The export's model card, `README.md`: YAML front matter as the Hugging Face Hub reads it, then what was measured.

Every figure comes from a verified artifact and the card names it: the eval artifact's `report.json` (read as JSON: a
stage never imports another), the tokenized data's manifest, the export's own `config.json`, `blockdraft-export.json`,
`serving.json` and manifest counts. A figure that was not measured is left out, never written as a placeholder. The
figures at temperature name the draft rule they were measured under (`eval.proposal`); greedy ones need none. The
license is the one `export.license` names (front matter `license:`); blockdraft never chooses one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CARD_NAME = "README.md"
EVAL_KIND = "eval"
EVAL_REPORT_NAME = "report.json"  # the report an eval artifact holds (written by the eval stage)
TAGS = ("speculative-decoding", "dflash", "blockdraft")  # and "dflash2" for a DFlash2 drafter
# What the card calls a drafter of each architecture (`dflash.architecture`), and how it says what that is.
DRAFTERS = {
    "dflash": ("DFlash", "A DFlash block-diffusion drafter"),
    "dflash2": ("DFlash2", "A DFlash2 drafter (DFlash's block-diffusion drafter with a grouped dynamic causal "
                           "convolution around every sublayer and a candidate selector that walks a path through each "
                           "slot's top-K)"),
}
LIBRARY_NAME = "blockdraft"
DATA_COUNTS = (  # the tokenized manifest's counts the card gives, and how it names them
    ("rows_in", "conversations"), ("rows_out", "rows"), ("train_rows", "train rows"),
    ("held_out_rows", "held-out rows"), ("tokens", "tokens"), ("supervised_tokens", "supervised tokens"),
)


@dataclass
class EvalSource:
    """A verified eval artifact of this checkpoint: where it is, its manifest's sha256 and its report as JSON."""

    url: str
    manifest_sha256: str
    report: dict[str, Any]


@dataclass
class DataSource:
    """One training data input, pinned by `sha256`; `counts` and `run` (its manifest's counts and `tokenize_run` config)
    only when it verified here with that very manifest, else None with `why` saying what stopped it."""

    url: str
    sha256: str | None
    counts: dict[str, Any] | None = None
    run: dict[str, Any] | None = None
    why: str | None = None


def render_card(
    target: str,
    export_url: str,
    drafter_config: dict[str, Any],
    provenance: dict[str, Any],
    serving: dict[str, Any],
    counts: dict[str, Any],
    evaluation: EvalSource | None,
    data: list[DataSource],
    license: str | None = None,
) -> str:
    """The card's text. `drafter_config` is the export's config.json, `provenance` its blockdraft-export.json, `serving`
    its serving.json, `counts` its manifest counts; `license` the front matter's (None: a comment says how to set
    one)."""
    architecture = (provenance.get("dflash") or {}).get("architecture") or "dflash"
    name, what = DRAFTERS[architecture]
    parts = [
        _front_matter(target, license, architecture),
        f"# {name} drafter for {target}\n\n"
        f"{what} for speculative decoding with `{target}`, trained and exported by blockdraft "
        f"(export `{export_url}`). Every figure below is read from the verified artifact it names; what was not "
        "measured is not shown.\n",
        _evaluation(evaluation),
        _data(data, provenance),
        _drafter(drafter_config, provenance, counts),
        _serving(serving),
    ]
    return "\n".join(parts)


def _front_matter(target: str, license: str | None, architecture: str) -> str:
    tags = "".join(f"- {tag}\n" for tag in (*TAGS, *(["dflash2"] if architecture == "dflash2" else [])))
    if license is not None:
        licensed = f"license: {json.dumps(license)}\n"
    else:  # the card is a listed file: editing it by hand would leave the export unverified
        licensed = ("# license: set the license these weights are published under with export.license (usually the "
                    "target's:\n# `blockdraft export --card-only EXPORT --license apache-2.0`); blockdraft does not "
                    "choose one, and this\n# file is checksummed in the export's manifest: an edit by hand leaves the "
                    "export unverified.\n")
    return f"---\nbase_model: {json.dumps(target)}\n{licensed}library_name: {LIBRARY_NAME}\ntags:\n{tags}---\n"


_LICENSE_LINE = re.compile(r"^license: (\"[^\"\n]*\")$", re.MULTILINE)


def card_license(card: str) -> str | None:
    """The license the front matter of `card` (a card's text, as `render_card` writes it) names, or None."""
    front = card.split("\n---\n", 1)[0] if card.startswith("---\n") else ""
    found = _LICENSE_LINE.search(front)
    return json.loads(found.group(1)) if found else None


def _fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def _source(evaluation: EvalSource) -> str:
    """The sentence naming the eval artifact every figure of the evaluation section is read from."""
    report = evaluation.report
    return (f"From `{EVAL_REPORT_NAME}` of the eval artifact `{evaluation.url}` (manifest sha256 "
            f"`{evaluation.manifest_sha256}`), an eval of checkpoint `{report.get('checkpoint')}` on the target "
            f"`{report.get('target')}`.")


def gives_eval(card: str, evaluation: EvalSource) -> bool:
    """Whether `card` (a card's text) gives the figures of `evaluation`: it names that very artifact and manifest."""
    return _source(evaluation) in card


def _evaluation(evaluation: EvalSource | None) -> str:
    if evaluation is None:
        return (
            "## Evaluation\n\nNo eval of this checkpoint was given or found for this export. Measure it with "
            "`blockdraft eval --checkpoint CHECKPOINT --prompts SET ...`, then rewrite this card with `blockdraft "
            "export --card-only EXPORT` (which takes the latest eval of the checkpoint in the store, or the one "
            "`--eval EVAL` names).\n"
        )
    report = evaluation.report
    drafters = list(report["drafters"])
    others = [d for d in drafters if d != "dflash"]
    lines = [
        "## Evaluation\n",
        _source(evaluation) + "\n",
        f"Decoding: greedy, each output compared token for token with the target's own greedy output; up to "
        f"{report['max_new_tokens']} new tokens per prompt; target in {report['target_dtype']}; draft block size "
        f"{report['block_size']}.\n",
        "tau: tokens committed per draft/verify cycle (accepted drafts + 1); speedup: wall time of target-only greedy "
        "over that of speculative decoding, on the same prompts and machine.\n",
        "| prompt set | layout | prompts | tau | speedup | lossless | " + " | ".join(f"tau {d}" for d in others) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(others),
    ]
    rows = [
        (name, s["layout"], s["num_prompts"], s["drafters"], s["lossless"])
        for name, s in report.get("prompt_sets", {}).items()
    ]
    rows.append(("all", "", report["num_prompts"], report["drafters"], report["lossless"]["ok"]))
    for name, layout, prompts, metrics, lossless in rows:
        dflash = metrics["dflash"]
        cells = [name, layout, str(prompts), _fmt(dflash["tau"], 3), _fmt(dflash["speedup"], 2) + "x",
                 "yes" if lossless else "NO"]
        cells += [_fmt(metrics[d]["tau"], 3) for d in others]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\nPer-position acceptance of the drafter (fraction of cycles accepting draft k, k = 1, 2, ...):\n")
    for name, _, _, metrics, _ in rows:
        lines.append(f"- {name}: " + ", ".join(_fmt(a, 3) for a in metrics["dflash"]["position_acceptance"]))
    sampled = report.get("sampled")
    lines += _sampled(sampled)
    engine = report.get("engine")
    if engine:
        verdict = (
            "agrees with blockdraft's decode"
            if engine.get("disagreement") is None
            else f"disagrees: {engine['disagreement']}"
        )
        # At temperature our side of the comparison drafted by the report's rule; greedy is the same under every rule.
        at = f" at temperature {engine['temperature']:g}, {_rule(sampled)}" if engine.get("temperature") else ""
        lines.append(
            f"\nServed by {engine['engine']} {engine['version']} ({engine['dtype']}){at}: tau "
            f"{_fmt(engine['tau'], 3)}, speedup {_fmt(engine['speedup'], 2)}x, "
            f"{engine['outputs_equal_target_only']}/{engine['num_prompts']} outputs equal to the engine's target-only "
            f"outputs; {verdict} ({engine['rule']})."
        )
    return "\n".join(lines) + "\n"


def _rule(sampled: dict[str, Any] | None) -> str:
    """The draft rule the report's figures at temperature were measured under (`eval.proposal`: which serving engine's
    way of proposing drafts)."""
    return f"drafts proposed by the `{(sampled or {})['proposal']}` rule (`eval.proposal`)"


def _sampled(sampled: dict[str, Any] | None) -> list[str]:
    """The report's decodes at temperature (over every prompt; the report keeps them per drafter, not per set)."""
    if not sampled:
        return []
    lines = [
        f"\nSampled decoding: temperature {sampled['temperature']:g}, top-p {sampled['top_p']:g}, top-k "
        f"{sampled['top_k']}, seed {sampled['seed']}, {sampled['samples_per_prompt']} decode(s) per prompt, "
        f"{sampled['decodes']} in all, over every prompt; {_rule(sampled)} and verified by rejection sampling; speedup "
        "over target-only sampling.\n",
        "| drafter | tau | tau 95% interval | speedup |",
        "|---|---|---|---|",
    ]
    for name, d in sampled["drafters"].items():
        interval = d["tau_ci95"]  # None: fewer decodes than an interval needs
        shown = "none (1 decode)" if interval is None else f"{_fmt(interval[0], 3)} to {_fmt(interval[1], 3)}"
        lines.append(f"| {name} | {_fmt(d['metrics']['tau'], 3)} | {shown} | {_fmt(d['metrics']['speedup'], 2)}x |")
    return lines


def _data(data: list[DataSource], provenance: dict[str, Any]) -> str:
    lines = ["## Training data\n"]
    if not data:
        lines.append("The checkpoint records no training data input.")
    for source in data:
        if source.counts is None or source.run is None:
            lines.append(f"- `{source.url}`, pinned by manifest sha256 `{source.sha256}`: {source.why}; its figures "
                         "are not shown.")
            continue
        figures = ", ".join(f"{label} {source.counts[key]:,}" for key, label in DATA_COUNTS if key in source.counts)
        run = source.run
        settings = []
        if "thinking" in run:
            settings.append(f"thinking mode {run['thinking']}")
        if "template_sha256" in run:
            settings.append(f"chat template sha256 `{run['template_sha256']}`")
        lines.append(f"- `{source.url}` (tokenized artifact, manifest sha256 `{source.sha256}`): {figures}; "
                     f"{'; '.join(settings)}.")
    trained = (provenance.get("config") or {}).get("train") or {}
    if trained:
        lines.append("\nTraining settings pinned in the checkpoint (`blockdraft-export.json`, "
                     f"`config.train`):\n\n```json\n{json.dumps(trained, indent=2, sort_keys=True)}\n```")
    return "\n".join(lines) + "\n"


def _drafter(drafter_config: dict[str, Any], provenance: dict[str, Any], counts: dict[str, Any]) -> str:
    dflash = provenance.get("dflash") or {}
    shape = [
        ("draft layers", drafter_config.get("num_hidden_layers")), ("hidden size", drafter_config.get("hidden_size")),
        ("attention heads", drafter_config.get("num_attention_heads")),
        ("key/value heads", drafter_config.get("num_key_value_heads")),
        ("block size", dflash.get("block_size")), ("mask token id", dflash.get("mask_token_id")),
        ("target layer ids", dflash.get("target_layer_ids")), ("layer types", dflash.get("layer_types")),
        ("sliding window", dflash.get("sliding_window")), ("stored dtype", provenance.get("dtype")),
        ("parameters", counts.get("parameters")), ("tensors", counts.get("tensors")),
    ]
    lines = ["## Drafter\n", "From the export's `config.json`, `blockdraft-export.json` and manifest counts:\n"]
    lines += [
        f"- {label}: {value:,}"
        if isinstance(value, int)
        else f"- {label}: {json.dumps(value) if isinstance(value, list) else value}"
        for label, value in shape
        if value is not None
    ]
    lines.append(f"\nDFlash settings pinned in the checkpoint (`blockdraft-export.json`, `dflash`):\n\n```json\n"
                 f"{json.dumps(dflash, indent=2, sort_keys=True)}\n```")
    return "\n".join(lines) + "\n"


def _serving(serving: dict[str, Any]) -> str:
    commands = [c for c in (serving.get("pull_command"), serving.get("sglang_command"),
                            serving.get("vllm_command")) if c]
    text = "## Serving\n\nFrom the export's `serving.json`:\n\n```sh\n" + "\n".join(commands) + "\n```\n"
    if serving.get("vllm_env"):  # what vLLM needs besides its command line, with the command's own reason
        names = ", ".join(f"`{name}={value}`" for name, value in sorted(serving["vllm_env"].items()))
        text += f"\nvLLM needs {names} (in its command above): {serving['vllm_note']}\n"
    return text


__all__ = ["CARD_NAME", "EVAL_KIND", "EVAL_REPORT_NAME", "DataSource", "EvalSource", "card_license", "gives_eval",
           "render_card"]
