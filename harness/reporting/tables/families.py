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
from harness.reporting.stats import compare, holm
from harness.reporting.tables.common import group_runs, train_tokens


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
        return sum(not math.isnan(p) for p in self.adjusted.values())


def _raw_p(groups: dict, setting: str, claim: Claim) -> float:
    runs = [r for r in groups.get((setting, claim.variant), []) if r.final_loss is not None]
    refs = [r for r in groups.get((setting, claim.against), []) if r.final_loss is not None]
    if not runs or not refs or len({train_tokens(r) for r in runs + refs}) != 1:
        return math.nan  # no data, or two budgets: the tables give no Δ either
    return compare({r.seed: r.final_loss for r in refs}, {r.seed: r.final_loss for r in runs}).p


def family_tests(runs, claims: list[Claim]) -> list[Family]:
    """Every family's adjusted p-values over the settings of ``runs``."""
    groups = group_runs(runs)
    settings = sorted({s for s, _ in groups})
    out = []
    for name, members in by_family(claims).items():
        family = Family(name, members)
        keys = [(s, c.variant, c.against) for c in members for s in settings]
        raw = [_raw_p(groups, s, Claim(name, v, a)) for s, v, a in keys]
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
