"""The right reference for each question: each variant against its own matched PreLN, each ablation against its
own base, paired on seeds and checked against scipy."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from test_families import random_losses, write_runs

from harness.reporting.items import Context, NoData
from harness.reporting.results import load_sweep
from harness.reporting.tables.ablations import ablation_table
from harness.reporting.tables.matched import matched_table

pytestmark = pytest.mark.xdist_group("report")


def _paired(losses, variant, reference):
    seeds = sorted(set(losses[variant]) & set(losses[reference]))
    diffs = [losses[variant][s] - losses[reference][s] for s in seeds]
    ci = stats.ttest_rel([losses[variant][s] for s in seeds], [losses[reference][s] for s in seeds])
    interval = ci.confidence_interval(0.95)
    return float(np.mean(diffs)), (interval.high - interval.low) / 2, len(seeds), ci.pvalue


def test_each_variant_is_compared_with_its_own_matched_preln(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    names = ["preln", "ldm-rls", "ldm", "mhc", "preln(match=ldm-rls)", "preln(match=ldm)"]
    losses = random_losses(rng, names)
    losses["ldm"] = {s: v for s, v in losses["ldm"].items() if s != 3}  # three pairs, not four
    write_runs(tmp_path, losses)
    t = matched_table(Context(load_sweep(tmp_path)))
    data = t.data.set_index("variant")
    # mhc has no matched PreLN in the sweep, and a PreLN is no row of its own: two rows.
    assert sorted(data.index) == ["ldm", "ldm-rls"]
    for variant in ("ldm", "ldm-rls"):
        reference = f"preln(match={variant})"
        delta, half, pairs, p = _paired(losses, variant, reference)
        row = data.loc[variant]
        assert row["reference"] == reference and row["delta_method"] == "paired t"
        assert row["delta"] == pytest.approx(delta, rel=1e-12)
        assert row["delta_ci95"] == pytest.approx(half, rel=1e-9)
        assert row["delta_pairs"] == pairs and row["delta_p"] == pytest.approx(p, rel=1e-9)
    # without declared families the table is one family of two tests
    raw = sorted(data["delta_p"])
    assert sorted(data["delta_p_holm"]) == pytest.approx([min(1, 2 * raw[0]), max(min(1, 2 * raw[0]), raw[1])])
    shown = t.display.to_dict("records")
    assert [r["Matched PreLN"] for r in shown] == ["preln(match=ldm)", "preln(match=ldm-rls)"]
    assert "(paired t, 3 pairs; seeds differ)" in shown[0]["Δ loss vs its reference (95% CI, method, pairs)"]


def test_without_a_matched_preln_there_is_no_table(tmp_path, rng_seed):
    write_runs(tmp_path, random_losses(np.random.default_rng(rng_seed), ["preln", "ldm-rls"]))
    with pytest.raises(NoData, match="matched PreLN"):
        matched_table(Context(load_sweep(tmp_path)))


def test_each_ablation_is_compared_with_its_own_base(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    names = ["preln", "ldm", "ldm-rls", "ldm(read=memory)", "ldm-rls(omega=off)", "ldm-rls(read=memory)"]
    losses = random_losses(rng, names)
    write_runs(tmp_path, losses)
    t = ablation_table(Context(load_sweep(tmp_path)))
    data = t.data
    assert list(zip(data["variant"], data["reference"])) == [
        ("ldm-rls", "ldm-rls"),
        ("ldm-rls(omega=off)", "ldm-rls"),
        ("ldm-rls(read=memory)", "ldm-rls"),
        ("ldm", "ldm"),
        ("ldm(read=memory)", "ldm"),
    ]
    rows = data.set_index("variant")
    for variant, base in (("ldm(read=memory)", "ldm"), ("ldm-rls(omega=off)", "ldm-rls")):
        delta, half, pairs, _ = _paired(losses, variant, base)
        assert rows.loc[variant, "delta"] == pytest.approx(delta, rel=1e-12)
        assert rows.loc[variant, "delta_ci95"] == pytest.approx(half, rel=1e-9)
        assert rows.loc[variant, "delta_pairs"] == pairs
    assert rows.loc["ldm", "delta"] == 0.0  # the head of its block
    assert list(pd.DataFrame(t.display)["Against"]) == list(data["reference"])


def test_only_bases_at_their_defaults_make_no_ablation_table(tmp_path, rng_seed):
    write_runs(tmp_path, random_losses(np.random.default_rng(rng_seed), ["preln", "ldm", "ldm-rls"]))
    with pytest.raises(NoData, match="no knob setting"):
        ablation_table(Context(load_sweep(tmp_path)))
