"""What a resumed run takes from its checkpoint and what from this config, said when a setting changed in between.

A checkpoint holds the weights, the optimizer's state, the schedule's position, the RNG states and where in the data
the run stood. The optimizer's state includes its parameter groups, so the learning rate and weight decay the first run
was started with go on (`CHECKPOINT_SETTINGS`); every other setting comes from this config (more steps, another
checkpoint interval, another warmup). The run identity's settings (seed, data, DFlash shape, ...) cannot differ: the
checkpoint of another identity is refused before this is asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Settings the optimizer's restored parameter groups (and the schedule's base learning rate) carry from the checkpoint.
CHECKPOINT_SETTINGS = ("train.lr", "train.weight_decay")
LOCATIONS = ("train.data", "train.output")  # where the run reads and writes: may move, the checkpoint pins by content
SHOWN = 6  # changed settings named in the line; more are counted


def _leaves(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, dict):
        for key in sorted(data):
            yield from _leaves(data[key], f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), data


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted field: (checkpoint's value, this config's)} for each resolved setting that differs, locations left out;
    of `recorded`, only the sections `current` has (a manifest's config also holds its stage key)."""
    old = dict(_leaves({name: section for name, section in recorded.items() if name in current}))
    new = dict(_leaves(current))
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if key not in LOCATIONS and old.get(key) != new.get(key)}


def resume_note(step: int, recorded: dict[str, Any], current: dict[str, Any]) -> tuple[str, bool] | None:
    """The line for a run resumed at `step` whose config differs from the one its checkpoint recorded (`recorded`,
    `current`: resolved configs), saying which changed settings are used and which are not, and whether it is a warning
    (a changed setting is not used); None when none differs."""
    changed = changed_settings(recorded, current)
    if not changed:
        return None
    ignored = {k: v for k, v in changed.items() if k in CHECKPOINT_SETTINGS}
    used = {k: v for k, v in changed.items() if k not in CHECKPOINT_SETTINGS}
    parts = [f"resuming at step {step} with settings that changed since its checkpoint"]
    if ignored:
        listed = ", ".join(f"{k} = {new} (the checkpoint's: {old})" for k, (old, new) in ignored.items())
        parts.append(f"NOT used: {listed}, since the optimizer resumes with the checkpoint's state and learning rate "
                     "(train into a new train.output to use them)")
    if used:
        listed = ", ".join(f"{k} = {new} (was {old})" for k, (old, new) in list(used.items())[:SHOWN])
        more = f" and {len(used) - SHOWN} more" if len(used) > SHOWN else ""
        parts.append(f"used from this config: {listed}{more}")
    line = "; ".join(parts) + ("; the weights, optimizer, schedule position, RNG and data position come from the "
                               "checkpoint, everything else from the config")
    return line, bool(ignored)


__all__ = ["CHECKPOINT_SETTINGS", "changed_settings", "resume_note"]
