"""The report's intervals against scipy's own tests and closed forms."""

import math
import warnings

import numpy as np
import pytest
from scipy import stats as sps

from harness.reporting.stats import ONE_SEED, PAIRED, WELCH, compare, holm, mean_ci, score_ci, welch_ci


def test_paired_interval_is_the_t_interval_of_per_seed_differences(rng_seed):
    rng = np.random.default_rng(rng_seed)
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


def test_unshared_seeds_use_welch_as_scipy_computes_it(rng_seed):
    rng = np.random.default_rng(rng_seed)
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


def test_mean_ci_matches_scipy(rng_seed):
    x = np.random.default_rng(rng_seed).normal(1.0, 0.5, 7)
    mean, half, n = mean_ci(x)
    lo, hi = sps.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=sps.sem(x))
    assert n == 7 and mean == pytest.approx(x.mean()) and half == pytest.approx((hi - lo) / 2)


def test_p_values_are_scipys_paired_and_welch_tests(rng_seed):
    rng = np.random.default_rng(rng_seed)
    ref = {s: float(v) for s, v in zip(range(5), rng.normal(3.0, 0.2, 5))}
    other = {s: ref[s] - 0.03 + float(rng.normal(0, 0.02)) for s in range(5)}
    c = compare(ref, other)
    assert c.p == pytest.approx(sps.ttest_rel(list(other.values()), list(ref.values())).pvalue, rel=1e-9)
    assert c.pairs == 5 and not c.partial
    far = {s + 10: float(v) for s, v in zip(range(3), rng.normal(2.9, 0.3, 3))}
    w = compare(ref, far)
    assert w.p == pytest.approx(sps.ttest_ind(list(far.values()), list(ref.values()), equal_var=False).pvalue)
    assert w.pairs == 0 and not w.partial


def test_p_value_without_spread_follows_scipy():
    for ref, other in (({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.5, 1: 2.5, 2: 3.5}), ({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # scipy warns that the data have no spread
            expected = sps.ttest_rel(list(other.values()), list(ref.values())).pvalue
        got = compare(ref, other).p
        assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_partly_shared_seeds_are_paired_on_the_shared_ones_and_flagged():
    ref, other = {0: 3.0, 1: 3.2, 5: 3.9}, {0: 2.9, 1: 3.0, 2: 2.0}
    c = compare(ref, other)
    assert c.method == PAIRED and c.pairs == 2 and c.partial
    assert c.delta == pytest.approx(-0.15)
    assert c.p == pytest.approx(sps.ttest_rel([2.9, 3.0], [3.0, 3.2]).pvalue, rel=1e-9)


def test_holm_matches_the_step_down_procedure(rng_seed):
    rng = np.random.default_rng(rng_seed)
    for m in (1, 2, 5, 12):
        p = rng.uniform(0, 0.2, m) ** 2
        adjusted = holm(p)
        # Brute force: at each level, reject in ascending order while p_(j) <= alpha / (m - j + 1).
        for alpha in np.linspace(0.0005, 1, 400):
            rejected, order = set(), np.argsort(p)
            for j, i in enumerate(order):
                if p[i] > alpha / (m - j):
                    break
                rejected.add(i)
            assert rejected == {i for i in range(m) if adjusted[i] <= alpha}
        assert all(a >= b for a, b in zip(adjusted, p)) and max(adjusted) <= 1.0
    assert holm([0.01, math.nan, 0.04]) == pytest.approx([0.02, math.nan, 0.04], nan_ok=True)
    assert holm([]) == []


def test_score_interval_adds_item_error_to_seed_spread():
    z = sps.norm.ppf(0.975)
    # Two seeds that agree on every item: the seed spread is zero, the item error is not.
    mean, half, kind = score_ci([0.75, 0.75], [0.105, 0.105])
    assert (mean, kind) == (0.75, "seeds+items") and half == pytest.approx(z * 0.105, rel=1e-12)
    x, se = np.array([0.61, 0.55, 0.58, 0.66]), np.array([0.03, 0.04, 0.035, 0.03])
    mean, half, kind = score_ci(x, se)
    seeds = sps.t.interval(0.95, 3, loc=x.mean(), scale=sps.sem(x))[1] - x.mean()
    assert half == pytest.approx(math.sqrt(seeds**2 + z**2 * np.mean(se**2)), rel=1e-12)
    assert score_ci([0.6], [0.05])[1:] == pytest.approx((z * 0.05, "items"))
    assert score_ci([0.6, 0.7], [math.nan, math.nan])[2] == "seeds"
