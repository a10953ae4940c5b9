"""How far the one config travels from a function: the rooms it enters and the times it climbs back up.

    .venv/bin/python -m bench.config_walk [FUNCTION ...] [--given PARAMETER=PART ...] [--src SRC] [--list]

Not a timing: a count read from the source with `ast`, nothing imported. FUNCTION is a dotted name under `src/`
(`blockdraft.stages.train.setup.build_training` by default; `module.Class` starts at the class's constructor).

Parts. The start's parameters annotated `BlockdraftConfig` or one of the section classes of `blockdraft/config.py`
hold parts: the root `config`, or the section their annotation names (`config.train`). Below a
part: its fields (`config.train`, `config.train.seed`; a section's field names are read from `config.py`).
`part.resolved()` / `part.model_dump()` make a dict of the part, another part written `config{}`; `d["train"]` and
`d.get("train")` reach below a dict part (`config{}.train`); `part.model_copy(...)` is the same part. Building a new
dict around a dict part (`{**d, "x": ...}`) reaches nothing below it.

The walk. In a function, a name holds a part when it is a parameter given one or is assigned one (`tc = config.train`,
`data = config.resolved()`, `self.x = ...`, a call's result when the called function returns a part). Every call in
the body to a function or class defined under `src/blockdraft` (a name defined or imported in the module,
`Class.method`, `self.method`) that passes a part, positionally or by keyword, is followed into the parameter it lands
in; a class is entered through its constructor (`__init__`, or a dataclass's fields), and the parts it keeps on `self`
are held by every method of the class. One setting (a field whose value is not a section: `config.train.seed`) is
reached but not followed. Nested functions and lambdas are read as part of the function around them. Not followed: a
method called on any other object, a part kept in another object's field and read back outside its class,
`*args`/`**kwargs`.

Counted:

- rooms: the distinct (function or class, part it holds) pairs the walk enters: the parts it was given and those it
  binds to a name (`tc = config.train` is a room of its own), the start's included;
- climbs: in each room whose part is the root (`config`, or `config{}`, counted apart), the distinct sections it
  reaches through that part (`train`, `store`, ...; not through a section handed to the function as a parameter of its
  own), less one: having gone down into one section, each other section is reached by climbing back up to the root. A
  function given its sections one by one climbs nowhere.

`--list` prints each room and each climb; `--given recorded=config{}` says what a start parameter that no annotation
names is given by its callers (a dict made of the config); `--src` reads another checkout's `src` (an older commit, for
a before figure).
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"  # --src replaces it
ROOT = "blockdraft"
ROOT_CLASS = "BlockdraftConfig"
DICT_METHODS = ("resolved", "model_dump")


@dataclass(frozen=True)
class Part:
    """A config part: `path` of field names below the root; `dict_at`: how much of the path was turned into a dict
    (None: the objects themselves)."""

    path: tuple[str, ...]
    dict_at: int | None = None

    def below(self, name: str) -> Part:
        return Part((*self.path, name), self.dict_at)

    def as_dict(self) -> Part:
        return self if self.dict_at is not None else Part(self.path, len(self.path))

    def __str__(self) -> str:
        if self.dict_at is None:
            return ".".join(("config", *self.path))
        return (
            ".".join(("config", *self.path[: self.dict_at]))
            + "{}"
            + "".join(f".{p}" for p in self.path[self.dict_at :])
        )


class Source:
    """The modules under SRC: parsed once, with what each defines and imports."""

    def __init__(self) -> None:
        self.trees: dict[str, ast.Module] = {}
        self.sections = self._sections()

    def module_file(self, name: str) -> Path | None:
        base = SRC.joinpath(*name.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            path = self.module_file(module)
            self.trees[module] = ast.parse(path.read_text(), str(path)) if path else ast.Module([], [])
        return self.trees[module]

    def _sections(self) -> dict[str, dict[str, str | None]]:
        """{config class: {field: the field's config class, or None}} from config.py's class bodies."""
        tree = self.tree(f"{ROOT}.config")
        assert tree is not None
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
        names = {c.name for c in classes}
        found: dict[str, dict[str, str | None]] = {}
        for c in classes:
            fields = {
                s.target.id: s.annotation
                for s in c.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            if fields:
                found[c.name] = {
                    k: a.id if isinstance(a, ast.Name) and a.id in names else None for k, a in fields.items()
                }
        return found

    def type_of(self, part: Part) -> str | None:
        kind: str | None = ROOT_CLASS
        for name in part.path:
            kind = self.sections.get(kind or "", {}).get(name)
        return kind

    def is_setting(self, part: Part) -> bool:
        """Whether `part` is one setting (a field whose value is not a config section): reached, never followed."""
        return bool(part.path) and self.type_of(part) is None

    def is_field(self, part: Part, name: str) -> bool:
        return name in self.sections.get(self.type_of(part) or "", {})

    def imports(self, module: str) -> dict[str, tuple[str, str]]:
        """{local name: (module, name)} for every `from blockdraft... import` in `module` (lazy ones included)."""
        found = {}
        is_package = (self.module_file(module) or Path()).name == "__init__.py"
        for node in ast.walk(self.tree(module) or ast.Module([], [])):
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    parts = module.split(".") if is_package else module.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    source = ".".join([*parts, source] if source else parts)
                if source.split(".")[0] == ROOT:
                    found.update({alias.asname or alias.name: (source, alias.name) for alias in node.names})
        return found

    def lookup(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.FunctionDef | ast.ClassDef] | None:
        """Where `name`, as seen in `module`, is defined: (its module, its def or class), following re-exports."""
        tree = self.tree(module)
        for node in tree.body if tree else []:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return module, node
        if depth < 8 and (imported := self.imports(module).get(name)) is not None:
            if self.module_file(f"{imported[0]}.{imported[1]}") is None:
                return self.lookup(imported[0], imported[1], depth + 1)
        return None


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _params(fn: ast.FunctionDef, bound: bool) -> tuple[list[str], set[str]]:
    positional = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if bound and not static:
        positional = positional[1:]
    return positional, {*positional, *(a.arg for a in fn.args.kwonlyargs)}


@dataclass
class Walk:
    src: Source
    rooms: list[tuple[str, Part]] = field(default_factory=list)
    climbs: list[tuple[str, Part, list[str]]] = field(default_factory=list)
    returns: dict[tuple[str, frozenset[tuple[str, Part]]], Part | None] = field(default_factory=dict)

    def enter(self, module: str, node: ast.FunctionDef | ast.ClassDef, owner: ast.ClassDef | None,
              given: dict[str, Part]) -> Part | None:
        """Enter `node` (a function, or a class through its constructor) with `given` {parameter: part}; returns the
        part it returns (a function's), else None."""
        holder = f"{module}.{owner.name + '.' if owner else ''}{node.name}"
        key = (holder, frozenset(given.items()))
        if key in self.returns:
            return self.returns[key]
        self.returns[key] = None  # a recursive call returns nothing while the room is read
        for part in dict.fromkeys(given.values()):
            if (holder, part) not in self.rooms:
                self.rooms.append((holder, part))
        if isinstance(node, ast.ClassDef):
            bodies = self._class_bodies(module, node, given)
        else:
            bodies = [(node, owner, {name: part for name, part in given.items()})]
        reached: list[Part] = []
        result = None
        for fn, cls, env in bodies:
            returned = self._read(module, fn, cls, env, reached)
            result = returned if fn is node else result
        # The parts it holds by name besides those it was given (`tc = config.train`), and those it reaches: a setting's
        # section for a setting (`config.store.url` enters `config.store`).
        for part in [*(p for _, _, env in bodies for p in env.values()), *reached]:
            while self.src.is_setting(part):
                part = Part(part.path[:-1],
                            part.dict_at if part.dict_at is None or part.dict_at < len(part.path) else None)
            if (holder, part) not in self.rooms:
                self.rooms.append((holder, part))
        held = [part for h, part in self.rooms if h == holder]
        below = [part for part in given.values() if part.path]  # sections handed over one by one
        for part in held:
            if part.path:
                continue
            # Through this root (the object, or a dict made of it), not through a section held beside it.
            sections = list(dict.fromkeys(
                r.path[0] for r in reached if r.path and (r.dict_at == 0) == (part.dict_at == 0)
                and not any(r.path[: len(s.path)] == s.path and r.dict_at == s.dict_at for s in below)))
            if len(sections) > 1 and not any(h == holder and p == part for h, p, _ in self.climbs):
                self.climbs.append((holder, part, sections))
        self.returns[key] = result
        return result

    def _class_bodies(
        self, module: str, cls: ast.ClassDef, given: dict[str, Part]
    ) -> list[tuple[ast.FunctionDef, ast.ClassDef, dict[str, Part]]]:
        """Each method with what it holds: the constructor's parameters in `__init__`, the parts kept on `self` in
        all."""
        methods = _methods(cls)
        kept: dict[str, Part] = {f"self.{name}": part for name, part in given.items()}  # a dataclass keeps its fields
        if (init := methods.get("__init__")) is not None:
            env = dict(given)
            self._assignments(module, init, cls, env)
            kept = {name: part for name, part in env.items() if name.startswith("self.")}
            return [(fn, cls, {**kept, **(given if fn is init else {})}) for fn in methods.values()]
        return [(fn, cls, dict(kept)) for fn in methods.values()]

    def _assignments(self, module: str, fn: ast.FunctionDef, cls: ast.ClassDef | None, env: dict[str, Part]) -> None:
        for _ in range(3):  # chains: a = config.x; b = a.y
            for node in ast.walk(fn):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        pairs = [(target, node.value)]
                        if (
                            isinstance(target, ast.Tuple)
                            and isinstance(node.value, ast.Tuple)
                            and len(target.elts) == len(node.value.elts)
                        ):
                            pairs = list(zip(target.elts, node.value.elts, strict=True))  # a, b = x, y
                        for name_node, value in pairs:
                            if (name := _name(name_node)) is not None and (
                                part := self.part_of(value, env, module, cls)
                            ) is not None:
                                env.setdefault(name, part)

    def _read(self, module: str, fn: ast.FunctionDef, cls: ast.ClassDef | None, env: dict[str, Part],
              reached: list[Part]) -> Part | None:
        """Read one function's body: the parts it reaches (added to `reached`), the calls it makes with parts (entered);
        returns the part it returns, if any."""
        self._assignments(module, fn, cls, env)
        parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
        result = None
        for node in ast.walk(fn):
            if not isinstance(node, ast.expr):
                continue
            part = self.part_of(node, env, module, cls)
            if part is not None and (
                    self.part_of(parents.get(node, fn), env, module, cls) is None):  # type: ignore[arg-type]
                reached.append(part)
            if isinstance(node, ast.Call):
                self.call(node, env, module, cls)
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and node.value is not None:
                result = result or self.part_of(node.value, env, module, cls)
        return result

    def callee(
        self, func: ast.expr, module: str, cls: ast.ClassDef | None
    ) -> tuple[str, ast.FunctionDef | ast.ClassDef, ast.ClassDef | None] | None:
        if isinstance(func, ast.Name) and (found := self.src.lookup(module, func.id)) is not None:
            return found[0], found[1], None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id == "self" and cls is not None and (m := _methods(cls).get(func.attr)) is not None:
                return module, m, cls
            found = self.src.lookup(module, func.value.id)
            if (
                found is not None
                and isinstance(found[1], ast.ClassDef)
                and (m := _methods(found[1]).get(func.attr)) is not None
            ):
                return found[0], m, found[1]
        return None

    def call(self, node: ast.Call, env: dict[str, Part], module: str, cls: ast.ClassDef | None) -> Part | None:
        """Follow a call into a blockdraft function or class with the parts it passes; returns the part it returns."""
        target = self.callee(node.func, module, cls)
        if target is None:
            return None
        where, fn, owner = target
        if isinstance(fn, ast.ClassDef):
            init = _methods(fn).get("__init__")
            fields = [s.target.id for s in fn.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            positional, names = _params(init, True) if init else (fields, set(fields))
        else:
            bound = owner is not None and not any(
                isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list
            )
            positional, names = _params(fn, bound)
        given: dict[str, Part] = {}
        for i, arg in enumerate(node.args):
            if (
                i < len(positional)
                and not isinstance(arg, ast.Starred)
                and (part := self.part_of(arg, env, module, cls)) is not None
            ):
                if not self.src.is_setting(part):
                    given[positional[i]] = part
        for kw in node.keywords:
            if kw.arg in names and (part := self.part_of(kw.value, env, module, cls)) is not None:
                if not self.src.is_setting(part):
                    given[kw.arg] = part
        if not given:
            return None
        return self.enter(where, fn, owner, given)

    def part_of(self, node: ast.AST, env: dict[str, Part], module: str | None, cls: ast.ClassDef | None) -> Part | None:
        """The part an expression denotes, or None."""
        if (name := _name(node)) is not None and name in env:
            return env[name]
        if isinstance(node, ast.Attribute):
            base = self.part_of(node.value, env, module, cls)
            if base is not None and base.dict_at is None and self.src.is_field(base, node.attr):
                return base.below(node.attr)
            return None
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            base = self.part_of(node.value, env, module, cls)
            if base is not None and base.dict_at is not None and self.src.is_field(base, node.slice.value):
                return base.below(node.slice.value)
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = self.part_of(node.func.value, env, module, cls)
            if base is not None:
                if node.func.attr in DICT_METHODS:
                    return base.as_dict()
                if node.func.attr == "model_copy" and base.dict_at is None:
                    return base
                key = node.args[0] if node.args else None
                if (
                    node.func.attr == "get"
                    and base.dict_at is not None
                    and isinstance(key, ast.Constant)
                    and self.src.is_field(base, str(key.value))
                ):
                    return base.below(str(key.value))
                return None
        if isinstance(node, ast.Call) and module is not None:
            return self.call(node, env, module, cls)
        return None


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def start(src: Source, dotted: str, named: dict[str, Part] | None = None) -> Walk:
    """Walk from the function or class `dotted`, its config parameters holding the parts their annotations name, and
    those `named` ({parameter: part}) the parts given there."""
    module, name = dotted.rsplit(".", 1)
    found = src.lookup(module, name)
    owner = None
    if found is None and "." in module:  # module.Class.method
        module, cls_name = module.rsplit(".", 1)
        cls = src.lookup(module, cls_name)
        assert cls is not None and isinstance(cls[1], ast.ClassDef), dotted
        owner, fn = cls[1], _methods(cls[1])[name]
        found = (cls[0], fn)
    assert found is not None, f"{dotted} is not defined under {SRC}"
    where, node = found
    fn = _methods(node).get("__init__") if isinstance(node, ast.ClassDef) else node
    assert fn is not None, f"{dotted} has no __init__"
    by_class = {ROOT_CLASS: (), **{cls: (name,) for name, cls in src.sections[ROOT_CLASS].items() if cls}}
    given = {}
    for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
        annotation = ast.unparse(arg.annotation) if arg.annotation else ""
        if annotation in by_class:
            given[arg.arg] = Part(by_class[annotation])
        if named and arg.arg in named:
            given[arg.arg] = named[arg.arg]
    assert given, f"{dotted} takes no config part"
    walk = Walk(src)
    walk.enter(where, node, owner, given)
    return walk


def _given(item: str) -> tuple[str, Part]:
    """`recorded=config{}` as (parameter, part); `config.train`, `config{}.train` and `config.train{}` as written."""
    name, _, text = item.partition("=")
    dict_at = text.split(".").index(next(p for p in text.split(".") if p.endswith("{}"))) if "{}" in text else None
    path = tuple(p.removesuffix("{}") for p in text.split("."))
    assert path[0] == "config", f"{item}: a part is written config, config{{}}, config.train, ..."
    return name, Part(path[1:], dict_at)


def main() -> None:
    global SRC
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("functions", nargs="*", default=[f"{ROOT}.stages.train.setup.build_training"])
    parser.add_argument("--src", type=Path, default=SRC, help="the src folder to read (another checkout's)")
    parser.add_argument("--list", action="store_true", help="print each room and each climb")
    parser.add_argument("--given", nargs="+", default=[], metavar="PARAMETER=PART",
                        help="a start parameter no annotation names, and the part its callers give it: "
                             "recorded=config{}")
    args = parser.parse_args()
    SRC = args.src.resolve()
    src = Source()
    for dotted in args.functions:
        walk = start(src, dotted, dict(_given(item) for item in args.given))
        climbs = sum(len(sections) - 1 for _, _, sections in walk.climbs)
        print(f"{dotted}: {len(walk.rooms)} rooms, {climbs} climbs")
        if args.list:
            for holder, part in walk.rooms:
                print(f"  room  {holder.removeprefix(ROOT + '.')}: {part}")
            for holder, part, sections in walk.climbs:
                print(f"  climb {holder.removeprefix(ROOT + '.')}: {part} reaches {', '.join(sections)} "
                      f"({len(sections) - 1})")


if __name__ == "__main__":
    main()
