"""What the tokenize tests share: conversations and corpora on disk, a config around the Qwen3 tokenizer, a run of the
stage, and the rows and files of an output."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import zstandard

from blockdraft.config import BlockdraftConfig, load_config
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.store.artifact import MANIFEST_NAME, PIECES_DIR
from helpers.paths import TOKENIZER_DIR


def conversation(i: int, turns: int = 1, reasoning: bool = True) -> dict:
    """A conversation with `turns` user/assistant exchanges; ids c<i>."""
    messages = [{"role": "system", "content": "You are a careful assistant."}] if i % 3 == 0 else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {i}.{t}: what is {i} times {t + 2}?"})
        answer = {"role": "assistant", "content": f"The answer is {i * (t + 2)}."}
        if reasoning:
            answer["reasoning_content"] = f"I multiply {i} by {t + 2}.\nThat gives {i * (t + 2)}; check: yes."
        messages.append(answer)
    return {"id": f"c{i}", "messages": messages}


def long_conversation(i: int, turns: int, words: int) -> dict:
    """A reasoning conversation of `turns` exchanges whose turn t reasons for about `words * (t + 1)` words; ids
    long<i>.

    With thinking on, its later turns (longer reasoning after a longer history) outgrow a small `tokenize.max_length`.
    """
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Problem {i}.{t}: add the numbers from 1 to {10 * (i + t + 1)}."})
        steps = " ".join(f"step {k}: partial sum {k * (k + 1) // 2}." for k in range(1, words * (t + 1) // 5 + 1))
        messages.append({"role": "assistant", "reasoning_content": f"Count up. {steps}",
                         "content": f"The sum is {5 * (i + t + 1) * (10 * (i + t + 1) + 1)}."})
    return {"id": f"long{i}", "messages": messages}


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows (dicts, or strings written as they are) one a line; gzip or zstd by the file's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(lines.encode()))
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


def make_corpus(folder: Path, files: int = 3, per_file: int = 30) -> Path:
    """`files` JSONL files part-NN.jsonl of `per_file` conversations each (1-3 turns, most with reasoning)."""
    n = 0
    for f in range(files):
        rows = []
        for _ in range(per_file):
            rows.append(conversation(n, turns=1 + n % 3, reasoning=n % 4 != 1))
            n += 1
        write_jsonl(folder / f"part-{f:02d}.jsonl", rows)
    return folder


def config(chat_template: str | None = None, **tokenize) -> BlockdraftConfig:
    """The tiny tokenizer's target with `chat_template` (target.chat_template) and these [tokenize] values."""
    return load_config(None,
                       {"target": {"path": str(TOKENIZER_DIR), "chat_template": chat_template}, "tokenize": tokenize})


def tokenize(input: Path | str, output: Path | str, cfg: BlockdraftConfig, reporter: Reporter | None = None,
             **options) -> StageResult:
    """The stage, as the library runs it: `tokenize.run` with a `Reporter` that keeps its lines."""
    return tokenize_stage.run(cfg, str(input), str(output), reporter or Reporter(), **options)


def rows_of(output: Path) -> dict[str, list[dict]]:
    dd = datasets.load_from_disk(str(output))
    return {split: dd[split].to_list() for split in dd}


def files_of(output: Path) -> dict[str, bytes]:
    """Every data file of an output by path: not the manifest, the pieces (they carry the run's keys) or the lock."""
    return {p.relative_to(output).as_posix(): p.read_bytes() for p in output.rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME and p.parent.name != PIECES_DIR and not p.name.endswith(".lock")}


def piece_names(output: Path) -> list[str]:
    """The shards recorded as finished pieces in a local output."""
    return sorted(p.stem for p in (output / PIECES_DIR).glob("shard-*.json"))


def half_finished(output: Path, shard: str) -> None:
    """The state a run killed before `shard` finished leaves: no manifest, no piece or files for that shard."""
    (output / MANIFEST_NAME).unlink()
    (output / PIECES_DIR / f"{shard}.json").unlink()
    for p in output.glob(f"*/{shard}*"):
        p.unlink()
