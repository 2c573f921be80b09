"""The learning-rate sensitivity of the verdicts, from a synthetic tuning.json: the loss at every rate with its seed
spread, near ties, and each headline Δ at the neighbouring rates."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from harness.reporting.claims import parse_claims
from harness.reporting.items import Context, NoData
from harness.reporting.results import Sweep
from harness.reporting.sensitivity import lr_neighbours_table, lr_sensitivity_figure, lr_sensitivity_table

pytestmark = pytest.mark.xdist_group("report")

RATES = [1e-3, 2e-3, 4e-3, 8e-3]
SEEDS = [100, 101, 102]


def _cell(variant, losses, chosen):
    """A tuned cell of tuning.json: ``losses`` maps rate -> one loss per tuning seed (None: diverged)."""
    runs = {f"{v:g}": {f"{variant}-lr{v:g}-tune-s{s}-0": x for s, x in zip(SEEDS, xs)} for v, xs in losses.items()}
    metric = {f"{v:g}": None if None in xs else float(np.mean(xs)) for v, xs in losses.items()}
    return {"cell": f"variant={variant}", "variant": variant, "overrides": {"variant": variant}, "tuned": True,
            "state": "chosen", "chosen": chosen, "values": RATES, "metric": metric, "runs": runs}  # fmt: skip


def _borrowed(variant, source):
    return {"cell": f"variant={variant}", "variant": variant, "overrides": {"variant": variant}, "tuned": False,
            "from": f"variant={source}", "state": "chosen", "chosen": 2e-3}  # fmt: skip


@pytest.fixture
def tuned(tmp_path, rng_seed):
    """preln's choice has a near tie one step up; ldm-rls beats preln at the chosen rates and one step down, and
    loses one step up."""
    rng = np.random.default_rng(rng_seed)

    def noise():
        """A seed's spread, centred and scaled to a sample sd of exactly 0.02. The near tie below is decided against
        the spread, and three plain draws spread under a tenth of 0.02 about once in 100, where 4e-3 was no tie."""
        x = rng.normal(0, 1, len(SEEDS))
        return 0.02 * (x - x.mean()) / x.std(ddof=1)

    base = 4.0 + noise()
    preln = {1e-3: base + 0.5, 2e-3: base, 4e-3: base + rng.uniform(0, 0.002), 8e-3: base + 0.6}
    ldm = {1e-3: base + 0.1, 2e-3: base - 0.3, 4e-3: base + 0.4, 8e-3: [4.0, None, 4.1]}
    curves = {"preln": ({v: list(x) for v, x in preln.items()}, 2e-3)}
    curves["ldm-rls"] = ({v: list(x) if not isinstance(x, list) else x for v, x in ldm.items()}, 2e-3)
    curves["ldm-rls"][0][2e-3] = list(base - 0.3 + noise())
    cells = [_cell(v, losses, chosen) for v, (losses, chosen) in curves.items()]
    cells += [_borrowed("preln(match=ldm-rls)", "preln")]
    (tmp_path / "tuning.json").write_text(json.dumps({"axis": "train.lr", "values": RATES, "cells": cells}))
    return tmp_path, curves


def _stats(xs):
    x = np.asarray(xs, dtype=np.float64)
    return x.mean(), x.std(ddof=1), x.std(ddof=1) / math.sqrt(len(x))


def test_the_table_gives_every_rates_mean_and_spread_and_marks_near_ties(tuned):
    root, curves = tuned
    t = lr_sensitivity_table(Context(Sweep(root=root, runs=[])))
    rows = t.data.set_index("variant")
    for variant, (losses, chosen) in curves.items():
        for v, xs in losses.items():
            if None in xs:
                assert math.isnan(rows.loc[variant, f"loss@{v:g}"])
                continue
            mean, sd, _ = _stats(xs)
            assert rows.loc[variant, f"loss@{v:g}"] == pytest.approx(mean, rel=1e-12)
            assert rows.loc[variant, f"sd@{v:g}"] == pytest.approx(sd, rel=1e-9)
        best = _stats(losses[chosen])
        ties = []
        for other in (RATES[RATES.index(chosen) - 1], RATES[RATES.index(chosen) + 1]):
            if None not in losses[other]:
                m, _, se = _stats(losses[other])
                ties.append(abs(m - best[0]) <= math.hypot(best[2], se))
        assert rows.loc[variant, "near_tie"] == any(ties)
    assert rows.loc["preln", "near_tie"]  # 4e-3 is within a fraction of a seed's spread of 2e-3
    shown = {r["Variant"]: r for r in t.display.to_dict("records")}
    assert shown["preln"]["Near tie"].startswith("⚠ 0.004") and shown["preln"]["lr=0.002"].endswith("◀")
    assert shown["ldm-rls"]["lr=0.008"] == "diverged"
    assert "preln(match=ldm-rls)" not in shown  # it took preln's rate: no curve of its own


def test_each_headline_delta_is_retaken_one_rate_down_and_up_and_a_sign_change_is_flagged(tuned):
    root, curves = tuned
    claims = parse_claims(
        {"primary": [{"variant": "ldm-rls", "against": "preln"}, {"variant": "ldm-rls", "against": "matched"}]},
        "g.yaml",
    )
    t = lr_neighbours_table(Context(Sweep(root=root, runs=[]), claims=claims))
    rows = t.data.set_index("against")
    mine, ref = curves["ldm-rls"][0], curves["preln"][0]
    for column, rate in (("delta_down", 1e-3), ("delta", 2e-3), ("delta_up", 4e-3)):
        expected = np.mean(mine[rate]) - np.mean(ref[rate])
        assert rows.loc["preln", column] == pytest.approx(expected, rel=1e-12)
    assert rows.loc["preln", "delta"] < 0 < rows.loc["preln", "delta_up"]
    assert rows.loc["preln", "sign_changes"]
    shown = t.display.to_dict("records")
    assert shown[0]["Sign"] == "⚠ changes one step up"
    assert "preln(match=ldm-rls) not tuned; it takes the rate of preln" in shown[1]["Δ at the chosen rates"]
    assert any("sign changes at a neighbouring rate for: ldm-rls − preln" in n for n in t.notes)


def test_the_figure_is_drawn_and_a_sweep_without_tuning_has_neither(tuned, tmp_path_factory):
    root, _ = tuned
    fig, caption = lr_sensitivity_figure(Context(Sweep(root=root, runs=[])))
    (ax,) = fig.axes[:1]
    assert ax.get_xscale() == "log" and "tuning seeds" in caption
    assert ax.get_legend_handles_labels()[1] == ["preln", "ldm-rls"]
    empty = tmp_path_factory.mktemp("untuned")
    for fn in (lr_sensitivity_table, lr_neighbours_table, lr_sensitivity_figure):
        with pytest.raises(NoData):
            fn(Context(Sweep(root=empty, runs=[])))


def test_a_claim_on_a_row_that_borrowed_its_rate_is_named(tuned):
    from harness.reporting.sensitivity import untuned_claims

    root, _ = tuned
    claims = parse_claims({"primary": [{"variant": "ldm-rls", "against": "matched"}]}, "g.yaml")
    assert untuned_claims(Context(Sweep(root=root, runs=[]), claims=claims)) == ["preln(match=ldm-rls) (rate of preln)"]
    claims = parse_claims({"primary": [{"variant": "ldm-rls", "against": "preln"}]}, "g.yaml")
    assert untuned_claims(Context(Sweep(root=root, runs=[]), claims=claims)) == []
