"""The standard prompt sets eval reads, in the layouts they are distributed in, as prompt rows of the plain layout.

A set is a file (a path, file:// or s3:// URL) of one of `SET_FILES`: Parquet, JSONL (gzipped too, as HumanEval
ships), or `.json` (a JSON array of rows, as Alpaca ships, or JSON Lines); a local folder of Parquet files (a Hub
snapshot such as `gsm8k/main/`, its `SPLIT-*.parquet` files); a folder `datasets.save_to_disk` wrote; or
`hf://datasets/NAME` (loaded through `datasets.load_dataset`, the hub or its local cache). Its layout is recognised from
its columns (`LAYOUTS`, most specific first) or named (`eval.prompt_sets`, `--prompt-set`); every layout but `plain`
becomes a one-turn chat (`{"messages": [user turn]}`), which eval renders with the target's template and thinking mode.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

from blockdraft.config import StoreConfig
from blockdraft.data.records import loads_row
from blockdraft.errors import EvalError
from blockdraft.store import open_store
from blockdraft.store.artifact import InputRef
from blockdraft.store.inputs import open_raw_input, recorded_manifest
from blockdraft.store.manifest import folder_input

HF_DATASETS = "hf://datasets/"
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")  # what `datasets.save_to_disk` writes at a folder's root
PLAIN = "plain"
PLAIN_COLUMNS = ("input_ids", "messages", "prompt")
# The files a set is read from, by name: JSON Lines (gzipped too), a JSON array (or JSON Lines named .json), Parquet.
JSONL_FILES = (".jsonl", ".jsonl.gz")
JSON_FILES = (".json", ".json.gz")
SET_FILES = (*JSONL_FILES, *JSON_FILES, ".parquet")


def _text(column: str) -> Callable[[dict[str, Any]], str | None]:
    return lambda row: row.get(column) if isinstance(row.get(column), str) else None


def _first_turn(column: str) -> Callable[[dict[str, Any]], str | None]:
    """The first of a list of turns in `column` (MT-Bench's `turns`, or `prompt` in the Hub's mt_bench_prompts)."""

    def turn(row: dict[str, Any]) -> str | None:
        turns = row.get(column)
        return turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], str) else None

    return turn


def _any_row(row: dict[str, Any]) -> bool:
    return True


def _list_in(column: str) -> Callable[[dict[str, Any]], bool]:
    return lambda row: isinstance(row.get(column), list)


def _instruction(row: dict[str, Any]) -> str | None:
    instruction, extra = row.get("instruction"), row.get("input")
    if not isinstance(instruction, str):
        return None
    return f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instruction


@dataclass(frozen=True)
class Layout:
    """One form of a prompt set's layout: `signature` (columns that recognise it), `text` (the columns its user turn is
    made of, all a file named with this layout must have), `user_turn` (a row's user turn, None when the row lacks it),
    `form` (what tells this form from another of the same name, for messages) and `fits` (a test of the first row
    beyond its columns: a form told from a plain file by a column's type, not its name)."""

    name: str
    signature: tuple[str, ...]
    text: tuple[str, ...]
    user_turn: Callable[[dict[str, Any]], str | None]
    form: str = ""
    fits: Callable[[dict[str, Any]], bool] = _any_row

    def describe(self) -> str:
        return f"{self.name} ({'/'.join(self.text)}{', ' + self.form if self.form else ''})"


# Most specific first: HumanEval's `prompt` and MBPP's `text` are told from a plain file by their test columns, as is
# the `prompt` of MBPP's `sanitized` config on the Hub; the Hub's MT-Bench (mt_bench_prompts) is told from a plain
# file's `prompt` by its type, a list of turns.
LAYOUTS = (
    Layout("humaneval", ("prompt", "entry_point"), ("prompt",), _text("prompt")),
    Layout("mbpp", ("text", "test_list"), ("text",), _text("text")),
    Layout("mbpp", ("prompt", "test_list"), ("prompt",), _text("prompt"), form="sanitized"),
    Layout("gsm8k", ("question",), ("question",), _text("question")),
    Layout("math500", ("problem",), ("problem",), _text("problem")),
    Layout("mt_bench", ("turns",), ("turns",), _first_turn("turns")),
    Layout("mt_bench", ("prompt",), ("prompt",), _first_turn("prompt"), "a list of turns", _list_in("prompt")),
    Layout("alpaca", ("instruction",), ("instruction",), _instruction),
)
LAYOUT_NAMES = (*dict.fromkeys(layout.name for layout in LAYOUTS), PLAIN)


def known_layouts() -> str:
    return ", ".join([*(layout.describe() for layout in LAYOUTS), f"{PLAIN} ({'/'.join(PLAIN_COLUMNS)})"])


@dataclass
class PromptSet:
    """The rows of one prompt set in the plain layout (`input_ids`, `messages` or `prompt`), its layout and its lineage
    entry; `where[i]` names row i in an error (file and line or row)."""

    layout: str
    source: str
    rows: list[dict[str, Any]]
    where: list[str]
    ref: InputRef


def read_prompt_set(source: str, layout: str | None, store_config: StoreConfig, workdir: Path, limit: int) -> PromptSet:
    """Up to `limit` prompt rows of the set at `source`, in `layout` (None: recognised from its columns). Raises
    EvalError for an unknown layout (naming the columns found and the layouts known) or a row its layout cannot read."""
    if layout is not None and layout not in LAYOUT_NAMES:
        raise EvalError(f"prompt set {layout!r} is not one eval knows; use one of {', '.join(LAYOUT_NAMES)}")
    name = source.rsplit("/", 1)[-1]
    if source.startswith(HF_DATASETS):
        raw, ref = _hub_rows(source, limit)
    elif source.endswith(SET_FILES):
        file = open_raw_input(source, store_config, role="prompts file")
        path = file.fetch(workdir / f"prompt-set-{len(list(workdir.glob('prompt-set-*')))}-{name}")
        read = (
            jsonl_rows if source.endswith(JSONL_FILES) else _json_rows if source.endswith(JSON_FILES) else _parquet_rows
        )
        raw, ref = read(path, name, limit), file.ref
    elif _saved_folder(Path(source.partition("?")[0].removeprefix("file://"))):
        raw, ref = _saved_rows(source, limit)
    else:
        raw, ref = _parquet_folder_rows(source, limit)
    rows: list[dict[str, Any]] = []
    where: list[str] = []
    chosen: Layout | None = None
    for place, row in raw:
        if chosen is None and layout != PLAIN:
            chosen = _layout_of(row, layout, source)
        rows.append(row if chosen is None else _as_chat(row, chosen, place))
        where.append(place)
    return PromptSet(chosen.name if chosen else PLAIN, source, rows, where, ref)


def is_prompt_set(source: str, store_config: StoreConfig) -> bool:
    """Whether `source` is read by `read_prompt_set`: a file, a hub dataset, or a local folder without a blockdraft
    manifest that `datasets` saved or that holds Parquet files (at its top, or one folder down: a Hub snapshot's root,
    refused by `_parquet_folder_rows` naming its folders). A tokenized artifact is laid out as `datasets` saves it too,
    and is read by its held-out rows."""
    if source.startswith(HF_DATASETS) or source.endswith(SET_FILES):
        return True
    url = source.partition("?")[0]
    folder = Path(url.removeprefix("file://"))
    if "://" in url.removeprefix("file://") or not (_saved_folder(folder) or _parquet_in(folder, "*/*.parquet")):
        return False
    return recorded_manifest(open_store(url, store_config)) is None


def _saved_folder(folder: Path) -> bool:
    return any((folder / f).is_file() for f in SAVED_DATASET_FILES)


def _parquet_in(folder: Path, *patterns: str) -> list[Path]:
    """The Parquet files in `folder` at its top (and matching `patterns`), in name order."""
    return sorted(f for pattern in ("*.parquet", *patterns) for f in folder.glob(pattern) if f.is_file())


def _layout_of(row: dict[str, Any], named: str | None, source: str) -> Layout | None:
    """The layout of a set from its first row (None: plain), or the one named, checked to have its columns."""
    columns = set(row)
    if named is not None:
        # The first form of that name whose text columns the row has (MBPP's `text`, else its sanitized `prompt`).
        forms = [layout for layout in LAYOUTS if layout.name == named]
        found = next((layout for layout in forms if set(layout.text) <= columns and layout.fits(row)), None)
        if found is None:
            others = f" (nor {' nor '.join(f.describe() for f in forms[1:])})" if len(forms) > 1 else ""
            raise EvalError(
                f"prompts {source} has columns {sorted(columns)}, not the {forms[0].describe()} of the {named} layout"
                f"{others}; name the set it holds with --prompt-set, or give a file of that set"
            )
        return found
    for layout in LAYOUTS:
        if set(layout.signature) <= columns and layout.fits(row):
            return layout
    if columns & set(PLAIN_COLUMNS):
        return None
    raise EvalError(
        f"prompts {source} has columns {sorted(columns)}, a layout eval does not know; known: {known_layouts()}; "
        "rename the prompt's column or convert the file to one of them"
    )


def _as_chat(row: dict[str, Any], layout: Layout, where: str) -> dict[str, Any]:
    turn = layout.user_turn(row)
    if turn is None:
        raise EvalError(f"{where}: a {layout.name} row needs {layout.describe()} as text; fix that row")
    return {"messages": [{"role": "user", "content": turn}]}


def _text_lines(path: Path, name: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 file (a BOM before line 1 dropped), gunzipped when `name` ends in
    .gz. EvalError naming the line and the byte for bytes that are not UTF-8 (a file saved as Latin-1, say), and the
    file for one that does not read (a gzip stream cut short or not gzip at all)."""
    try:
        with gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                raw = raw.removeprefix(codecs.BOM_UTF8) if lineno == 1 else raw
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise EvalError(f"{name} line {lineno} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                    f"{exc.start + 1}); save the file as UTF-8") from None
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError; a stream cut short is an EOFError
        kind = "a gzip file" if name.endswith(".gz") else "a file"
        raise EvalError(f"{name} does not read as {kind} ({exc}); give it whole, or uncompressed") from None


def jsonl_rows(path: Path, name: str, limit: int) -> list[tuple[str, dict[str, Any]]]:
    """Up to `limit` (where, row) pairs of a JSON Lines file, `where` naming its line for messages."""
    return _object_lines(_text_lines(path, name), name, limit)


def _object_lines(lines: Iterable[tuple[int, str]], name: str, limit: int) -> list[tuple[str, dict[str, Any]]]:
    """Up to `limit` rows of JSON Lines, one object per line (blank lines skipped)."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for lineno, line in lines:
        if not line.strip():
            continue
        where = f"{name} line {lineno}"
        try:
            row = loads_row(line)
        except ValueError as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise EvalError(f"{where} is not valid JSON ({why}); fix that line") from None
        if not isinstance(row, dict):
            raise EvalError(f"{where} is not a JSON object; give one prompt object per line")
        rows.append((where, row))
        if len(rows) >= limit:
            break
    return rows


def _json_rows(path: Path, name: str, limit: int) -> list[tuple[str, dict[str, Any]]]:
    """Up to `limit` rows of a `.json` file: a JSON array of objects (Alpaca's `alpaca_data.json`), parsed whole; a file
    whose first character is not `[` is read as JSON Lines (many sets name those `.json`)."""
    lines = _text_lines(path, name)
    start, first = next(((lineno, line) for lineno, line in lines if line.strip()), (0, ""))
    if not first.lstrip().startswith("["):
        return _object_lines(itertools.chain([(start, first)], lines), name, limit)
    text = first + "".join(line for _, line in lines)
    try:
        items = loads_row(text)
    except ValueError as exc:
        why = f"{exc.msg} at line {exc.lineno + start - 1}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise EvalError(f"{name} is not valid JSON ({why}); fix the file, or give one prompt object per line") from None
    rows: list[tuple[str, dict[str, Any]]] = []
    for index, row in enumerate(items[:limit], 1):
        if not isinstance(row, dict):
            raise EvalError(f"{name} item {index} is not a JSON object; give an array of prompt objects")
        rows.append((f"{name} item {index}", row))
    return rows


def _parquet_rows(path: Path, name: str, limit: int) -> list[tuple[str, dict[str, Any]]]:
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=min(limit, 1024))
        return _numbered(name, (row for batch in batches for row in batch.to_pylist()), limit)
    except (pa.ArrowException, OSError) as exc:
        raise EvalError(f"{name} is not a readable Parquet file ({exc}); give a Parquet or JSONL file") from None


def _parquet_folder_rows(source: str, limit: int) -> tuple[list[tuple[str, dict[str, Any]]], InputRef]:
    """The rows of one split of a local folder of Parquet files, as the Hub keeps a set's config (`gsm8k/main/` holding
    `train-00000-of-00001.parquet` and `test-00000-of-00001.parquet`): a file's split is its name up to the first `-`;
    `?split=NAME` picks one, else `test`, else the only one. Its files are read in name order. A folder holding Parquet
    files only one folder down (a snapshot's root, one folder per config) is refused naming those folders. Pinned by the
    rows read, as a hub dataset is, not by its files: a snapshot in the Hub's cache links its files to blobs outside it,
    which a folder pin (`folder_input`) refuses."""
    url, _, query = source.partition("?")
    folder = Path(url.removeprefix("file://"))
    files = _parquet_in(folder)
    if not files:
        inner = sorted({f.parent.name for f in _parquet_in(folder, "*/*.parquet")})
        raise EvalError(f"prompts {source} holds Parquet files only in its folders {', '.join(inner)}; pass one of "
                        f"them as --prompts, e.g. {folder / inner[0]}")
    splits: dict[str, list[Path]] = {}
    for f in files:
        splits.setdefault(f.name.removesuffix(".parquet").split("-", 1)[0], []).append(f)
    asked = parse_qs(query).get("split", [None])[0]
    chosen = asked or ("test" if "test" in splits else next(iter(splits)) if len(splits) == 1 else None)
    if chosen not in splits:
        raise EvalError(f"prompts {source} has splits {sorted(splits)} (its Parquet files SPLIT-*.parquet); name one "
                        f"as {url}?split=NAME")
    rows: list[tuple[str, dict[str, Any]]] = []
    for f in splits[chosen]:
        rows += _parquet_rows(f, f.name, limit - len(rows))
        if len(rows) >= limit:
            break
    return rows, _dataset_ref(source, rows)


def _numbered(name: str, rows: Iterator[dict[str, Any]], limit: int) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for index, row in enumerate(rows, 1):
        out.append((f"{name} row {index}", row))
        if len(out) >= limit:
            break
    return out


def _dataset_ref(url: str, rows: list[tuple[str, dict[str, Any]]]) -> InputRef:
    """Rows with no object or folder to pin are pinned by the sha256 of the rows eval read, which `status` cannot read
    again (it says so: `State.UNCHECKED`)."""
    digest = hashlib.sha256(json.dumps([row for _, row in rows], sort_keys=True, default=str).encode()).hexdigest()
    return InputRef(kind="dataset", url=url, sha256=digest)


def _one_split(dataset: Any, split: str | None, source: str) -> Any:
    """The split eval reads of a DatasetDict: the one asked for, else `test`, else the only one."""
    import datasets

    if isinstance(dataset, datasets.Dataset):
        return dataset
    names = list(dataset)
    chosen = split or ("test" if "test" in names else names[0] if len(names) == 1 else None)
    if chosen not in names:
        raise EvalError(f"prompts {source} has splits {names}; name one as {source.split('?')[0]}?split=NAME")
    return dataset[chosen]


def _saved_rows(source: str, limit: int) -> tuple[list[tuple[str, dict[str, Any]]], InputRef]:
    """The rows of a local folder `datasets.save_to_disk` wrote (a Dataset or a DatasetDict), pinned by its files."""
    import datasets

    url, _, query = source.partition("?")
    folder = Path(url.removeprefix("file://"))
    try:
        dataset = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as exc:
        raise EvalError(f"prompts {source} is neither a prompts file ({', '.join(SET_FILES)}) nor a folder `datasets` "
                       f"saved ({exc})") from None
    split = parse_qs(query).get("split", [None])[0]
    rows = _numbered(folder.name, _head(dataset, split, source, limit), limit)
    return rows, folder_input(open_store(folder))  # every file it holds, which `status` checks again


def _head(dataset: Any, split: str | None, source: str, limit: int) -> Iterator[dict[str, Any]]:
    chosen = _one_split(dataset, split, source)
    return iter(chosen.select(range(min(limit, len(chosen)))).to_list())


def _hub_rows(source: str, limit: int) -> tuple[list[tuple[str, dict[str, Any]]], InputRef]:
    """The rows of `hf://datasets/NAME[?config=C&split=S]` through `datasets.load_dataset`: from the hub when it is
    reachable, else from the local cache `datasets` keeps (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE read only that)."""
    import datasets

    parts = urlsplit(source)
    name = parts.path.strip("/")
    query = parse_qs(parts.query)
    config, split = query.get("config", [None])[0], query.get("split", [None])[0]
    if not name:
        raise EvalError(f"prompts {source} names no dataset; give hf://datasets/OWNER/NAME")
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EvalError(
            f"prompts {source} does not load through datasets ({first}); check the name (and ?config=, ?split=), the "
            "network, or download it with `datasets` first"
        ) from None
    rows = _numbered(name, _head(dataset, split, source, limit), limit)
    return rows, _dataset_ref(source, rows)


__all__ = [
    "HF_DATASETS", "LAYOUTS", "LAYOUT_NAMES", "PLAIN", "SET_FILES", "Layout", "PromptSet", "is_prompt_set",
    "known_layouts", "jsonl_rows", "read_prompt_set",
]
