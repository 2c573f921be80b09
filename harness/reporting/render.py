"""Tables rendered: the ``Table`` every table function returns, number formatting, Markdown, LaTeX
(booktabs) and the files a report writes for each table.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.io import atomic_write_text


@dataclass
class Table:
    """One table: its file name, title, numbers, formatted cells and the notes printed under it."""

    name: str
    title: str
    data: pd.DataFrame
    display: pd.DataFrame
    notes: list[str] = field(default_factory=list)


SIGNIFICANCE = 0.05


def fmt_p(p: float) -> str:
    """Two significant digits, ``*`` below the significance level: ``0.012 *``, ``0.21``, ``<0.0001 *``; ``—``
    without a test."""
    if math.isnan(p):
        return "—"
    mark = " *" if p < SIGNIFICANCE else ""
    return ("<0.0001" if p < 1e-4 else f"{p:.2g}") + mark


def fmt_ci(mean: float, half: float, n: int, digits: int) -> str:
    """``3.2100 ± 0.0123``; without an interval (one seed) the mean alone, which the table's note explains."""
    if n == 0 or math.isnan(mean):
        return "— (no finished run)"
    if math.isnan(half):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def fmt_delta(diff: float, half: float, digits: int) -> str:
    if math.isnan(diff):
        return "—"
    if math.isnan(half):
        return f"{diff:+.{digits}f}"
    return f"{diff:+.{digits}f} ± {half:.{digits}f}"


def fmt_count(value: float) -> str:
    """Parameter and FLOP counts in K/M/G."""
    if value is None or math.isnan(value):
        return "—"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def fmt_bytes(value: float) -> str:
    if value is None or math.isnan(value):
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def fmt_ratio(value: float) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.2f}×"


def _md_cell(text: str) -> str:
    # A pipe or a newline inside a cell would break the Markdown table.
    return str(text).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def frame_markdown(display: pd.DataFrame) -> str:
    """A frame of display text as GitHub-flavoured Markdown (pipes and newlines escaped inside cells)."""
    frame = display.map(_md_cell)
    frame.columns = [_md_cell(c) for c in frame.columns]
    return frame.to_markdown(index=False, disable_numparse=True)


def to_markdown(table: Table) -> str:
    """The table as GitHub-flavoured Markdown (pipes escaped inside cells)."""
    return frame_markdown(table.display)


_LATEX_SYMBOLS = {"±": r"$\pm$", "×": r"$\times$", "Δ": r"$\Delta$", "−": "$-$", "—": "--", "–": "--"}


_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(ch, ch) for ch in text)


_NUMERIC_CELL = re.compile(r"^[-+−]?(\d[\d.,]*|—)")


def column_alignment(display: pd.DataFrame) -> str:
    """``r`` for a column of numbers (at least half its cells begin with one; the rest are dashes or words such
    as ``reference``), ``l`` for text."""
    spec = ""
    for col in display.columns:
        cells = [str(v) for v in display[col]]
        numbers = sum(bool(_NUMERIC_CELL.match(c)) and any(ch.isdigit() for ch in c[:2]) for c in cells)
        spec += "r" if cells and 2 * numbers >= len(cells) else "l"
    return spec


def to_latex(table: Table) -> str:
    """The table as a LaTeX ``table`` float with booktabs rules (``\\usepackage{booktabs}``), numbers on the right."""
    styler = table.display.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    caption = table.title + (". " + " ".join(table.notes) if table.notes else "")
    text = styler.to_latex(
        hrules=True,
        caption=_latex_escape(caption),
        label=f"tab:{table.name}",
        position="t",
        position_float="centering",
        column_format=column_alignment(table.display),
    )
    for symbol, latex in _LATEX_SYMBOLS.items():
        text = text.replace(symbol, latex)
    return text


def write_table(table: Table, folder: Path) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.tex`` and ``<name>.csv`` into ``folder`` atomically."""
    folder = Path(folder)
    return {
        "md": atomic_write_text(folder / f"{table.name}.md", to_markdown(table) + "\n"),
        "tex": atomic_write_text(folder / f"{table.name}.tex", to_latex(table)),
        "csv": atomic_write_text(folder / f"{table.name}.csv", table.data.to_csv(index=False)),
    }
