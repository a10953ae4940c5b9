"""What the `tokenize` command shows: a rich progress bar while it runs, then what was verified at the destination."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from blockdraft.stages.tokenize.stage import TokenizeProgress, TokenizeSummary
from blockdraft.store.artifact import State


class RichTokenizeProgress(TokenizeProgress):
    """A bar over the input bytes still to tokenize, with rows and tokens per second so far."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._bar = Progress(
            TextColumn("[bold]tokenize[/]"),
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = self._bar.add_task("tokenize", total=None, rate="", start=False)
        self._rows = self._tokens = 0
        self._t0 = time.monotonic()

    def __enter__(self) -> RichTokenizeProgress:
        self._bar.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._bar.__exit__(exc_type, exc, tb)

    def start(self, total_bytes: int, shards_total: int, shards_skipped: int) -> None:
        if shards_skipped:
            self.console.print(f"resuming: {shards_skipped} of {shards_total} shards already done (records and files match this run)")
        self._t0 = time.monotonic()
        self._bar.update(self._task, total=total_bytes)
        self._bar.start_task(self._task)

    def advance(self, nbytes: int, rows: int, tokens: int) -> None:
        self._rows += rows
        self._tokens += tokens
        elapsed = max(time.monotonic() - self._t0, 1e-6)
        rate = f"{self._rows:,} rows  {self._tokens / elapsed / 1e3:,.1f}K tok/s"
        self._bar.update(self._task, advance=nbytes, rate=rate)

    def warn(self, message: str) -> None:
        self.console.print(f"[bold yellow]WARNING:[/] {message}", highlight=False)


def print_tokenize_summary(console: Console, summary: TokenizeSummary) -> None:
    """The counts, and what was read back and verified at the destination (never what a worker claimed)."""
    c = summary.counts
    report = summary.report
    ok = report.state is State.VERIFIED
    color = "green" if ok else "red"
    if summary.already_committed:
        console.print("nothing to do: the output is already a verified artifact of this config and these inputs")
    console.print(
        f"[{color}]{report.state.value}[/] at {summary.output}: {report.summary()} "
        f"(manifest {report.manifest_sha256[:12] if report.manifest_sha256 else '-'})",
        highlight=False,
    )
    console.print(
        f"  conversations in {c.get('rows_in', 0):,}; rows out {c.get('rows_out', 0):,} "
        f"(train {c.get('train_rows', 0):,}, held-out {c.get('held_out_rows', 0):,}); "
        f"tokens {c.get('tokens', 0):,}, supervised {c.get('supervised_tokens', 0):,}",
        highlight=False,
    )
    modes = ", ".join(f"{k} {v:,}" for k, v in c.get("thinking", {}).items()) or "-"
    console.print(f"  thinking mode per row: {modes}; template sha256 {summary.template_sha256[:12]}", highlight=False)
    rejected = c.get("rejected", {})
    if rejected:
        reasons = ", ".join(f"{k} {v:,}" for k, v in rejected.items())
        console.print(f"  rejected {sum(rejected.values()):,} (quarantine/*.jsonl): {reasons}", highlight=False)
    console.print(
        f"  shards {summary.shards_total} ({summary.shards_skipped} resumed from matching records); {summary.seconds:.1f} s",
        highlight=False,
    )
    for message in summary.warnings:
        console.print(f"  [bold yellow]WARNING:[/] {message}", highlight=False)
