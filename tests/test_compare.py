"""``depthmem compare`` on two synthetic sweeps of known per-seed numbers: differences, intervals and p-values
against scipy's paired t-test, pairing on shared seeds only, rows one sweep lacks, the command's output and errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from cli_checks import fails
from scipy import stats

from harness.cli import main as cli_main
from harness.errors import UsageError
from harness.reporting.archive import pack
from harness.reporting.compare import compare_sweeps

TASK = "piqa"
# (variant, lr, seeds) of each sweep: lr is a grid axis of both; attnres and lr=1e-3 only in A, hc only in B.
RUNS_A = [("preln", 3e-3, (0, 1, 2, 3)), ("ldm", 3e-3, (0, 1, 2)), ("attnres", 3e-3, (0, 1)), ("preln", 1e-3, (0, 1))]
RUNS_B = [("preln", 3e-3, (0, 1, 2, 3)), ("ldm", 3e-3, (1, 2, 3, 4)), ("hc", 3e-3, (0, 1)), ("preln", 1e-2, (0, 1))]


def _write_run(folder, variant, lr, seed, loss, acc, corpus):
    """A finished run directory with the files the comparison reads: config, status, summary, eval table."""
    folder.mkdir(parents=True)
    config = {
        "variant": variant,
        "model": {"preset": "tiny"},
        "data": {"corpus": corpus},
        "train": {"seed": seed, "lr": lr},
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "status.json").write_text(json.dumps({"state": "done", "step": 40}))
    (folder / "summary.json").write_text(json.dumps({"val_loss": loss, "step": 40, "tokens": 40000}))
    (folder / "eval").mkdir()
    lines = ["task,metric,value,stderr", f"{TASK},acc,{acc - 0.01!r},0.01", f"{TASK},acc_norm,{acc!r},0.01"]
    (folder / "eval" / "table.csv").write_text("\n".join(lines) + "\n")


def _write_sweep(root, runs, corpus, rng):
    """Write the runs with random losses and accuracies; return them by (variant, lr) -> seed -> (loss, acc)."""
    known: dict[tuple[str, float], dict[int, tuple[float, float]]] = {}
    for variant, lr, seeds in runs:
        for seed in seeds:
            loss, acc = float(rng.normal(3.3, 0.05)), float(rng.uniform(0.5, 0.7))
            _write_run(root / f"{variant}-lr{lr}" / f"s{seed}", variant, lr, seed, loss, acc, corpus)
            known.setdefault((variant, lr), {})[seed] = (loss, acc)
    return known


@pytest.fixture
def sweeps(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    a = _write_sweep(tmp_path / "results" / "base", RUNS_A, "shakespeare", rng)
    b = _write_sweep(tmp_path / "results" / "change", RUNS_B, "tinystories", rng)
    return tmp_path / "results", a, b


def _row(frame, table, variant, lr, task=""):
    rows = frame[(frame["table"] == table) & (frame["variant"] == variant) & (frame["lr"] == lr)]
    rows = rows[rows["task"] == task]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def _paired_t(a: dict[int, float], b: dict[int, float]):
    """Brute force: the per-seed differences on the shared seeds, scipy's paired t-test and t-interval."""
    seeds = sorted(set(a) & set(b))
    d = np.array([b[s] - a[s] for s in seeds])
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    p = stats.ttest_rel([b[s] for s in seeds], [a[s] for s in seeds]).pvalue
    return d.mean(), d.mean() - half, d.mean() + half, p, len(seeds)


def test_differences_match_a_paired_t_test_on_the_shared_seeds(sweeps):
    root, a, b = sweeps
    frame = compare_sweeps(root / "base", root / "change")
    expected_p = []
    for variant in ("preln", "ldm"):
        for index, table in ((0, "val_loss"), (1, "downstream")):
            task = TASK if table == "downstream" else ""
            side_a = {s: v[index] for s, v in a[(variant, 3e-3)].items()}
            side_b = {s: v[index] for s, v in b[(variant, 3e-3)].items()}
            delta, low, high, p, n = _paired_t(side_a, side_b)
            row = _row(frame, table, variant, 3e-3, task)
            assert row["in"] == "both" and row["method"] == "paired t" and row["pairs"] == n
            assert row["delta"] == pytest.approx(delta, rel=1e-9, abs=1e-12)
            assert (row["low"], row["high"]) == pytest.approx((low, high), rel=1e-9, abs=1e-12)
            assert row["p"] == pytest.approx(p, rel=1e-6)
            assert row["mean_a"] == pytest.approx(np.mean(list(side_a.values())))
            assert row["mean_b"] == pytest.approx(np.mean(list(side_b.values())))
            expected_p.append((table, p))
    # Holm over each table's two tests: the smaller p times 2, the larger kept at least as large, capped at 1.
    for table in ("val_loss", "downstream"):
        ps = sorted(p for t, p in expected_p if t == table)
        holm = [min(1.0, 2 * ps[0]), min(1.0, max(2 * ps[0], ps[1]))]
        got = sorted(frame.loc[(frame["table"] == table) & (frame["in"] == "both"), "p_holm"])
        assert got == pytest.approx(holm, rel=1e-6)


def test_only_the_seeds_both_sweeps_have_pair(sweeps):
    root, a, b = sweeps
    frame = compare_sweeps(root / "base", root / "change")
    row = _row(frame, "val_loss", "ldm", 3e-3)
    # A has seeds 0-2, B seeds 1-4: seeds 1 and 2 pair; 0, 3 and 4 stay out of the difference but not the means.
    assert row["pairs"] == 2 and bool(row["partial"])
    assert (row["seeds_a"], row["seeds_b"]) == (3, 4)
    shared = [b[("ldm", 3e-3)][s][0] - a[("ldm", 3e-3)][s][0] for s in (1, 2)]
    assert row["delta"] == pytest.approx(np.mean(shared), rel=1e-9)
    assert not bool(_row(frame, "val_loss", "preln", 3e-3)["partial"])


def test_rows_one_sweep_lacks_are_listed_without_a_difference(sweeps):
    root, _, _ = sweeps
    frame = compare_sweeps(root / "base", root / "change")
    loss = frame[frame["table"] == "val_loss"]
    where = {(r.variant, r.lr): r["in"] for _, r in loss.iterrows()}
    assert where == {
        ("preln", 3e-3): "both",
        ("ldm", 3e-3): "both",
        ("attnres", 3e-3): "A only",
        ("preln", 1e-3): "A only",
        ("hc", 3e-3): "B only",
        ("preln", 1e-2): "B only",
    }
    alone = loss[loss["in"] != "both"]
    assert alone["delta"].isna().all() and alone["p_holm"].isna().all() and (alone["pairs"] == 0).all()
    assert (alone.loc[alone["in"] == "A only", "seeds_b"] == 0).all()


def test_the_command_prints_markdown_json_and_csv(sweeps, capsys, tmp_path):
    root, a, b = sweeps
    out = tmp_path / "cmp.csv"
    assert cli_main(["compare", "base", "change", "--results", str(root), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## Final validation loss" in text and "## Downstream accuracy (%)" in text
    assert "| B only" in text and "A only" in text
    delta = np.mean([b[("preln", 3e-3)][s][0] - a[("preln", 3e-3)][s][0] for s in range(4)])
    assert f"{delta:+.4f}" in text
    written = pd.read_csv(out)
    assert len(written) == 12 and set(written["table"]) == {"val_loss", "downstream"}
    assert cli_main(["compare", str(root / "base"), str(root / "change"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    hc = next(r for r in rows if r["variant"] == "hc" and r["table"] == "val_loss")
    assert hc["delta"] is None and hc["seeds_b"] == 2 and hc["lr"] == 3e-3


def test_a_packed_sweep_compares_like_its_folder(sweeps, tmp_path):
    root, _, _ = sweeps
    archive = pack(root / "change", tmp_path / "change.tar.xz")
    from_folder = compare_sweeps(root / "base", root / "change")
    pd.testing.assert_frame_equal(compare_sweeps(root / "base", archive), from_folder)


def test_bad_input_gives_one_sentence_and_exit_2(sweeps, capsys, tmp_path):
    root, _, _ = sweeps
    line = fails(capsys, ["compare", "base", "nope", "--results", str(root)])
    assert "No sweep 'nope'" in line
    other = tmp_path / "other"
    _write_run(other / "r", "mhc", 3e-3, 0, 3.3, 0.6, "shakespeare")
    line = fails(capsys, ["compare", str(root / "base"), str(other)])
    assert "no finished run in common" in line
    broken = tmp_path / "broken.tar.xz"
    broken.write_bytes(b"not an archive at all")
    line = fails(capsys, ["compare", str(broken), str(root / "base")])
    assert "cannot be read" in line
    line = fails(capsys, ["compare", "base", "change", "--results", str(root), "--out", str(tmp_path / "x.txt")])
    assert "--out" in line
    with pytest.raises(UsageError):
        compare_sweeps(root / "base", other)


def test_an_axis_only_one_sweep_varies_pairs_on_the_other_sweeps_fixed_value(sweeps, rng_seed):
    root, a, _ = sweeps
    rng = np.random.default_rng(rng_seed + 1)
    fixed = _write_sweep(root / "fixed", [("preln", 3e-3, (0, 1, 2))], "shakespeare", rng)
    frame = compare_sweeps(root / "base", root / "fixed")
    row = _row(frame, "val_loss", "preln", 3e-3)
    delta, *_ = _paired_t(
        {s: v[0] for s, v in a[("preln", 3e-3)].items()}, {s: v[0] for s, v in fixed[("preln", 3e-3)].items()}
    )
    assert row["in"] == "both" and row["pairs"] == 3 and row["delta"] == pytest.approx(delta, rel=1e-9)
    assert _row(frame, "val_loss", "preln", 1e-3)["in"] == "A only"


def test_a_file_a_sweep_cannot_read_is_noted_under_the_tables(sweeps, capsys):
    root, _, _ = sweeps
    broken = root / "change" / "preln-lr0.003" / "s9"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert cli_main(["compare", "base", "change", "--results", str(root)]) == 0
    text = capsys.readouterr().out
    assert "- B: Skipped preln-lr0.003/s9/config.json: it could not be read" in text
    assert compare_sweeps(root / "change", root / "base").attrs["notes"][0].startswith("A: Skipped")
