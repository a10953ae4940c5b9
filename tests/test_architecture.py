"""The layout's rules, checked on the source itself so they cannot erode: imports go downward only (cli/pipeline -> stages ->
model/decode/data -> store/config/errors/reporter), no stage imports another, no import cycle, no module over 400 lines,
and the project cites only its own docs."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "blockdraft"

# Higher layers may import lower ones, never the reverse; the same layer may import itself.
LAYERS = {
    "cli": 4, "pipeline": 4, "__main__": 4, "console": 4,
    "stages": 3, "fixtures": 3,
    "model": 2, "decode": 2, "data": 2,
    "store": 1,
    "config": 0, "errors": 0, "reporter": 0, "__init__": 0,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports() -> dict[str, set[str]]:
    """{module: the blockdraft modules it imports (at any depth of the file)}."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("blockdraft"):
                for alias in node.names:
                    found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("blockdraft"))
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else 0


def test_imports_go_downward_only_and_no_stage_imports_another():
    wrong = []
    for module, imported in internal_imports().items():
        for target in imported:
            if target == "blockdraft":
                continue
            if module.startswith("blockdraft.stages.") and target.startswith("blockdraft.stages."):
                if module.split(".")[2] != target.split(".")[2]:
                    wrong.append(f"{module} -> {target} (one stage imports another)")
            elif layer(target) > layer(module):
                wrong.append(f"{module} -> {target} (upward)")
    assert wrong == []


def test_there_is_no_import_cycle():
    edges = internal_imports()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_the_project_cites_only_its_own_docs():
    root = SRC.parent.parent
    try:
        listed = subprocess.run(["git", "grep", "-n", "-F", "../shared", "--", "src", "tests", "README.md", "docs", "bench"],
                                cwd=root, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if listed.returncode == 128:
        pytest.skip("not a git checkout")
    hits = [line for line in listed.stdout.splitlines() if not line.startswith("tests/test_architecture.py")]
    assert hits == []
