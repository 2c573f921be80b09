"""Intervals for the report: a mean over seeds, and the difference between two variants.

Seeds are shared across the variants of a grid: seed ``s`` gives every variant the same data order and the same
initial decoder weights (embedding, attention, MLPs; ``harness.model.factory`` draws a mixer's own weights from a
separate stream, and ``preln(match=...)`` keeps PreLN's weights with MLP units appended), so the honest interval
for a difference uses the per-seed differences (paired t). Welch's
interval is for variants whose runs do not share seeds; with one value on either side there is no interval.
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
    values on either side, no interval.
    """
    shared = sorted(set(reference) & set(other))
    if len(shared) >= 2:
        diffs = [other[s] - reference[s] for s in shared]
        mean, half, n = mean_ci(diffs, level)
        return Comparison(mean, mean - half, mean + half, PAIRED, n)
    ref, oth = list(reference.values()), list(other.values())
    diff, half, _ = welch_ci(oth, ref, level)
    if len(ref) >= 2 and len(oth) >= 2:
        return Comparison(diff, diff - half, diff + half, WELCH, min(len(ref), len(oth)))
    return Comparison(diff, math.nan, math.nan, ONE_SEED, min(len(ref), len(oth)))
