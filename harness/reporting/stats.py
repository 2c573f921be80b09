"""Intervals for the report: a mean over seeds, and the difference between two variants.

Seeds are shared across the variants of a grid: seed ``s`` gives every variant the same data order and the same
initial decoder weights (embedding, attention, MLPs; ``harness.model.factory`` draws a mixer's own weights from a
separate stream, and ``preln(match=...)`` keeps PreLN's weights with MLP units appended), so the honest interval
for a difference uses the per-seed differences (paired t). Welch's
interval is for variants whose runs do not share seeds; with one value on either side there is no interval.

Every difference carries its two-sided p-value (the paired or Welch t-test of "no difference"), the number of
pairs it rests on, and whether the two sides' seed sets only partly overlap (then only the shared seeds are
paired, and the table says so). A table that prints several differences corrects their p-values for multiplicity
with Holm's step-down procedure (``holm``), within that table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy import stats

PAIRED, WELCH, ONE_SEED = "paired t", "Welch", "one seed"


@dataclass(frozen=True)
class Comparison:
    """``delta = mean(other) - mean(reference)`` with its interval ``[low, high]`` and how it was made."""

    delta: float
    low: float
    high: float
    method: str
    n: int  # seed pairs for the paired interval, else the smaller of the two sample sizes
    p: float = math.nan  # two-sided p-value of the t-test behind the interval; NaN without one
    partial: bool = False  # paired on the shared seeds of two seed sets that differ

    @property
    def pairs(self) -> int:
        """Seed pairs the difference rests on (0 for Welch and one seed)."""
        return self.n if self.method == PAIRED else 0

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def mean_ci(values: Iterable[float], level: float = 0.95) -> tuple[float, float, int]:
    """Mean, half-width of the t-interval (NaN for fewer than two values) and the count."""
    x = np.asarray(list(values), dtype=np.float64)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, 0
    if n < 2:
        return float(x.mean()), math.nan, n
    half = stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)
    return float(x.mean()), float(half), n


def welch_ci(a: Iterable[float], b: Iterable[float], level: float = 0.95) -> tuple[float, float, float]:
    """``mean(a) - mean(b)``, the half-width of its Welch interval and the Welch–Satterthwaite dof."""
    a, b = np.asarray(list(a), dtype=np.float64), np.asarray(list(b), dtype=np.float64)
    if len(a) == 0 or len(b) == 0:
        return math.nan, math.nan, math.nan
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return diff, 0.0, float(len(a) + len(b) - 2)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return diff, float(stats.t.ppf(0.5 + level / 2, dof) * math.sqrt(va + vb)), float(dof)


def compare(reference: Mapping[int, float], other: Mapping[int, float], level: float = 0.95) -> Comparison:
    """The difference ``other - reference`` over seeds, paired where at least two seeds are shared.

    Keys are seeds. With two or more shared seeds the interval is the t-interval of the per-seed differences on
    those seeds (and ``delta`` their mean); otherwise Welch's interval over all values; with fewer than two
    values on either side, no interval. ``partial`` marks a paired difference whose two seed sets are not the
    same: the seeds only one side has are left out of it.
    """
    shared = sorted(set(reference) & set(other))
    if len(shared) >= 2:
        diffs = [other[s] - reference[s] for s in shared]
        mean, half, n = mean_ci(diffs, level)
        sd = float(np.std(diffs, ddof=1))
        return Comparison(
            mean,
            mean - half,
            mean + half,
            PAIRED,
            n,
            _t_p(mean, sd / math.sqrt(n), n - 1),
            set(reference) != set(other),
        )
    ref, oth = list(reference.values()), list(other.values())
    diff, half, dof = welch_ci(oth, ref, level)
    if len(ref) >= 2 and len(oth) >= 2:
        se = math.sqrt(np.var(ref, ddof=1) / len(ref) + np.var(oth, ddof=1) / len(oth))
        return Comparison(diff, diff - half, diff + half, WELCH, min(len(ref), len(oth)), _t_p(diff, se, dof))
    return Comparison(diff, math.nan, math.nan, ONE_SEED, min(len(ref), len(oth)))


def _t_p(estimate: float, se: float, dof: float) -> float:
    """Two-sided p-value of ``estimate / se`` under Student's t with ``dof`` degrees of freedom."""
    if se == 0:
        # No spread: any difference at all is infinitely many standard errors away (as scipy's t-tests say),
        # and none is no evidence either way.
        return math.nan if estimate == 0 else 0.0
    return float(2 * stats.t.sf(abs(estimate / se), dof))


def holm(pvalues: Iterable[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the input order; NaN entries stay NaN and are not counted as tests.

    Sorted ascending, the ``j``-th smallest of ``m`` p-values is multiplied by ``m - j + 1`` and made
    non-decreasing (a running maximum), capped at 1: a hypothesis is rejected at level ``α`` exactly when its
    adjusted p-value is at most ``α``, and the family-wise error rate stays below ``α``.
    """
    p = np.asarray(list(pvalues), dtype=np.float64)
    out = np.full(len(p), math.nan)
    idx = np.flatnonzero(~np.isnan(p))
    m = len(idx)
    if m == 0:
        return out.tolist()
    order = idx[np.argsort(p[idx], kind="stable")]
    scaled = p[order] * (m - np.arange(m))
    out[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return out.tolist()


def score_ci(values: Iterable[float], stderrs: Iterable[float], level: float = 0.95) -> tuple[float, float, str]:
    """Mean benchmark accuracy over seeds and the half-width of its interval, with what the interval covers.

    Every seed answers the same items, so averaging seeds does not shrink the error of having drawn those items:
    the interval adds, in quadrature, the seed spread (Student t over seeds) and the item error (normal, from the
    root mean square of the runs' own standard errors, lm-eval's ``stderr``). ``kind`` is ``seeds+items``,
    ``items`` (one seed), ``seeds`` (no standard errors reported) or ``""`` (no interval).
    """
    x = np.asarray(list(values), dtype=np.float64)
    se = np.asarray(list(stderrs), dtype=np.float64)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, ""
    mean = float(x.mean())
    items = math.nan
    if len(se) == n and np.isfinite(se).all():
        items = float(stats.norm.ppf(0.5 + level / 2) * math.sqrt(np.mean(se**2)))
    if n < 2:
        return (mean, items, "items") if not math.isnan(items) else (mean, math.nan, "")
    _, seeds, _ = mean_ci(x, level)
    if math.isnan(items):
        return mean, seeds, "seeds"
    return mean, float(math.hypot(seeds, items)), "seeds+items"
