"""How much a reader must follow for one stage: the blockdraft modules and classes it reaches, and the store names it
uses.

    .venv/bin/python -m bench.concepts [tokenize train ...] [--src SRC] [--surface MODULE ...]

Not a timing: a count read from the source with `ast`, nothing imported. For each stage, starting from its package
(`blockdraft.stages.NAME`, every module in it), every `import` / `from ... import` of a blockdraft module is followed,
at module level and inside functions alike (a lazy import is still code the command runs), until nothing new is
reached. A `from package import name` reaches the submodule `package.name` when there is one, else the package.
Reported per stage:

- modules: blockdraft modules reached (packages' `__init__` included);
- classes: classes defined in them (every `class` statement, private ones included);
- store names: the distinct names the stage's own modules import from `blockdraft.store` (what a stage's author must
  know of the store: types, functions, constants), listed.

`--surface` lists what modules export (`__all__`), their classes among them; `--src` counts another checkout's `src`
(an older commit, for a before/after figure).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"  # --src replaces it
ROOT = "blockdraft"


def _module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _parse(name: str) -> ast.Module:
    path = _module_file(name)
    assert path is not None, name
    return ast.parse(path.read_text(), str(path))


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from` import names (relative imports resolved against `importer`)."""
    if not node.level:
        return node.module or ""
    is_package = _module_file(importer) == SRC.joinpath(*importer.split(".")) / "__init__.py"
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(name: str) -> list[tuple[str, list[str]]]:
    """(blockdraft module, names imported from it) for every import statement in module `name`."""
    found = []
    for node in ast.walk(_parse(name)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == ROOT]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(name, node)
            if module.split(".")[0] == ROOT:
                found.append((module, [alias.name for alias in node.names]))
    return found


def reached_by(module: str, names: list[str]) -> list[str]:
    """The modules one import statement reaches: the named submodules where they exist, else the module itself."""
    subs = [f"{module}.{n}" for n in names if _module_file(f"{module}.{n}") is not None]
    return subs if subs and len(subs) == len(names) else [module, *subs]


def stage_modules(stage: str) -> list[str]:
    package = SRC / ROOT / "stages" / stage
    return sorted(
        f"{ROOT}.stages.{stage}" + ("" if p.stem == "__init__" else f".{p.stem}") for p in package.glob("*.py")
    )


def closure(start: list[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name in seen or _module_file(name) is None:
            continue
        seen.add(name)
        # Importing a submodule runs its parents' __init__ first.
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for module, names in imports_of(name):
            todo += reached_by(module, names)
    return seen


def classes_in(modules: set[str]) -> int:
    return sum(isinstance(node, ast.ClassDef) for name in modules for node in ast.walk(_parse(name)))


def store_names(stage: str) -> list[str]:
    names = set()
    for name in stage_modules(stage):
        for module, imported in imports_of(name):
            if module == f"{ROOT}.store" or module.startswith(f"{ROOT}.store."):
                names.update(imported)
    return sorted(names)


def surface(module: str) -> tuple[list[str], list[str]]:
    """A module's exported names (`__all__`) and, of them, the classes it defines."""
    tree = _parse(module)
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = list(ast.literal_eval(node.value))
    defined = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    return exported, [name for name in exported if name in defined]


def main() -> None:
    global SRC
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="*", default=["tokenize", "train"])
    parser.add_argument("--src", type=Path, default=SRC, help="the src folder to read (another checkout's)")
    parser.add_argument("--surface", nargs="+", default=[], metavar="MODULE", help="e.g. blockdraft.store.output")
    args = parser.parse_args()
    SRC = args.src.resolve()
    names, classes = set(), set()
    for module in args.surface:
        exported, defined = surface(module)
        names.update(exported)
        classes.update(defined)
        print(f"{module}: {len(exported)} names ({', '.join(exported)}); classes: {', '.join(defined) or 'none'}")
    if args.surface:
        print(f"together: {len(names)} distinct names, {len(classes)} classes")
        return
    for stage in args.stages:
        reached = closure(stage_modules(stage))
        used = store_names(stage)
        print(f"{stage}: {len(reached)} modules, {classes_in(reached)} classes; {len(used)} store names: "
              f"{', '.join(used)}")


if __name__ == "__main__":
    main()
