"""How the demo tells its story: headings, plain sentences, tables, indented documents and checked outcomes.

Colour only on a terminal (and never with NO_COLOR set); the text reads the same without it. Every `check`
that fails is remembered, so the demo can exit non-zero when a step did not behave.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

import yaml

MAX_WIDTH = 100
"""The widest the story gets, whatever the terminal: long lines are hard to read, and logs and CI cut them."""
_RESET = "\033[0m"
_STYLES = {"title": "\033[1;36m", "heading": "\033[1m", "ok": "\033[32m", "fail": "\033[1;31m",
           "dim": "\033[2m", "note": "\033[33m"}


def _fill(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "") -> str:
    """Wrapped at spaces only: names like dra-agent or device IDs are never split."""
    return textwrap.fill(text, width, initial_indent=initial_indent, subsequent_indent=subsequent_indent,
                         break_on_hyphens=False, break_long_words=False)


def _fit(cells: Sequence[Sequence[str]], room: int) -> list[int]:
    """Column widths for a table (header row first) within `room` columns: as wide as their widest cell when that
    fits; else the columns whose cells wrap at spaces give way first, widest first, then the others (their cells
    then break inside words, which only identifiers longer than the whole line need)."""
    count = len(cells[0])
    widths = [max(len(row[i]) for row in cells) for i in range(count)]
    excess = sum(widths) + 2 * (count - 1) - room
    if excess <= 0:
        return widths

    def spaced(i: int) -> bool:
        return any(" " in row[i] for row in cells[1:])

    def longest_word(i: int) -> int:
        return max((len(word) for row in cells for word in row[i].split()), default=1)

    for i in sorted((i for i in range(count) if spaced(i)), key=lambda i: -widths[i]):
        cut = min(excess, widths[i] - max(longest_word(i), 8))
        if cut > 0:
            widths[i] -= cut
            excess -= cut
    while excess > 0:
        widest = max(range(count), key=lambda i: widths[i])
        if widths[widest] <= 8:
            break
        widths[widest] -= 1
        excess -= 1
    return widths


class Story:
    """The demo's output stream and the failures seen so far."""

    def __init__(self, out: TextIO, *, color: bool | None = None, width: int | None = None) -> None:
        self.out = out
        if color is None:
            color = out.isatty() and "NO_COLOR" not in os.environ
        self.color = color
        self.width = min(width or shutil.get_terminal_size((100, 24)).columns, MAX_WIDTH)
        self.failures: list[str] = []
        self.section = ""
        self.checks: dict[str, list[tuple[bool, str]]] = {}
        """Every checked outcome, by the heading it came under."""

    def _style(self, style: str, text: str) -> str:
        return f"{_STYLES[style]}{text}{_RESET}" if self.color else text

    def _print(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def title(self, text: str) -> None:
        self._print(self._style("title", text))
        self._print(self._style("title", "=" * min(len(text), self.width)))

    def heading(self, text: str) -> None:
        self.section = text
        self._print()
        self._print(self._style("heading", text))
        self._print(self._style("heading", "-" * min(len(text), self.width)))

    def say(self, text: str) -> None:
        """A paragraph, wrapped to the terminal."""
        self._print(_fill(" ".join(text.split()), self.width))

    def step(self, text: str) -> None:
        self._print()
        self._print(_fill(" ".join(text.split()), self.width, initial_indent="▸ ", subsequent_indent="  "))

    def detail(self, text: str) -> None:
        self._print(_fill(text, self.width, initial_indent="    ", subsequent_indent="      "))

    def note(self, text: str) -> None:
        self._print(self._style("note", _fill(" ".join(text.split()), self.width, initial_indent="  note: ",
                                                      subsequent_indent="        ")))

    def document(self, obj: Any, *, indent: int = 4) -> None:
        """A Kubernetes object or CDI spec as YAML, indented; in block style where flow style would not fit."""
        room = self.width - indent
        text = yaml.safe_dump(obj, sort_keys=False, width=room, default_flow_style=None)
        if any(len(line) > room for line in text.splitlines()):
            # The emitter breaks a line only at the first space past the width: keep a margin for the last word.
            text = yaml.safe_dump(obj, sort_keys=False, width=room - 20, default_flow_style=False)
        self._print(textwrap.indent(text.rstrip("\n"), " " * indent))

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]], *, indent: int = 4) -> None:
        """Left-aligned columns; cells that would make a line wider than the story wrap within their column."""
        cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
        widths = _fit(cells, self.width - indent)
        pad = " " * indent
        for number, row in enumerate(cells):
            parts = [textwrap.wrap(c, w, break_long_words=True, break_on_hyphens=False) or [""]
                     for c, w in zip(row, widths, strict=True)]
            for line in range(max(len(p) for p in parts)):
                text = "  ".join((p[line] if line < len(p) else "").ljust(w)
                                 for p, w in zip(parts, widths, strict=True)).rstrip()
                self._print(pad + (self._style("dim", text) if number == 0 else text))

    def check(self, holds: bool, what: str, *, otherwise: str = "") -> bool:
        """An expected outcome: ✓ when it holds, ✗ (remembered as a failure) when not."""
        self.checks.setdefault(self.section, []).append((holds, what))
        if holds:
            self._print(self._style("ok", _fill(what, self.width, "  ✓ ", "    ")))
        else:
            self.failures.append(what + (f": {otherwise}" if otherwise else ""))
            told = what + (f"; instead: {otherwise}" if otherwise else "")
            self._print(self._style("fail", _fill(told, self.width, "  ✗ ", "    ")))
        return holds

    def fail(self, what: str) -> None:
        self.check(False, what)
