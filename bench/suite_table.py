"""Which test files cost the suite most: a Markdown table from pytest's JUnit XML.

    .venv/bin/python -m pytest -q --junitxml=suite.xml
    .venv/bin/python bench/suite_table.py suite.xml [--top 25] [--against before.xml]

Each test case's time in the XML is its set-up, call and teardown together, so a module fixture's cost lands on the
first test that uses it; summed by file the figures are whole. With `--against`, a second XML (the same suite at another
commit) gives a before column and the change.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def by_file(junit: Path) -> dict[str, tuple[float, int]]:
    """{test file: (seconds, test cases)} from a JUnit XML report."""
    seconds: dict[str, float] = defaultdict(float)
    cases: dict[str, int] = defaultdict(int)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = "/".join(part for part in module if not part[:1].isupper()) + ".py"  # drop a test class name
        seconds[name] += float(case.get("time", 0.0))
        cases[name] += 1
    return {name: (seconds[name], cases[name]) for name in seconds}


def table(now: dict[str, tuple[float, int]], before: dict[str, tuple[float, int]] | None, top: int) -> str:
    total = sum(s for s, _ in now.values())
    rows = sorted(now.items(), key=lambda item: -item[1][0])
    head = "| file | tests | s | share |" + (" before s | change |" if before is not None else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    shown = rows[:top]
    for name, (seconds, count) in shown:
        line = f"| {name} | {count} | {seconds:.0f} | {seconds / total:.1%} |"
        if before is not None:
            old = before.get(name, (0.0, 0))[0]
            line += f" {old:.0f} | {seconds - old:+.0f} |"
        lines.append(line)
    rest = rows[top:]
    if rest:
        line = f"| {len(rest)} other files | {sum(c for _, (_, c) in rest)} | {sum(s for _, (s, _) in rest):.0f} | " \
               f"{sum(s for _, (s, _) in rest) / total:.1%} |"
        if before is not None:
            old = sum(s for name, (s, _) in before.items() if name not in dict(shown))
            line += f" {old:.0f} | {sum(s for _, (s, _) in rest) - old:+.0f} |"
        lines.append(line)
    line = f"| all | {sum(c for _, c in now.values())} | {total:.0f} | 100% |"
    if before is not None:
        old_total = sum(s for s, _ in before.values())
        line += f" {old_total:.0f} | {total - old_total:+.0f} |"
    lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--against", type=Path, default=None)
    args = parser.parse_args()
    print(table(by_file(args.junit), by_file(args.against) if args.against else None, args.top))


if __name__ == "__main__":
    main()
