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


MCNEMAR, SIGN_FLIP = "McNemar", "sign-flip"


@dataclass(frozen=True)
class ItemComparison:
    """``delta = mean over items of (other - reference)`` on the items and seeds both sides answered."""

    delta: float
    low: float
    high: float
    p: float
    method: str  # MCNEMAR (one seed, right/wrong scores) or SIGN_FLIP
    items: int
    seeds: int
    discordant: int  # items whose seed-averaged score differs between the two sides

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def paired_items(
    reference: Mapping[int, Mapping[int, float]],
    other: Mapping[int, Mapping[int, float]],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    flips: int = 20000,
) -> ItemComparison | None:
    """The difference ``other - reference`` in a benchmark score, paired on items and seeds.

    Both arguments map seed -> {item id -> score}. Only seeds both sides have, and items every one of those runs
    answered, enter. Each item's difference is averaged over the seeds first, so an item counts once however many
    seeds answered it. The interval is a percentile bootstrap over items (resampling the same items for both
    sides, which is what pairing means). The test of "no difference": with one seed and right/wrong scores,
    McNemar's exact test (a two-sided binomial test on the items only one side got right); otherwise a sign-flip
    test of the seed-averaged item differences (exact up to 16 differing items, else ``flips`` random flips).
    Random draws use a fixed generator, so a report gives the same numbers every time. None when no seed or no
    item is shared.
    """
    seeds = sorted(set(reference) & set(other))
    if not seeds:
        return None
    items = set.intersection(*(set(reference[s]) & set(other[s]) for s in seeds))
    if not items:
        return None
    ids = sorted(items)
    diff = np.array([[other[s][i] - reference[s][i] for s in seeds] for i in ids], dtype=np.float64)
    per_item = diff.mean(axis=1)
    delta = float(per_item.mean())
    rng = np.random.default_rng(0)
    # In chunks: a full benchmark's 10^4 items times 2000 resamples would take gigabytes at once.
    boot = np.concatenate(
        [
            per_item[rng.integers(0, len(ids), size=(min(100, resamples - k), len(ids)))].mean(axis=1)
            for k in range(0, resamples, 100)
        ]
    )
    low, high = (float(q) for q in np.quantile(boot, [0.5 - level / 2, 0.5 + level / 2]))
    nonzero = per_item[per_item != 0]
    binary = len(seeds) == 1 and all(
        v in (0.0, 1.0) for side in (reference, other) for v in (side[seeds[0]][i] for i in ids)
    )
    if binary:
        wins, losses = int((nonzero > 0).sum()), int((nonzero < 0).sum())
        p = 1.0 if wins + losses == 0 else float(stats.binomtest(wins, wins + losses, 0.5).pvalue)
        method = MCNEMAR
    else:
        p, method = _sign_flip_p(nonzero, flips, rng), SIGN_FLIP
    return ItemComparison(delta, low, high, p, method, len(ids), len(seeds), len(nonzero))


def _sign_flip_p(d: np.ndarray, flips: int, rng: np.random.Generator) -> float:
    """Two-sided p-value of ``|sum(d)|`` when each difference's sign is a fair coin (items exchangeable)."""
    if len(d) == 0:
        return 1.0
    observed = abs(d.sum())
    tol = 1e-9 * max(1.0, float(np.abs(d).sum()))  # sums equal up to rounding count as "as extreme"
    if len(d) <= 16:
        signs = 1 - 2 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)
        return float(np.mean(np.abs(signs @ d) >= observed - tol))
    extreme = 0
    for k in range(0, flips, 500):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(500, flips - k), len(d)))
        extreme += int(np.sum(np.abs(signs @ d) >= observed - tol))
    return (1 + extreme) / (1 + flips)
