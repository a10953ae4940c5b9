"""The `blockdraft` command line: a thin layer; each command parses options and calls one library function."""

from __future__ import annotations

import functools
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from blockdraft.cli_options import (
    ConcurrencyOpt,
    ConfigOpt,
    DeepOpt,
    EndpointOpt,
    ForceOpt,
    PartSizeOpt,
    SetOpt,
    in_store,
    progress_page,
    store_config,
    write_page,
)
from blockdraft.config import load_config
from blockdraft.console import ConsoleReporter
from blockdraft.errors import ArtifactError, BlockdraftError, ConfigError, TrainingInterrupted, printable, redact
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.preflight import preflight as run_preflight
from blockdraft.store.status import OK_STATES, check_page, format_counts, format_lineage, render_progress
from blockdraft.store.status import status as survey
from blockdraft.store.transfer import pull as pull_artifact
from blockdraft.store.transfer import push as push_artifact
from blockdraft.store.writable import require_folder

# `blockdraft --help` lists the commands in the order a job runs them, not alphabetically.
PIPELINE_ORDER = ("preflight", "generate", "tokenize", "push", "pull", "features-server", "train", "eval", "export",
                  "verify", "status", "demo")


class PipelineOrder(TyperGroup):
    def list_commands(self, ctx: typer.Context) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names,
                      key=lambda name: PIPELINE_ORDER.index(name) if name in PIPELINE_ORDER else len(PIPELINE_ORDER))


# The stages and the pipeline are imported inside their commands: they load torch, transformers and datasets (seconds),
# which `--help` and the store commands (push, pull, verify, status, preflight) do not need.
app = typer.Typer(
    cls=PipelineOrder,
    help="Train DFlash speculative-decoding drafters end to end, with every handoff verified at the destination.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Lines are never broken at the terminal width: a path or a one-line error stays one line that a log or a grep can
# match.
console = Console(stderr=True, soft_wrap=True)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The one place user errors are caught: a BlockdraftError is one red line and exit status 2, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BlockdraftError as exc:
            console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}", highlight=False)
            raise typer.Exit(2) from None

    return wrapper


def free_cores(cores: int, load: float) -> int:
    """Cores left to this process: the usable cores less the runnable load, at least one."""
    return max(1, cores - round(load))


def choose_torch_threads(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """Size torch's CPU thread pool from the cores free now (the larger of the 1-minute load and the tasks runnable this
    instant), unless OMP_NUM_THREADS says how many (the user's choice, and
    torchrun's for the ranks it starts). Set before torch is imported, so the pool is made that size; once torch is
    loaded (in-process callers, the tests) nothing is changed. On 2 busy cores an eval ran 6x slower with torch's
    default of one thread per core than with one thread (docs/PERFORMANCE.md, "torch threads")."""
    if "OMP_NUM_THREADS" in environ or "torch" in sys.modules:
        return
    environ["OMP_NUM_THREADS"] = str(free_cores(len(os.sched_getaffinity(0)),
                                                max(os.getloadavg()[0], runnable_now() - 1)))


def runnable_now() -> int:
    """Tasks runnable this instant, this one included (/proc/stat's procs_running): the 1-minute load average lags a job
    that started seconds ago. 0 where the file is not there."""
    try:
        with open("/proc/stat") as stat:
            return next((int(line.split()[1]) for line in stat if line.startswith("procs_running ")), 0)
    except OSError:
        return 0


@app.callback()
def _root() -> None:
    """blockdraft: completions -> tokenize -> push/pull -> train -> eval/export, every step verified."""
    choose_torch_threads()


@app.command()
@user_errors
def verify(
    url: Annotated[str, typer.Argument(help="Artifact folder, file:// or s3:// URL.")],
    config: ConfigOpt = None,
    endpoint_url: EndpointOpt = None,
    deep: DeepOpt = False,
    sets: SetOpt = None,
) -> None:
    """Check one artifact in place: manifest present, every listed file with its size and CRC64NVME checksum, its inputs
    unchanged."""
    settings = store_config(config, sets, endpoint_url)
    store = open_store(url, settings)
    require_folder(store, "artifact", f"pass the folder that holds its {MANIFEST_NAME}")
    # Its inputs open with the same endpoint and credentials settings: an input on the same server resolves.
    report = verify_artifact(store, check_inputs=True, open_url=lambda u: open_store(u, settings), deep=deep,
                             cached=True)
    if report.state is State.INCOMPLETE and next(iter(store.list()), None) is None:
        raise ArtifactError(f"nothing at {store.url}: no manifest and no files; check the path or URL")
    kind = report.manifest.kind if report.manifest else "-"
    color = {State.VERIFIED: "green", State.UNREACHABLE: "yellow", State.UNCHECKED: "yellow"}.get(report.state, "red")
    print(f"{report.state.value}\t{printable(kind)}\t{url}")
    console.print(f"[{color}]{report.state.value}[/]: {report.summary()}", highlight=False)
    for problem in report.problems:
        console.print(f"  {problem.state.value}: {printable(problem.path)}: {printable(problem.detail)}",
                      highlight=False, markup=False)
    if report.state not in OK_STATES:
        raise typer.Exit(1)


@app.command()
@user_errors
def tokenize(
    input: Annotated[str, typer.Argument(help="Completions: a JSONL (.gz/.zst) or Parquet file, a folder of them, or a "
                                              "completions artifact.")],
    output: Annotated[str, typer.Argument(help="Output folder for the tokenized artifact (Arrow shards + manifest).")],
    config: ConfigOpt = None,
    tokenizer: Annotated[str | None,
                         typer.Option(help="Tokenizer folder (target.tokenizer; default: target.path).")] = None,
    chat_template: Annotated[str | None, typer.Option(help="Jinja chat template file (target.chat_template; default: "
                                                           "the tokenizer's own).")] = None,
    thinking: Annotated[str | None, typer.Option(help="auto (per turn: on when it has reasoning), on or off.")] = None,
    max_length: Annotated[int | None, typer.Option(help="Clip rows to this many tokens (after masking).")] = None,
    held_out_fraction: Annotated[float | None,
                                 typer.Option(help="Fraction of conversations in the held-out split.")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes (one input shard each at a time).")] = None,
    check_target: Annotated[bool, typer.Option("--check-target", help="Then run the target (target.path) over a sample "
                                                                      "of the rows: target agreement, and a warning "
                                                                      "when it is low.")] = False,
    force: ForceOpt = False,
    sets: SetOpt = None,
) -> None:
    """Completions -> one row per assistant turn with an exact loss mask, as Arrow shards `datasets.load_from_disk`
    reads."""
    from blockdraft.stages import tokenize as tokenize_stage

    if thinking not in (None, "auto", "on", "off"):
        raise typer.BadParameter(f"{thinking!r}; use auto, on or off", param_hint="--thinking")
    overrides = {"tokenize": {"thinking": thinking, "max_length": max_length, "held_out_fraction": held_out_fraction,
                              "workers": workers},
                 "target": {"tokenizer": tokenizer, "chat_template": chat_template}}
    cfg = load_config(config, overrides, sets or ())
    with ConsoleReporter(console) as reporter:
        result = tokenize_stage.run(cfg, input, output, reporter, force=force)
    for line in tokenize_stage.summary_lines(result):
        reporter.say(line)
    if check_target:
        folder = open_store(result.url, cfg.store).local_path()
        if folder is None:
            raise ConfigError(f"--check-target reads a local tokenized folder, not {result.url}; pull it first, or "
                              "check it on the training node with train --plan")
        _say_agreement(folder, cfg, measured=result.report.manifest_sha256)


def _say_agreement(folder: Path, cfg: Any, measured: str | None = None) -> None:
    """Target agreement of the tokenized folder's train rows, one line, and the warning line when it is low; `measured`:
    the digest of the manifest whose rows are measured (the one tokenize committed), to which the share is bound when
    it is noted beside the artifact, where `status` shows it (and push and pull carry it). Not noted, and said so, when
    the folder holds another manifest by the time the share is known (another tokenize wrote it meanwhile)."""
    from blockdraft.data.agreement import agreement_warning, describe_agreement, tokenized_agreement
    from blockdraft.store.local import LocalStore
    from blockdraft.store.manifest import record_agreement

    result = tokenized_agreement(folder, cfg)
    console.print(describe_agreement(result), highlight=False, markup=False)
    if measured is not None and not record_agreement(LocalStore(folder), measured, Path(cfg.target.path).name, result):
        console.print(f"[bold yellow]WARNING:[/] {escape(str(folder))} no longer holds the artifact whose rows were "
                      "measured (another run wrote it meanwhile): the share is not noted for status; run `tokenize "
                      "--check-target` again once it is done", highlight=False)
    if (line := agreement_warning(result, cfg.train.min_target_agreement)) is not None:
        console.print(f"[bold yellow]WARNING:[/] {escape(line)}", highlight=False)


@app.command()
@user_errors
def export(
    checkpoint: Annotated[str, typer.Argument(help="Verified checkpoint (folder or URL), or a training output holding "
                                                   "step-* checkpoints; with --card-only, the export.")],
    out: Annotated[str | None, typer.Argument(help="Export destination: a folder, file:// or s3:// URL.")] = None,
    config: ConfigOpt = None,
    target: Annotated[str | None, typer.Option("--target", help="Target model folder or hub id (target.path; default: "
                                                                "the checkpoint's).")] = None,
    eval: Annotated[str | None, typer.Option("--eval", help="The eval artifact of this checkpoint whose figures the "
                                                            "model card (README.md) gives (default: the latest "
                                                            "verified eval of this checkpoint in the store).")] = None,
    card_only: Annotated[bool, typer.Option("--card-only", help="Rewrite the model card of the export given (after a "
                                                                "new eval); nothing else.")] = False,
    license: Annotated[str | None, typer.Option("--license", help="export.license: the license the weights are "
                                                                  "published under, written into the card (a Hub "
                                                                  "license id, e.g. apache-2.0).")] = None,
    force: ForceOpt = False,
    sets: SetOpt = None,
) -> None:
    """Write the drafter in the format SGLang (DFLASH) and vLLM (dflash) load, with its model card, as a verified
    artifact; print the serving settings."""
    from blockdraft.stages import export as export_stage

    cfg = load_config(config, {"target": {"path": target}, "export": {"license": license}}, sets or (),
                      {"target.path": "--target", "export.license": "--license"})
    if card_only and out is not None:
        raise typer.BadParameter("--card-only takes the export alone: blockdraft export --card-only EXPORT --eval EVAL",
                                 param_hint="OUT")
    if not card_only and out is None:
        raise typer.BadParameter("give the export destination: blockdraft export CHECKPOINT OUT", param_hint="OUT")
    with ConsoleReporter(console) as reporter:
        if card_only:
            result = export_stage.rewrite_card(cfg, checkpoint, reporter, eval=eval, force=force)
        else:
            assert out is not None
            result = export_stage.run(cfg, checkpoint, out, reporter, force=force, eval=eval)
    console.print(f"[green]verified[/]: {result.report.summary()} at {result.url}", highlight=False)
    print(f"Card:   {result.url.rstrip('/')}/{export_stage.CARD_NAME}")
    for line in export_stage.serving_lines(result.details.serving):  # for a store URL, the pull step comes first
        print(line)


@app.command("eval")
@user_errors
def eval_command(
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="Checkpoint or export artifact: folder, file:// or "
                                                                 "s3:// URL.")],
    config: ConfigOpt = None,
    prompts: Annotated[
        list[str] | None,
        typer.Option("--prompts", help="A prompt set (.jsonl, .jsonl.gz, .json, .parquet, a folder of Parquet files "
                     "or one `datasets` saved, hf://datasets/NAME) or a tokenized artifact (its held-out rows); repeat "
                     "for several sets."),
    ] = None,
    prompt_sets: Annotated[
        list[str] | None,
        typer.Option("--prompt-set", help="The layout of each --prompts, in order (gsm8k, math500, humaneval, mbpp, "
                                          "mt_bench, alpaca, plain, or auto); default: recognised from the columns."),
    ] = None,
    max_new_tokens: Annotated[int | None,
                              typer.Option("--max-new-tokens", min=1, help="New tokens per prompt.")] = None,
    output: Annotated[str | None, typer.Option("--output", help="Where the eval artifact goes (default: "
                                                                "STORE/eval/<hash>).")] = None,
    baseline: Annotated[
        str | None, typer.Option("--baseline", help="A drafter folder in the export format (e.g. a published one) "
                                                    "decoded beside it.")
    ] = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="vllm or sglang: also serve the export in that engine and compare "
                                                  "its acceptance with ours.")
    ] = None,
    export: Annotated[str | None, typer.Option("--export", help="With --engine: the export folder to serve (default: "
                                                                "CHECKPOINT's).")] = None,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature", min=0.0, help="0.01 or more: also decode sampled at this temperature (0: greedy "
                                                    "only)."),
    ] = None,
    top_p: Annotated[float | None,
                     typer.Option("--top-p", help="Sampled decodes: nucleus mass kept (1.0: off).")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=0, help="Sampled decodes: most likely tokens kept (0: "
                                                                     "off).")] = None,
    seed: Annotated[int | None,
                    typer.Option("--seed", min=0, help="Sampled decodes: decode i is seeded with SEED + i.")] = None,
    samples_per_prompt: Annotated[int | None,
                                  typer.Option("--samples-per-prompt", min=1,
                                               help="Sampled decodes per prompt.")] = None,
    proposal: Annotated[str | None, typer.Option("--proposal", help="Sampled decodes: the serving engine's draft rule "
                                                                    "(vllm, vllm-probabilistic or sglang; "
                                                                    "docs/EVAL.md).")] = None,
    force: ForceOpt = False,
    sets: SetOpt = None,
) -> None:
    """Speculative decoding for real: tau, speedup and a token-for-token lossless check against target-only greedy, and
    with --temperature above 0 the same at those sampling settings."""
    from blockdraft.pipeline import export_for_engine
    from blockdraft.stages import eval as eval_stage
    from blockdraft.stages.eval.sampled import SAMPLED_ONLY, refuse_idle_sampling

    flags = {"prompts": prompts or None, "prompt_sets": prompt_sets or None, "max_new_tokens": max_new_tokens,
             "baseline": baseline,
             "engine": engine, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
             "samples_per_prompt": samples_per_prompt, "proposal": proposal}
    cfg = load_config(config, {"eval": flags}, sets or ())
    # A sampling setting given here with temperature 0 would change nothing: refused before anything runs.
    sampling_keys = {f"eval.{key}" for key in SAMPLED_ONLY}
    given = [*(flag for key, flag in SAMPLED_ONLY.items() if flags[key] is not None),
             *(f"--set {item}" for item in sets or () if item.partition("=")[0].strip() in sampling_keys)]
    refuse_idle_sampling(cfg.eval, given)
    with ConsoleReporter(console) as reporter, tempfile.TemporaryDirectory(prefix="blockdraft-engine-export-") as tmp:
        if cfg.eval.engine != "none" and export is None:
            export = export_for_engine(cfg, checkpoint, Path(tmp) / "export", reporter)
        result = eval_stage.run(cfg, checkpoint, output, reporter, force=force, export=export)
    report = result.details
    for line in eval_stage.summary_lines(report):
        print(line)
    print(f"report\t{result.url}")
    if not report.lossless.ok:
        console.print("[bold red]error:[/] speculative output diverged from target-only greedy beyond the tolerance "
                      "(see report)")
        raise typer.Exit(1)
    if report.engine is not None and report.engine.disagreement is not None:
        console.print(f"[bold red]error:[/] {report.engine.disagreement}", highlight=False)
        raise typer.Exit(1)


@app.command()
@user_errors
def push(
    local_dir: Annotated[str, typer.Argument(help="Folder holding a committed artifact (with its manifest).")],
    url: Annotated[str, typer.Argument(help="Destination: s3://bucket/prefix, a file:// folder, or a name under an "
                                            "s3:// store.url.")],
    config: ConfigOpt = None,
    endpoint_url: EndpointOpt = None,
    concurrency: ConcurrencyOpt = None,
    part_size_mib: PartSizeOpt = None,
    force: ForceOpt = False,
    sets: SetOpt = None,
) -> None:
    """Upload an artifact, verify every file at the destination, then write its manifest there (last)."""
    settings = store_config(config, sets, endpoint_url, concurrency, part_size_mib)
    with ConsoleReporter(console) as reporter:
        report = push_artifact(local_dir, in_store(url, settings), settings, force=force, reporter=reporter)
    print(f"verified\t{report.kind}\t{report.destination}")
    console.print(f"[green]pushed[/]: {report.summary()}", highlight=False)


@app.command()
@user_errors
def pull(
    url: Annotated[str, typer.Argument(help="Source artifact: s3://bucket/prefix, a file:// folder, or a name under an "
                                            "s3:// store.url.")],
    local_dir: Annotated[str, typer.Argument(help="Local folder to fill; its manifest is written last.")],
    config: ConfigOpt = None,
    endpoint_url: EndpointOpt = None,
    concurrency: ConcurrencyOpt = None,
    part_size_mib: PartSizeOpt = None,
    force: ForceOpt = False,
    sets: SetOpt = None,
) -> None:
    """Download an artifact, recompute every checksum, and write the local manifest last; refuse one that does not
    verify."""
    settings = store_config(config, sets, endpoint_url, concurrency, part_size_mib)
    with ConsoleReporter(console) as reporter:
        report = pull_artifact(in_store(url, settings), local_dir, settings, force=force, reporter=reporter)
    print(f"verified\t{report.kind}\t{report.destination}")
    console.print(f"[green]pulled[/]: {report.summary()}", highlight=False)


@app.command()
@user_errors
def status(
    url: Annotated[str, typer.Argument(help="Prefix to survey: s3://bucket/prefix or a folder.")],
    config: ConfigOpt = None,
    endpoint_url: EndpointOpt = None,
    progress: Annotated[str | None, typer.Option("--progress", help="Also write these facts as a Markdown page (e.g. "
                                                                    "PROGRESS.md).")] = None,
    deep: DeepOpt = False,
    sets: SetOpt = None,
) -> None:
    """Every artifact under a prefix: state, kind, lineage and counts, read from the destination. Exits 1 unless every
    artifact is verified or only has an input this machine cannot reach; 2 when there is nothing under the prefix."""
    settings = store_config(config, sets, endpoint_url)
    store = open_store(url, settings)
    require_folder(store, "status path", "pass the folder or prefix that holds the artifacts")
    # before the survey: a page that cannot be written fails in seconds
    page = progress_page(progress) if progress else None
    if page is not None:
        check_page(page)
    artifacts = survey(store, deep=deep, store_config=settings)
    if not artifacts:
        raise ArtifactError(
            f"nothing under {store.url}: no manifest and no finished file (a mistyped path, or a write stopped before "
            "its first file); check the path or URL"
        )
    for a in artifacts:
        print(
            f"{a.state.value}\t{printable(a.kind)}\t{printable(a.url)}\t{format_lineage(a.lineage)}\t{format_counts(a)}"
        )
    if page is not None:
        check_page(page, store, artifacts)  # an artifact being written under the survey has no manifest yet
        write_page(page, render_progress(store.url, artifacts))
    if any(a.state not in OK_STATES for a in artifacts):
        raise typer.Exit(1)


@app.command()
@user_errors
def preflight(
    url: Annotated[str, typer.Argument(help="Store to check: s3://bucket/prefix or a folder.")],
    config: ConfigOpt = None,
    endpoint_url: EndpointOpt = None,
    sets: SetOpt = None,
) -> None:
    """Write, read back and delete a probe object: fails in seconds naming what is missing (credentials, bucket,
    permission, endpoint)."""
    report = run_preflight(open_store(url, store_config(config, sets, endpoint_url)))
    print(f"ok\t{report.url}")
    console.print(f"[green]preflight ok[/]: {report.summary()}", highlight=False)


@app.command()
@user_errors
def train(
    config: ConfigOpt = None,
    nproc: Annotated[
        int | None, typer.Option("--nproc", help="A check, not a setting: refuse to start unless "
                                                 "placement.drafter_devices lists this many devices (torchrun starts "
                                                 "one process per entry).")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Take over the output's lease from a writer that is dead but whose lease "
                                           "has not expired yet, and start over at step 0 when train.output holds "
                                           "checkpoints but none verifies.")
    ] = False,
    plan: Annotated[bool, typer.Option("--plan", help="Print the placement and memory plan (GB per device of each "
                                                      "node) from the target's config.json and exit: no weights, data "
                                                      "or GPU needed.")] = False,
    nnodes: Annotated[int | None, typer.Option("--nnodes", help="Machines in the run (placement.nnodes), each running "
                                                                "this command.")] = None,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="This machine's node, 0 to nnodes - 1 "
                                                                      "(placement.node_rank).")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT on node 0 where the nodes "
                                                                              "meet.")] = None,
    sets: SetOpt = None,
) -> None:
    """Train a DFlash drafter on a tokenized artifact; checkpoints are pushed and verified, and a rerun resumes from the
    last verified one."""
    from blockdraft.stages.train.launch import launch

    # The node flags are spellings of placement.* (a bad value's line names the flag as typed); launch passes them on
    # to the ranks torchrun starts as `--set` items.
    nodes = {"placement": {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": rdzv_endpoint}}
    if plan:
        from blockdraft.stages.train.memory import memory_plan

        cfg = load_config(config, nodes, sets or ())
        planned = memory_plan(cfg)
        print("\n".join(planned.lines()))
        if problem := planned.problem():
            raise ConfigError(problem)
        # With the target's weights and the data in local folders, also how far the target agrees with the data.
        data = Path(cfg.train.data) if cfg.train.data and "://" not in cfg.train.data else None
        weights = cfg.target.path is not None and any(Path(cfg.target.path).glob("*.safetensors"))
        if data is not None and (data / "dataset_dict.json").is_file() and weights and cfg.train.target_agreement_rows:
            _say_agreement(data, cfg)
        return
    try:
        with ConsoleReporter(console) as reporter:
            launched = launch(config, nproc, reporter, force, sets or (), nodes)
    except TrainingInterrupted as exc:  # Ctrl-C: where it stood, and the command that resumes
        console.print(f"{escape(str(exc))}: {escape(shlex.join(['blockdraft', *sys.argv[1:]]))}", highlight=False)
        raise typer.Exit(130) from None
    if launched.result is not None and launched.rank == 0:
        trained = launched.result.details
        if trained.metrics:
            last = trained.metrics[-1]
            console.print(f"trained {trained.steps} steps; loss {last['loss']:.4f}, {trained.summary}", highlight=False)
        else:
            console.print(f"nothing to train: the verified checkpoint already holds all {trained.steps} steps",
                          highlight=False)
        print(launched.result.url)
    if launched.exit_status:
        raise typer.Exit(launched.exit_status)


@app.command("features-server")
@user_errors
def features_server(
    config: ConfigOpt = None,
    host: Annotated[str, typer.Option(help="Address to serve on (0.0.0.0: every interface, for trainers on other "
                                           "machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to serve on.")] = 8000,
    features_dir: Annotated[str | None, typer.Option("--features-dir", help="Folder the engine writes each row's "
                                                     "features to (default: target.engine.features_dir); the "
                                                     "trainers must see it.")] = None,
    print_only: Annotated[bool, typer.Option("--print", help="Print the command and its PYTHONPATH instead of "
                                                             "running it.")] = False,
    sets: SetOpt = None,
) -> None:
    """Serve the target's features with vLLM, as [target.engine] says, for trainers whose target.engine.url points
    here: the engine train would start itself, run on machines of its own."""
    from blockdraft.stages.train.engine_features import features_server_command

    cfg = load_config(config, {}, sets or ())
    folder = features_dir or cfg.target.engine.features_dir
    if folder is None:
        raise ConfigError("features-server needs the folder the engine writes features to: pass --features-dir or "
                          "set target.engine.features_dir (on a filesystem the trainers see)")
    Path(folder).mkdir(parents=True, exist_ok=True)
    argv, env = features_server_command(cfg, host, port, Path(folder).absolute())
    if print_only:
        print(f"PYTHONPATH={shlex.quote(env['PYTHONPATH'])} {shlex.join(argv)}")
        return
    console.print(f"serving the target's features on {host}:{port} into {folder}", highlight=False)
    sys.stdout.flush()
    os.execve(argv[0], argv, env)


@app.command()
@user_errors
def generate(
    input: Annotated[str, typer.Argument(help="Prompts or conversations: JSONL (.gz/.zst) or Parquet file, folder or "
                                              "artifact, local or s3://.")],
    output: Annotated[str, typer.Argument(help="Output completions artifact: a folder, file:// or s3:// URL.")],
    config: ConfigOpt = None,
    engine: Annotated[str | None, typer.Option(help="hf (local transformers) or openai (vLLM/SGLang server).")] = None,
    base_url: Annotated[list[str] | None,
                        typer.Option(help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1; repeat for several "
                                          "(requests are spread over them).")] = None,
    model: Annotated[str | None, typer.Option(help="Served model name (default: the server's first).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Completion length limit in tokens.")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests in flight (openai engine).")] = None,
    thinking: Annotated[str | None, typer.Option(help="auto (follow the dropped turn), on or off; a row's own "
                                                      "enable_thinking wins.")] = None,
    force: ForceOpt = False,
    sets: SetOpt = None,
) -> None:
    """Regenerate each prompt's final assistant turn (every turn with --set generate.turns=all) with the target; a
    rerun generates only what is missing."""
    from blockdraft.stages import generate as generate_stage

    overrides = {"generate": {"engine": engine, "base_url": base_url, "model": model, "max_new_tokens": max_new_tokens,
                              "concurrency": concurrency, "thinking": thinking}}
    cfg = load_config(config, overrides, sets or ())
    with ConsoleReporter(console) as reporter:
        result = generate_stage.run(cfg, input, output, reporter, force=force)
    for line in generate_stage.summary_lines(result):
        reporter.say(line)
    failed = result.details.failed
    if failed:
        console.print(f"[yellow]{failed} requests failed[/] (reasons above, rows in failures.ndjson); rerun the same "
                      "command to retry only them")
        raise typer.Exit(1)


@app.command()
@user_errors
def demo(
    workdir: Annotated[str, typer.Option(help="Folder for the demo's local files (created).")] = "demo-work",
    store: Annotated[str | None, typer.Option(help="Store URL (default: a folder inside --workdir); s3://bucket/prefix "
                                                   "works too.")] = None,
    endpoint_url: Annotated[str | None, typer.Option(help="S3 endpoint for an S3-compatible server.")] = None,
    profile: Annotated[str, typer.Option(help="full (the README's main job, a few minutes) or ci (the same pipeline, "
                                              "smaller, <60 s); the real target has one size.")] = "full",
    target: Annotated[str, typer.Option(help="tiny (a Qwen3 target), hybrid (a Qwen3.5-style linear/full-attention "
                                             "target, with a sliding-window drafter layer) or real (SmolLM2-135M-"
                                             "Instruct from the package registry, about 45 minutes on 2 cores).")]
    = "tiny",
    engine: Annotated[str, typer.Option(help="vllm: generate with vLLM and check the drafter in it too "
                                             "(`make engine`).")] = "none",
    # The tiny demos' drafter stays DFlash, whatever dflash.architecture defaults to: their figures are DFlash's
    # (docs/PERFORMANCE.md), and their engine variant serves the export in vLLM's CPU build, which serves DFlash only.
    # The real target's demo trains DFlash2, the default of users' own configs.
    drafter: Annotated[str | None, typer.Option(help="dflash, or dflash2 (a convolution around every sublayer and a "
                                                     "candidate selector that walks each slot's top-K; the default "
                                                     "for your own configs). Default: dflash on the tiny targets, "
                                                     "dflash2 on the real one.")] = None,
) -> None:
    """The whole pipeline on a CPU target: generate, tokenize, push, pull, train, eval, export, status."""
    from blockdraft.pipeline import (
        ARCHITECTURES,
        SIZES,
        TARGETS,
        DemoDrafter,
        DemoTarget,
        Profile,
        demo_lines,
        run_demo,
    )

    if profile not in SIZES:
        raise typer.BadParameter(f"--profile must be one of {', '.join(SIZES)}, not {profile!r}")
    if target not in TARGETS:
        raise typer.BadParameter(f"--target must be one of {', '.join(TARGETS)}, not {target!r}")
    if target == "real" and profile != "full":
        raise typer.BadParameter("--target real has one size (docs/REAL-TARGET.md); leave --profile out")
    drafter = drafter or ("dflash2" if target == "real" else "dflash")
    if drafter not in ARCHITECTURES:
        raise typer.BadParameter(f"--drafter must be one of {', '.join(ARCHITECTURES)}, not {drafter!r}")
    with ConsoleReporter(console) as reporter:
        result = run_demo(workdir, store, cast(Profile, profile), endpoint_url, reporter, cast(DemoTarget, target),
                          engine, cast(DemoDrafter, drafter))
    for line in demo_lines(result):
        print(line)
    if not result.ok:
        raise typer.Exit(1)
