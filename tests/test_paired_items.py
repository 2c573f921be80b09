"""Downstream differences paired on items: the statistics against brute force, and the report's table."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from harness.reporting import tables  # noqa: F401  (importing the package registers the tables)
from harness.reporting.items import Context
from harness.reporting.results import load_sweep
from harness.reporting.stats import MCNEMAR, SIGN_FLIP, holm, paired_items


def _binary(rng, n, p):
    return dict(enumerate(rng.binomial(1, p, n).astype(float)))


def test_one_seed_is_mcnemars_exact_test(rng_seed):
    rng = np.random.default_rng(rng_seed)
    ref, other = _binary(rng, 300, 0.5), _binary(rng, 300, 0.6)
    c = paired_items({3: ref}, {3: other})
    b = int(sum(other[i] > ref[i] for i in ref))  # items only the other side got right
    k = int(sum(other[i] < ref[i] for i in ref))
    n = b + k
    # McNemar's exact test from its definition: twice the smaller binomial tail, capped at one.
    tail = sum(math.comb(n, j) for j in range(min(b, k) + 1)) / 2**n
    assert c.method == MCNEMAR and c.discordant == n and c.items == 300 and c.seeds == 1
    assert c.p == pytest.approx(min(1.0, 2 * tail), rel=1e-9)
    assert c.delta == pytest.approx((b - k) / 300, abs=1e-15)


def test_several_seeds_use_an_exact_sign_flip_test_on_seed_averaged_items(rng_seed):
    rng = np.random.default_rng(rng_seed)
    seeds = (0, 1, 2)
    ref = {s: _binary(rng, 12, 0.5) for s in seeds}
    other = {s: _binary(rng, 12, 0.5) for s in seeds}
    c = paired_items(ref, other)
    d = np.array([np.mean([other[s][i] - ref[s][i] for s in seeds]) for i in range(12)])
    # Brute force: every assignment of signs to the 12 items, as likely as any other under no difference.
    sums = [abs(np.dot(signs, d)) for signs in itertools.product((-1, 1), repeat=12)]
    want = np.mean([s >= abs(d.sum()) - 1e-12 for s in sums])
    assert c.method == SIGN_FLIP and c.seeds == 3
    assert c.delta == pytest.approx(d.mean(), abs=1e-15)
    assert c.p == pytest.approx(want, abs=1e-12)


def test_many_differing_items_sample_the_flips_close_to_exact(rng_seed):
    rng = np.random.default_rng(rng_seed)
    ref = {s: dict(enumerate(rng.uniform(0, 1, 18))) for s in (0, 1)}
    other = {s: {i: v + rng.normal(0.1, 0.3) for i, v in ref[s].items()} for s in (0, 1)}
    c = paired_items(ref, other, flips=40000)
    d = np.array([np.mean([other[s][i] - ref[s][i] for s in (0, 1)]) for i in range(18)])
    signs = 1 - 2 * ((np.arange(2**18)[:, None] >> np.arange(18)) & 1)
    exact = np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-12)
    assert c.discordant == 18
    assert c.p == pytest.approx(exact, abs=0.01)  # 40000 flips: a binomial error of at most 0.0025


def test_interval_is_a_bootstrap_over_items_near_the_normal_one(rng_seed):
    rng = np.random.default_rng(rng_seed)
    ref, other = _binary(rng, 4000, 0.5), _binary(rng, 4000, 0.55)
    c = paired_items({0: ref}, {0: other})
    d = np.array([other[i] - ref[i] for i in range(4000)])
    half = stats.norm.ppf(0.975) * d.std(ddof=1) / math.sqrt(len(d))
    assert c.low < c.delta < c.high
    assert c.half_width == pytest.approx(half, rel=0.12)


def test_only_shared_seeds_and_items_enter(rng_seed):
    rng = np.random.default_rng(rng_seed)
    ref = {0: _binary(rng, 50, 0.5), 1: _binary(rng, 50, 0.5), 2: _binary(rng, 50, 0.5)}
    other = {1: _binary(rng, 40, 0.5), 2: _binary(rng, 50, 0.5), 7: _binary(rng, 50, 0.5)}
    c = paired_items(ref, other)
    assert (c.seeds, c.items) == (2, 40)
    want = np.mean([np.mean([other[s][i] - ref[s][i] for s in (1, 2)]) for i in range(40)])
    assert c.delta == pytest.approx(want, abs=1e-15)
    assert paired_items({0: ref[0]}, {1: other[1]}) is None


# --- the report's table -----------------------------------------------------------------------------------------


def _run(folder, variant, seed, items):
    folder.mkdir(parents=True)
    config = {"name": "s", "variant": variant, "model": {"preset": "tiny"}, "train": {"seed": seed}, "eval": {}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "status.json").write_text(json.dumps({"state": "done", "step": 5, "message": "done"}))
    summary = {"val_loss": 3.0 + 0.01 * seed, "step": 5, "tokens": 500, "train_tokens": 500, "train_steps": 5}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "eval").mkdir()
    rows = [(task, i, "acc", v) for task, scores in items.items() for i, v in scores.items()]
    frame = pd.DataFrame(rows, columns=["task", "doc_id", "metric", "value"])
    acc = frame.groupby("task")["value"].mean()
    (folder / "eval" / "table.csv").write_text(
        "task,metric,value,stderr\n" + "".join(f"{t},acc,{v},0.05\n" for t, v in acc.items())
    )
    frame.to_csv(folder / "eval" / "items.csv.gz", index=False)


def test_table_pairs_each_variant_with_the_baseline_on_items(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    tasks = ("offline_copa", "offline_piqa")
    scores = {
        (v, s): {t: _binary(rng, 60, p) for t in tasks}
        for v, p in (("preln", 0.5), ("ldm", 0.6), ("attnres", 0.5))
        for s in (0, 1)
    }
    scores[("mhc", 4)] = {t: _binary(rng, 60, 0.5) for t in tasks}  # shares no seed with preln: no row
    for (variant, seed), items in scores.items():
        _run(tmp_path / f"{variant}-s{seed}", variant, seed, items)
    table = Context(load_sweep(tmp_path)).table("downstream_paired")
    data = table.data
    assert list(zip(data["variant"], data["task"])) == [
        (v, t) for v in ("attnres", "ldm") for t in tasks
    ]  # the report's variant order
    ps = []
    for row in data.to_dict("records"):
        c = paired_items(
            {s: scores[("preln", s)][row["task"]] for s in (0, 1)},
            {s: scores[(row["variant"], s)][row["task"]] for s in (0, 1)},
        )
        d = [
            np.mean(
                [scores[(row["variant"], s)][row["task"]][i] - scores[("preln", s)][row["task"]][i] for s in (0, 1)]
            )
            for i in range(60)
        ]
        assert row["delta"] == pytest.approx(np.mean(d), abs=1e-12)
        assert (row["seeds"], row["items"], row["method"]) == (2, 60, SIGN_FLIP)
        assert row["p"] == pytest.approx(c.p, abs=1e-12)
        ps.append(c.p)
    assert list(data["p_holm"]) == pytest.approx(holm(ps), abs=1e-12)
    assert "mhc" not in set(data["variant"])
    assert any("Holm" in note for note in table.notes)
