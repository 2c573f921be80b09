"""The report's intervals against scipy's own tests and closed forms."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from harness.reporting.stats import ONE_SEED, PAIRED, WELCH, compare, mean_ci, welch_ci


def test_paired_interval_is_the_t_interval_of_per_seed_differences():
    rng = np.random.default_rng()
    seeds = [0, 1, 2, 3, 4]
    ref = {s: float(v) for s, v in zip(seeds, rng.normal(3.0, 0.2, 5))}
    # A shared per-seed offset: pairing removes it, so the paired interval is much tighter than Welch's.
    other = {s: ref[s] - 0.05 + float(rng.normal(0, 0.01)) for s in seeds}
    c = compare(ref, other)
    d = np.array([other[s] - ref[s] for s in seeds])
    lo, hi = sps.ttest_1samp(d, 0.0).confidence_interval(0.95)
    assert c.method == PAIRED and c.n == 5
    assert c.delta == pytest.approx(d.mean(), abs=1e-12)
    assert (c.low, c.high) == pytest.approx((lo, hi), abs=1e-12)
    welch = sps.ttest_ind(list(other.values()), list(ref.values()), equal_var=False).confidence_interval(0.95)
    assert c.high - c.low < (welch.high - welch.low) / 3


def test_unshared_seeds_use_welch_as_scipy_computes_it():
    rng = np.random.default_rng()
    ref = {s: float(v) for s, v in zip(range(4), rng.normal(3.0, 0.2, 4))}
    other = {s: float(v) for s, v in zip(range(10, 13), rng.normal(2.9, 0.3, 3))}
    c = compare(ref, other)
    ci = sps.ttest_ind(list(other.values()), list(ref.values()), equal_var=False).confidence_interval(0.95)
    assert c.method == WELCH
    assert (c.low, c.high) == pytest.approx((ci.low, ci.high), abs=1e-10)
    diff, half, _ = welch_ci(other.values(), ref.values())
    assert diff == pytest.approx(c.delta) and half == pytest.approx(c.half_width)


def test_one_seed_has_no_interval():
    c = compare({0: 3.1}, {0: 3.0})
    assert c.method == ONE_SEED and math.isnan(c.low) and math.isnan(c.high)
    assert c.delta == pytest.approx(-0.1)


def test_mean_ci_matches_scipy():
    x = np.random.default_rng().normal(1.0, 0.5, 7)
    mean, half, n = mean_ci(x)
    lo, hi = sps.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=sps.sem(x))
    assert n == 7 and mean == pytest.approx(x.mean()) and half == pytest.approx((hi - lo) / 2)
