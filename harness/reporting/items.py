"""The report's tables and figures as one registry: each is a decorated function of one ``Context``.

``@table("name", needs=...)`` and ``@figure("name", needs=...)`` register a function under a name; the
function takes the ``Context`` of one report and returns a ``Table`` (tables) or ``(figure, caption)``
(figures), or raises ``NoData`` with the reason it cannot be built. Registration order is the order of the
report and of ``docs/report.md``, whose listing is ``listing()`` (a test keeps the two equal), so adding a
figure touches only the module that defines it. The context carries the loaded sweep, the report's reference
variants, the benchmark frame, the fixed colour of every variant, and a cache, so a figure drawn from a
table's numbers (``ctx.table("main")``) reuses the table instead of computing it twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from harness.reporting.results import Sweep


class NoData(Exception):
    """A table or figure that cannot be built from this sweep; the message says why."""


@dataclass(frozen=True)
class Item:
    """One registered table or figure."""

    name: str
    kind: str  # "table" or "figure"
    fn: Callable[[Context], Any]
    needs: str
    """What the run directories must hold for it, in words (listed in docs/report.md)."""
    always: bool = False
    """Built whatever the report section selects (the list of runs left out)."""

    @property
    def summary(self) -> str:
        """The first paragraph of the function's docstring, on one line."""
        doc = (self.fn.__doc__ or "").strip().split("\n\n")[0]
        return " ".join(doc.split())


_ITEMS: dict[str, Item] = {}


def _register(kind: str, name: str, needs: str, always: bool):
    def deco(fn):
        key = f"{kind}:{name}"
        if key in _ITEMS:
            raise ValueError(f"the {kind} {name!r} is registered twice")
        _ITEMS[key] = Item(name, kind, fn, needs, always)
        return fn

    return deco


def table(name: str, *, needs: str, always: bool = False):
    """Register a table function ``fn(ctx) -> Table``."""
    return _register("table", name, needs, always)


def figure(name: str, *, needs: str):
    """Register a figure function ``fn(ctx) -> (Figure, caption)``."""
    return _register("figure", name, needs, False)


def items(kind: str) -> list[Item]:
    """Every registered item of a kind, in registration order.

    Items register when the modules that define them are imported (``harness.reporting.report`` imports the
    figures, tables and tuning modules); this module imports none of them, so they can import it.
    """
    return [i for i in _ITEMS.values() if i.kind == kind]


def names(kind: str, *, selectable: bool = True) -> tuple[str, ...]:
    """Registered names of a kind; ``selectable`` leaves out the ones built whatever the report asks."""
    return tuple(i.name for i in items(kind) if not (selectable and i.always))


def get(kind: str, name: str) -> Item:
    items(kind)
    return _ITEMS[f"{kind}:{name}"]


@dataclass
class Context:
    """What every table and figure of one report reads."""

    sweep: Sweep
    baseline: str = "preln"
    ablation_reference: str = "ldm-rls"
    bench: pd.DataFrame | None = None
    claims: list | None = None
    """The grid's declared comparisons (``harness.reporting.claims``); None: one Holm family per table."""
    colours: dict[str, str] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)

    def table(self, name: str):
        """The named table, built once per report; raises ``NoData`` when it cannot be built."""
        key = f"table:{name}"
        if key not in self.cache:
            try:
                self.cache[key] = get("table", name).fn(self)
            except NoData as e:
                self.cache[key] = e
        value = self.cache[key]
        if isinstance(value, NoData):
            raise value
        return value

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


def listing() -> str:
    """The Markdown tables of every registered table and figure, as ``docs/report.md`` shows them."""
    lines = ["| Table | Contents | Needs |", "|---|---|---|"]
    for item in items("table"):
        lines.append(f"| `{item.name}` | {item.summary} | {item.needs} |")
    lines += ["", "| Figure | Contents | Needs |", "|---|---|---|"]
    for item in items("figure"):
        lines.append(f"| `{item.name}` | {item.summary} | {item.needs} |")
    return "\n".join(lines)
