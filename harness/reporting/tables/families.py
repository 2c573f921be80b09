"""The declared families' tests: every claim's Δ in every setting, Holm-adjusted within its family.

A report whose grid declares ``report.primary`` or ``report.secondary`` (``harness.reporting.claims``) tests only
those comparisons: the p-value of each is adjusted over its own family, whichever table prints it, and a table row
that is in no family shows its interval without an adjusted p. A grid that declares none keeps one family per
table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from harness.reporting.claims import Claim
from harness.reporting.claims import families as by_family
from harness.reporting.stats import holm
from harness.reporting.tables.common import delta, finished_runs, group_runs


@dataclass
class Family:
    """One family's tests: adjusted p by (setting, variant, against), and the claims without data."""

    name: str
    claims: list[Claim]
    adjusted: dict[tuple[str, str, str], float] = field(default_factory=dict)
    missing: list[Claim] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Tests Holm corrects over: the claims with a p-value, counted once per setting."""
        return len(self.adjusted)


def _raw_p(groups: dict, setting: str, variant: str, against: str) -> float:
    # The tables' own Δ: no data, or two budgets, give none here either.
    c = delta(finished_runs(groups, setting, variant), finished_runs(groups, setting, against))
    return math.nan if c is None else c.p


def family_tests(runs, claims: list[Claim]) -> list[Family]:
    """Every family's adjusted p-values over the settings of ``runs``."""
    groups = group_runs(runs)
    settings = sorted({s for s, _ in groups})
    out = []
    for name, members in by_family(claims).items():
        family = Family(name, members)
        keys = [(s, c.variant, c.against) for c in members for s in settings]
        raw = [_raw_p(groups, *key) for key in keys]
        family.adjusted = {k: p for k, p, r in zip(keys, holm(raw), raw) if not math.isnan(r)}
        family.missing = [c for c in members if not any(k[1:] == (c.variant, c.against) for k in family.adjusted)]
        out.append(family)
    return out


def lookup(tests: list[Family], setting: str, variant: str, against: str) -> tuple[str, float] | None:
    """The family and adjusted p of one Δ, or None when no family holds it."""
    for family in tests:
        if (setting, variant, against) in family.adjusted:
            return family.name, family.adjusted[(setting, variant, against)]
    for family in tests:
        if any((c.variant, c.against) == (variant, against) for c in family.claims):
            return family.name, math.nan
    return None


def family_lines(tests: list[Family]) -> list[str]:
    """The report's statement of each family: its comparisons and its size."""
    lines = []
    for family in tests:
        what = "Primary family" if family.name == "primary" else f"Secondary family *{family.name}*"
        listed = "; ".join(f"{c.variant} − {c.against}" for c in family.claims)
        line = f"- {what}: {family.size} test(s), Holm–Bonferroni within the family: {listed}."
        if family.missing:
            line += " No Δ (no finished runs on a shared budget) for " + ", ".join(
                f"{c.variant} − {c.against}" for c in family.missing
            )
            line += "."
        lines.append(line)
    return lines


def declared(ctx) -> list[Family] | None:
    """The report's declared families with their tests (built once per report), or None when it declares none."""
    if ctx.claims is None:
        return None
    return ctx.cached("families", lambda: family_tests(ctx.sweep.runs, ctx.claims))
