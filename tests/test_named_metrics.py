"""Figures travel by name (issue 42): the loss gives named sums, one record (`metrics.Figures`) is made of them, and the
metrics log, the trackers, the held-out figures and the curves read it by name.

Two checks keep it so: no module under src/blockdraft/stages reads a figure at a computed offset (checked on the source
with `ast`), and a short run that computes every figure there is (DFlash2 and distillation) logs each one, for training
and held-out rows, and reads every sum the loss gives.
"""

from __future__ import annotations

import ast
import json
from dataclasses import fields
from pathlib import Path

import pytest
from helpers.train_data import config_file, make_rows, write_tokenized

from blockdraft.config import load_config
from blockdraft.stages.train import run
from blockdraft.stages.train.metrics import NOT_TRACKED, Figures, tracked_scalars

STAGES = Path(__file__).resolve().parent.parent / "src" / "blockdraft" / "stages"


def _numbers(expr: ast.expr) -> list[int]:
    return [n.value for n in ast.walk(expr) if isinstance(n, ast.Constant) and type(n.value) is int]


def _ops(expr: ast.expr) -> list[ast.operator]:
    return [n.op for n in ast.walk(expr) if isinstance(n, ast.BinOp)]


def _computed(expr: ast.expr) -> bool:
    """Arithmetic on something that is not a number (a name, an attribute, a call)."""
    operands = (ast.Name, ast.Attribute, ast.Call, ast.Subscript)
    return isinstance(expr, ast.BinOp) and any(isinstance(n, operands) for n in ast.walk(expr))


def _stride(expr: ast.expr) -> bool:
    """An offset through a packed layout: computed arithmetic that multiplies, or that shifts by a number other than
    0 or 1 (1 is the next item: `steps[index + 1:]`; `3 + k`, `1 + 2 * n` are positions in a layout)."""
    multiplies = any(isinstance(op, ast.Mult) for op in _ops(expr))
    return _computed(expr) and (multiplies or any(v not in (0, 1) for v in _numbers(expr)))


def _size(expr: ast.expr) -> bool:
    """`x.numel()`, `x.size(...)` or `len(x)`."""
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    method = isinstance(func, ast.Attribute) and func.attr in ("numel", "size")
    return method or (isinstance(func, ast.Name) and func.id == "len")


def positional_reads(source: str) -> list[str]:
    """The places in `source` that read a figure by its position: a subscript whose index or slice bound is a stride
    (`totals[1 + 2 * n : 1 + 3 * n]`, `p[3 + k]`), and a size compared with a start plus a stride (`totals.numel() >
    2 + 4 * n`: whether a packed vector holds a tail of optional figures)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript):
            parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            bounds = [b for p in parts for b in ((p.lower, p.upper, p.step) if isinstance(p, ast.Slice) else (p,))]
            bounds = [b for b in bounds if b is not None]
            if any(_stride(b) for b in bounds):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            shifted = [s for s in sides if _stride(s) and any(isinstance(op, ast.Add | ast.Sub) for op in _ops(s))]
            if shifted and any(_size(s) for s in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_rule_finds_figures_read_by_position_and_passes_plain_indexing():
    # The step's figures as they were read before issue 42, and the curves' points.
    packed = """
correct, counted, ce = totals[1 : 1 + n], totals[1 + n : 1 + 2 * n], totals[1 + 2 * n : 1 + 3 * n]
tokens = totals[1 + 4 * n]
if totals.numel() > 2 + 4 * n:
    rest = totals[2 + 4 * n :]
values = [p[3 + k] for p in points]
"""
    assert len(positional_reads(packed)) == 6  # all but totals[1 : 1 + n], which the lines beside it give away
    plain = """
rows = idx[first : first + batch_size]
later = steps[index + 1 :]
last = prefix[:, -1]
head = x[: n - 1]
if len(points) == 2 * max_points:
    pass
"""
    assert positional_reads(plain) == []


def test_no_stage_reads_a_figure_by_position():
    found = {str(p.relative_to(STAGES)): positional_reads(p.read_text()) for p in sorted(STAGES.rglob("*.py"))}
    found = {module: hits for module, hits in found.items() if hits}
    assert found == {}


DFLASH2 = 'architecture = "dflash2"\nselector_rank = 32\nselector_top_k = 8\n'


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(4, prompt_len=6, new_tokens=24, seed=5)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:3], rows[3:])


class _Reads(dict):
    """A dict that remembers which names were read with [ ]."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


def test_every_figure_the_step_computes_reaches_metrics_jsonl_and_the_trackers(tmp_path, data_url, monkeypatch):
    unread: list[set[str]] = []
    of_sums = Figures.of_sums.__func__  # type: ignore[attr-defined]

    def recording(cls, sums, denominator):
        reads = _Reads(sums)
        figures = of_sums(cls, reads, denominator)
        unread.append(set(reads) - reads.read)
        return figures

    monkeypatch.setattr(Figures, "of_sums", classmethod(recording))
    # DFlash2 and distillation: every figure `Figures` has is computed.
    path = config_file(tmp_path, data_url, max_steps=2, checkpoint_every=2, batch_size=3, distill_weight=0.5)
    text = path.read_text().replace('architecture = "dflash"\n', "")
    path.write_text(text.replace("intermediate_size = 96\n", f"intermediate_size = 96\n{DFLASH2}"))
    run(load_config(path))

    assert len(unread) == 3 and unread == [set()] * 3  # two steps and one held-out measurement read every sum there is
    entries = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    names = {f.name for f in fields(Figures)}
    assert [e["step"] for e in entries] == [1, 2] and "eval" in entries[-1]
    for figures in (*entries, entries[-1]["eval"]):
        assert names <= figures.keys()
        assert figures["distill_kl"] > 0 and 0.0 <= figures["selector_accuracy"] <= figures["candidate_recall"] <= 1.0
    scalars = tracked_scalars(entries[-1])  # every figure reaches the trackers, the held-out ones too
    assert {name.split("/")[1] for name in scalars} == (entries[-1].keys() | names) - NOT_TRACKED - {"eval"}
    assert {name.split("/")[1] for name in scalars if name.startswith("eval/")} == names - NOT_TRACKED
