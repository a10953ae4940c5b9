"""The layout's rules, checked on the source itself so they cannot erode: imports go downward only (cli/pipeline ->
stages -> model/decode/data -> store/config/errors/reporter), no stage imports another, no import cycle,
and nothing points outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "blockdraft"

# Higher layers may import lower ones, never the reverse; the same layer may import itself.
LAYERS = {
    "cli": 4, "cli_options": 4, "pipeline": 4, "__main__": 4, "console": 4,
    "stages": 3, "fixtures": 3,
    "model": 2, "decode": 2, "data": 2, "engine_process": 2,
    "vllm_connector": 2,  # runs inside vLLM's process and imports nothing of blockdraft
    "store": 1,
    "config": 0, "overrides": 0, "added_tokens": 0, "errors": 0, "reporter": 0, "__init__": 0,
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
                    found.add(
                        f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    )
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


def test_the_project_cites_no_path_outside_the_repository():
    """Code, tests, benchmarks and docs point at docs/ or files in the repository, never at a folder beside it (a
    relative path that climbs above the repository root)."""
    root = SRC.parent.parent
    texts = [*SRC.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "bench").rglob("*.py"),
             *(root / "docs").glob("*.md"), root / "README.md"]
    above = re.compile(r"(?<![.\w])\.\./\w")  # two dots, a slash, a name; an ellipsis such as `.../v1` is not one
    hits = [
        f"{p.relative_to(root)}:{n}"
        for p in texts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if above.search(line)
    ]
    assert hits == []


STAGE_RUN = ("run(config: BlockdraftConfig, input, output, reporter: Reporter | None = None, *, force: bool = False, "
             "**options) -> StageResult")


def _stage_run_shape(fn: ast.FunctionDef) -> str:
    """`fn`'s signature written as STAGE_RUN writes it: the stage's own keyword-only options (after `force`) as
    **options."""
    a = fn.args
    params = [arg.arg for arg in a.args]
    ann = {arg.arg: ast.unparse(arg.annotation) if arg.annotation else "" for arg in [*a.args, *a.kwonlyargs]}
    if params != ["config", "input", "output", "reporter"] or not a.kwonlyargs or a.kwonlyargs[0].arg != "force":
        return f"run({', '.join(params)}, *, {', '.join(k.arg for k in a.kwonlyargs)})"
    reporter_default = ast.unparse(a.defaults[-1]) if a.defaults else ""
    force_default = ast.unparse(a.kw_defaults[0]) if a.kw_defaults[0] is not None else ""
    return (f"run(config: {ann['config']}, input, output, reporter: {ann['reporter']} = {reporter_default}, *, "
            f"force: {ann['force']} = {force_default}, **options) -> {ast.unparse(fn.returns) if fn.returns else ''}")


def test_every_stage_run_has_the_one_signature():
    """Every stage is called the same way (`docs/ARCHITECTURE.md`): the config, where it reads, where it writes, who
    hears of it, and whether a dead writer's lease is taken over; a stage's own options come after, by keyword only."""
    stages = sorted((SRC / "stages").glob("*/stage.py"))
    assert len(stages) == 5
    shapes = {}
    for path in stages:
        run = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "run")
        shapes[path.parent.name] = _stage_run_shape(run)
    assert shapes == dict.fromkeys(shapes, STAGE_RUN)


def _is_script_main(node: ast.AST, tree: ast.Module) -> bool:
    """A module-level `main()` of a module run as a script (`if __name__ == "__main__"`): its stdout is its product."""
    runs_as_script = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    return runs_as_script and isinstance(node, ast.FunctionDef) and node.name == "main" and node in tree.body


def test_the_library_never_prints():
    """Output goes through a Reporter; only the command line (cli.py: its stdout lines are what a user pipes on) and the
    `main()` of a module run as a script print."""
    hits = []
    for path in SRC.rglob("*.py"):
        if path.name == "cli.py":
            continue
        tree = ast.parse(path.read_text())
        allowed = {id(n) for top in tree.body if _is_script_main(top, tree) for n in ast.walk(top)}
        hits += [f"{path.relative_to(SRC)}:{n.lineno}" for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
                 and id(n) not in allowed]
    assert hits == []


ENV_WRITES = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def test_the_library_never_writes_the_environment():
    """Settings travel as parameters and command lines (a rank gets `--force` and `--set` on its own), never through
    this process's environment: no `os.environ[...] =`, `del os.environ[...]`, `os.environ.update/setdefault/pop`,
    `os.putenv`."""
    hits = []
    for path in SRC.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            targets = (n.targets if isinstance(n, (ast.Assign, ast.Delete))
                       else [n.target] if isinstance(n, ast.AugAssign) else [])
            written = any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ" for t in targets)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                owner = ast.unparse(n.func.value)
                written |= (owner == "os.environ" and n.func.attr in ENV_WRITES) or (
                    owner == "os" and n.func.attr in ("putenv", "unsetenv")
                )
            if written:
                hits.append(f"{path.relative_to(SRC)}:{n.lineno}")
    assert hits == []


# What reading a manifest is, outside the store: importing or calling the function that reads one (`read_manifest`),
# parsing one (`Manifest.model_validate_json`), or reading the manifest's file by name (`read_bytes(MANIFEST_NAME)`).
# Allowed, and not counted: the `.manifest` of what the store's API returns after verifying the artifact, a
# `VerifyReport` (`verify_artifact`) or a `StageInput` (`open_input`), and `recorded_manifest`'s: the store read and
# checked it, and the caller only names the verified artifact's kind or lists its files (pipeline.py's read-back of each
# demo step, model/formats.py finding the newest verified checkpoint). Whether an output is done stays `StageOutput`'s.
MANIFEST_READERS = {"read_manifest"}
STORE_READS = {"read_bytes", "open_read", "get_file"}


def manifest_reads(source: str) -> list[str]:
    """Where `source` reads a manifest itself, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("blockdraft.store"):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in MANIFEST_READERS]
        elif isinstance(node, ast.Attribute) and node.attr in MANIFEST_READERS:
            found.append(f"{node.lineno}: uses {node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "model_validate_json"
                and isinstance(func.value, ast.Name)
                and func.value.id == "Manifest"
            ):
                found.append(f"{node.lineno}: parses a Manifest")
            reads = isinstance(func, ast.Attribute) and func.attr in STORE_READS
            if reads and any(
                isinstance(arg, ast.Name) and arg.id == "MANIFEST_NAME"
                for arg in [*node.args, *(k.value for k in node.keywords)]
            ):
                found.append(f"{node.lineno}: reads MANIFEST_NAME")
    return found


def test_no_module_outside_the_store_reads_a_manifest():
    """Stages, pipeline.py, cli.py (and model/, data/) go through StageOutput, StageInput and the store's functions."""
    assert manifest_reads("from blockdraft.store.artifact import State, read_manifest\n") == [
        "1: imports read_manifest"
    ]
    assert manifest_reads("import blockdraft.store.manifest as m\nm.read_manifest(s)\n") == ["2: uses read_manifest"]
    assert manifest_reads("Manifest.model_validate_json(store.read_bytes(MANIFEST_NAME))\n") == [
        "1: parses a Manifest", "1: reads MANIFEST_NAME"]
    outside = [p for p in SRC.rglob("*.py") if "store" not in p.relative_to(SRC).parts]
    reads = {str(p.relative_to(SRC)): hits for p in outside if (hits := manifest_reads(p.read_text()))}
    assert reads == {}


def test_model_imports_the_store_only_in_formats():
    """model/ is the drafter and the target; only model/formats.py, which names and finds drafter artifacts, knows the
    store."""
    wrong = {
        m: sorted(t for t in imported if t.startswith("blockdraft.store"))
        for m, imported in internal_imports().items()
        if m.startswith("blockdraft.model") and m != "blockdraft.model.formats"
    }
    assert {m: t for m, t in wrong.items() if t} == {}


LEASE_NAMES = {"Lease", "LeaseRecord", "_read_lease", "_held_here", "_holds_live", "_busy_error"}
MARK_WRITES = {"put_bytes", "put_bytes_if_absent", "delete"}


def test_only_the_output_module_takes_a_lease_or_decides_ownership():
    """Whether an output is done and who may write it is one module's (`store/output.py`), with its lease in
    `store/lease.py`: no other module imports the lease's parts, or writes or deletes the lease or the writing mark (a
    stage holding a folder of outputs asks `writer_lease`)."""
    found = []
    for path in SRC.rglob("*.py"):
        if module_name(path) in {"blockdraft.store.output", "blockdraft.store.lease"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found += [f"{module_name(path)}: imports {a.name}" for a in node.names if a.name in LEASE_NAMES]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MARK_WRITES:
                names = {n.id for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Name)}
                found += [
                    f"{module_name(path)}: {node.func.attr}({name})" for name in names & {"LEASE_NAME", "WRITING_NAME"}
                ]
    assert found == []
