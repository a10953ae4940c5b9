"""One name, one thing: no two modules in `src/blockdraft` define a public function or class of the same name, so a name
read in a stage, a test or a doc points at one definition (a grep for it finds that one).

Three kinds of name are one interface defined many times, always reached through the module, and are not counted:
- the stage protocol (`STAGE_PROTOCOL`): every stage package's `run`, and the `summary_lines` the CLI prints of its
  result;
- a CLI command (`@app.command()` in `cli.py`): named for what the user types, and calling the function of that name;
- `main` of a module run with `python -m` (one that has an `if __name__ == "__main__":` block)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "blockdraft"

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
STAGE_PROTOCOL = {"run", "summary_lines"}


def _is_command(node: ast.stmt) -> bool:
    """A function registered as a CLI command (`@app.command()`)."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
               for d in getattr(node, "decorator_list", []))


def _runs_as_main(tree: ast.Module) -> bool:
    """Whether the module has an `if __name__ == "__main__":` block."""
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def public_definitions(source: str, module: str = "") -> set[str]:
    """The public (no leading underscore) functions and classes a module defines at its top level, including inside
    top-level `if` and `try` blocks (a definition per platform or per optional import is still the module's), less the
    interfaces named in this file's docstring (`module`, as "blockdraft/stages/eval/stage.py", says where it is)."""
    tree = ast.parse(source)
    exempt = STAGE_PROTOCOL if module.startswith("blockdraft/stages/") else set()
    if _runs_as_main(tree):
        exempt = exempt | {"main"}
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, Definition):
            if not node.name.startswith("_") and node.name not in exempt and not _is_command(node):
                names.add(node.name)
        elif isinstance(node, ast.If):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return names


def shared_names(modules: dict[str, str]) -> dict[str, list[str]]:
    """{name: the modules defining it} for every public name that more than one module defines."""
    where: dict[str, list[str]] = defaultdict(list)
    for module, source in sorted(modules.items()):
        for name in public_definitions(source, module):
            where[name].append(module)
    return {name: places for name, places in sorted(where.items()) if len(places) > 1}


def test_the_rule_sees_functions_and_classes_and_skips_private_and_nested_ones():
    one = "def load(): pass\nclass Store: pass\ndef _helper(): pass\nclass Outer:\n    def load(self): pass\n"
    two = "def load(): pass\nif True:\n    class Store: pass\ndef outer():\n    def _helper(): pass\n"
    assert public_definitions(one) == {"load", "Store", "Outer"}
    assert shared_names({"a": one, "b": two}) == {"Store": ["a", "b"], "load": ["a", "b"]}
    assert shared_names({"a": one, "b": "def save(): pass\n"}) == {}


def test_the_interfaces_defined_many_times_are_not_counted():
    command = "@app.command()\ndef push(): pass\n"
    stage = "def run(): pass\ndef summary_lines(): pass\n"
    entry = "def main(): pass\nif __name__ == '__main__':\n    main()\n"
    assert public_definitions(command) == set()
    assert public_definitions(stage, "blockdraft/stages/eval/stage.py") == set()
    assert public_definitions(stage, "blockdraft/store/output.py") == {"run", "summary_lines"}
    assert public_definitions(entry) == set()
    assert public_definitions("def main(): pass\n") == {"main"}


def test_no_two_modules_define_the_same_public_name():
    modules = {str(p.relative_to(SRC.parent)): p.read_text() for p in SRC.rglob("*.py")}
    assert shared_names(modules) == {}
