"""Command-line overrides of the config: `--set section.key=value`, and the stage flags that spell the same thing.

Every command that reads the config (all but `demo`) takes `--set` (repeatable); a stage flag such as
`tokenize --max-length 50` is another spelling of `--set tokenize.max_length=50`. Both become one override dict
({"section": {"key": value}}) that `load_config` lays over the file before validating, so the value is typed, checked
and pinned exactly as the file's would be. Each override remembers how it was spelled, so a bad value's one line names
what the user typed.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from blockdraft.errors import ConfigError

_NONE_WORDS = ("none", "null")


@dataclass
class Overrides:
    """Values laid over the config file: `values` in the config's shape, `spelled[section, key]` how each was given."""

    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    spelled: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, section: str, key: str, value: Any, spelling: str) -> None:
        """Set `section.key`; ConfigError when another spelling already set it to something else (compared as the
        command line writes them: a flag's 3 and a --set's "3" agree)."""
        earlier = self.spelled.get((section, key))
        if earlier is not None and _text(self.values[section][key]) != _text(value):
            raise ConfigError(f"{earlier} and {spelling} both set {section}.{key}; pass only one of them")
        self.values.setdefault(section, {})[key] = value
        self.spelled[section, key] = spelling


def flag_overrides(
    flags: Mapping[str, Mapping[str, Any]], overrides: Overrides | None = None, names: Mapping[str, str] | None = None,
) -> Overrides:
    """The stage flags' values ({"section": {"key": value}}) as overrides, each spelled `--key-name value`, or with the
    flag `names["section.key"]` where the flag is named otherwise (`export --target` sets target.path); None values
    are flags not given, so the file decides."""
    overrides = overrides or Overrides()
    names = names or {}
    for section, values in flags.items():
        for key, value in values.items():
            if value is not None:
                flag = names.get(f"{section}.{key}", f"--{key.replace('_', '-')}")
                overrides.add(section, key, value, f"{flag} {value}")
    return overrides


def set_overrides(items: Iterable[str], model: type[BaseModel], overrides: Overrides | None = None) -> Overrides:
    """`--set section.key=value` items as overrides of the sections of `model`; one ConfigError line for an item that
    is not of that form or names a section or key the config does not have."""
    overrides = overrides or Overrides()
    for item in items:
        section, key, field, text = _split(item, model)
        overrides.add(section, key, parse_value(text, field.annotation), f"--set {item}")
    return overrides


def _split(item: str, model: type[BaseModel]) -> tuple[str, str, Any, str]:
    """(section, key, the key's pydantic field, value text) of a `--set` item; a key inside a table of a section
    (`target.engine.url`) is dotted: `engine.url`."""
    name, eq, text = item.partition("=")
    parts = name.strip().split(".")
    if not eq or len(parts) < 2:
        raise ConfigError(f"--set {item}: write it as section.key=value, e.g. --set train.max_steps=100")
    current: Any = model
    for depth, part in enumerate(parts):
        fields = current.model_fields
        if part not in fields:
            raise ConfigError(f"--set {item}: {unknown_name(parts[: depth + 1], model)}")
        field = fields[part]
        current = field.annotation
        if depth < len(parts) - 1 and not _is_model(current):
            raise ConfigError(f"--set {item}: {'.'.join(parts[: depth + 1])} is a setting, not a table; write it as "
                              f"--set {'.'.join(parts[: depth + 1])}=value")
    if _is_model(current):
        raise ConfigError(f"--set {item}: {'.'.join(parts)} is a table; set one of its keys: "
                          f"{', '.join(current.model_fields)}")
    return parts[0], ".".join(parts[1:]), field, text.strip()


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def unknown_name(loc: Sequence[str], model: type[BaseModel]) -> str:
    """What to say of a section (`[name]`) or key (`[section, name]`, `[section, table, name]`) that `model` does not
    have: the nearest name and the names there are, worded the same for a `--set` item and for the config file."""
    if len(loc) == 1:
        return (f"the config has no section '{loc[0]}'{_nearest(loc[0], model.model_fields)}; sections: "
                f"{', '.join(model.model_fields)}")
    table: Any = model
    for part in loc[:-1]:
        table = table.model_fields[part].annotation
    key, where = loc[-1], ".".join(loc[:-1])
    return f"[{where}] has no key '{key}'{_nearest(key, table.model_fields)}; keys: {', '.join(table.model_fields)}"


def _nearest(word: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(names), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_value(text: str, annotation: Any) -> Any:
    """The command-line text of one value, as data the field's pydantic type validates: `none`/`null` is None where the
    field allows it; a list field takes a JSON array (`[1, 5]`) or comma-separated items (`cpu,cpu`); other text is
    left for pydantic, which reads "3", "1e-3" and "true"/"false" as the field's type wants."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional and text.lower() in _NONE_WORDS:
        return None
    if not _is_list(annotation):
        return text
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # left for pydantic to refuse, naming the field
    return [part.strip() for part in text.split(",") if part.strip()]


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) is list:
        return True
    return any(
        _is_list(arg)
        for arg in typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
    )


def as_set_items(overrides: Overrides) -> list[str]:
    """The overrides as `--set` items (`section.key=value`, lists as JSON), for a command line that re-reads the config:
    `train`'s node flags on the command line of the ranks torchrun starts (`stages.train.launch`)."""
    return [
        f"{section}.{key}={_text(value)}"
        for section, values in overrides.values.items()
        for key, value in values.items()
    ]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return json.dumps(value) if isinstance(value, list) else str(value)


_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}


def validation_line(label: str, err: ValidationError, overrides: Overrides,
                    model: type[BaseModel] | None = None) -> str:
    """One line for the first problem: an override's names it as it was spelled, a file's names the file and field; a
    section or key of the file that `model` does not have gets the nearest name, as `--set` does."""
    first = err.errors()[0]
    loc: list[str] = [str(p) for p in first["loc"]]
    if model is not None and first["type"] == "extra_forbidden" and loc:
        return f"config {label}: {unknown_name(loc, model)}; fix that name in the file"
    message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for our own validators' words
    found = _spelled_at(overrides, loc)
    if found is not None:
        spelling, (section, key) = found
        bound = _BOUNDS.get(first["type"])
        limit = first.get("ctx", {}).get(bound[1]) if bound else None
        problem = f"must be {bound[0]} {limit}" if bound and limit is not None else message
        return f"{spelling}: {problem} (it sets {section}.{key}); pass a valid value"
    if not loc:  # a check across sections: its message names the settings
        return f"config {label}: {message}"
    return f"config {label}: field '{'.'.join(loc)}': {message}; fix that field in the file"


def _spelled_at(overrides: Overrides, loc: Sequence[str]) -> tuple[str, tuple[str, str]] | None:
    """(how it was spelled, (section, key)) of the override an error at `loc` is about: the setting at `loc` or the one
    that holds it (an item of a list: `dflash.target_layer_ids.1`), else one inside the table at `loc` (a check of the
    whole `[target.engine]`); None when the file set it."""
    if len(loc) < 2:
        return None
    for end in range(len(loc), 1, -1):
        key = (loc[0], ".".join(loc[1:end]))
        if key in overrides.spelled:
            return overrides.spelled[key], key
    table = ".".join(loc[1:]) + "."
    inside = [key for key in overrides.spelled if key[0] == loc[0] and key[1].startswith(table)]
    return (overrides.spelled[inside[0]], inside[0]) if inside else None


def apply(data: dict, overrides: Overrides, label: str) -> dict:
    """`data` (the file's tables) with `overrides` laid over it."""
    for section, values in overrides.values.items():
        for key, value in values.items():  # a dotted key (`engine.url`) goes into the section's table of that name
            *tables, name = [section, *key.split(".")]
            table = data
            for depth, part in enumerate(tables):
                table = table.setdefault(part, {})
                if not isinstance(table, dict):  # `tokenize = 5`: an override has no table to go into
                    where = ".".join(tables[: depth + 1])
                    raise ConfigError(f"config {label}: '{where}' is a {type(table).__name__}, not a table; "
                                      f"write its fields under a [{where}] header")
            table[name] = value
    return data


__all__ = ["Overrides", "apply", "as_set_items", "flag_overrides", "parse_value", "set_overrides", "unknown_name",
           "validation_line"]
