"""Declared claims: the grid's families are checked when it loads, Holm runs within each family, and a Δ outside
every family is shown without an adjusted p."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pandas as pd
import pytest
import yaml
from cli_checks import fails
from scipy import stats

from harness.errors import UsageError
from harness.reporting.claims import parse_claims
from harness.reporting.report import report
from harness.sweeps.grid import load_grid

pytestmark = pytest.mark.xdist_group("report")

GRID = """
base: {model: {preset: tiny}}
axes:
  variant: [preln, ldm-rls, "ldm-rls(omega=off)", "preln(match=ldm-rls)", ldm]
  train.seed: [0, 1, 2]
"""


def write_runs(root, losses: dict[str, dict[int, float]], tokens: int | None = 1000) -> None:
    """Finished run directories with the given final validation loss per variant and seed (and no token count
    with ``tokens=None``)."""
    for variant, by_seed in losses.items():
        for seed, loss in by_seed.items():
            run = root / f"{variant}-s{seed}".replace("(", "_").replace(")", "").replace("=", "-").replace(",", "_")
            run.mkdir(parents=True)
            config = {"variant": variant, "model": {"preset": "tiny"}, "train": {"seed": seed, "lr": 3e-3}}
            (run / "config.json").write_text(json.dumps(config))
            (run / "status.json").write_text(json.dumps({"state": "done", "step": 10}))
            summary = {"val_loss": loss} if tokens is None else {"val_loss": loss, "train_tokens": tokens}
            (run / "summary.json").write_text(json.dumps(summary))


def random_losses(rng, names, seeds=(0, 1, 2, 3)) -> dict[str, dict[int, float]]:
    return {name: {s: float(4.0 + rng.normal(0, 0.3)) for s in seeds} for name in names}


def _grid(tmp_path, report_section: str, extra: str = ""):
    path = tmp_path / "g.yaml"
    path.write_text(
        textwrap.dedent(GRID) + extra + "report:\n" + textwrap.indent(textwrap.dedent(report_section), "  ")
    )
    return path


def test_a_grid_declares_its_families_in_the_compact_form(tmp_path):
    path = _grid(
        tmp_path,
        """
        primary:
          - {variant: ldm-rls, against: preln}
          - {variants: [ldm-rls], against: matched}
        secondary:
          ablations: [{variants: ["ldm-rls(omega=off,lambda=learned)"], against: base}]
        """,
    )
    load_grid(path)  # the grid checks its declaration as it loads (the bad ones below are refused)
    claims = parse_claims(yaml.safe_load(path.read_text())["report"], str(path))
    assert [(c.family, c.variant, c.against) for c in claims] == [
        ("primary", "ldm-rls", "preln"),
        ("primary", "ldm-rls", "preln(match=ldm-rls)"),
        ("ablations", "ldm-rls(omega=off)", "ldm-rls"),  # canonical: the default knob is dropped
    ]
    assert parse_claims({"baseline": "preln"}, "g.yaml") is None


@pytest.mark.parametrize(
    "section, message",
    [
        ("primary: {variant: ldm-rls, against: preln}", "report.primary in"),
        ("primary: [{variant: ldm-rlz, against: preln}]", "Unknown variant 'ldm-rlz'"),
        ("primary: [{variant: ldm-rls}]", "needs 'against' and one of 'variant' or 'variants'"),
        ("primary: [{variant: ldm-rls, versus: preln, against: preln}]", "Unknown key 'versus'"),
        ("primary: [{variant: ldm-rls, against: ldm-rls}]", "compares ldm-rls with itself"),
        ("primary: [{variant: mhc, against: preln}]", "the grid does not run mhc"),
        ("primary: [{variant: ldm, against: matched}]", "the grid does not run preln(match=ldm)"),
        ("secondary: [{variant: ldm, against: preln}]", "report.secondary in"),
        (
            "primary: [{variant: ldm, against: preln}]\nsecondary: {more: [{variant: ldm, against: preln}]}",
            "declared in the families primary and more",
        ),
    ],
)
def test_a_bad_declaration_is_one_sentence_and_exit_2(tmp_path, capsys, section, message):
    path = _grid(tmp_path, section)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_grid(path)
    line = fails(capsys, ["sweep", str(path), "--dry-run"])
    assert message in line


def test_tuning_seeds_that_are_evaluation_seeds_are_refused_unless_allowed(tmp_path, capsys):
    tune = "tune: {axis: train.lr, values: [1.0e-3, 2.0e-3], select_on: tune_split, seeds: [2, 100]}\n"
    path = _grid(tmp_path, "baseline: preln\n", extra=tune)
    line = fails(capsys, ["sweep", str(path), "--dry-run"])
    assert "shares the seed(s) 2 with the grid's evaluation runs" in line and "allow_shared_seeds" in line
    path.write_text(path.read_text().replace("seeds: [2, 100]", "seeds: [2, 100], allow_shared_seeds: true"))
    assert load_grid(path).tune.allow_shared_seeds is True
    path.write_text(path.read_text().replace("seeds: [2, 100], allow_shared_seeds: true", "seeds: [100, 101]"))
    assert load_grid(path).tune.seeds == [100, 101]


def _holm(p: list[float]) -> list[float]:
    """Holm's step-down adjustment written out from its definition, independent of the report's."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def test_holm_runs_within_each_declared_family_and_other_rows_get_no_p(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    names = ["preln", "ldm-rls", "ldm", "ldm-rls(omega=off)", "preln(match=ldm-rls)", "attnres"]
    losses = random_losses(rng, names)
    root = tmp_path / "sweep"
    write_runs(root, losses)
    spec = {
        "tables": ["main", "matched", "ablations"],
        "figures": [],
        "primary": [{"variants": ["ldm-rls", "ldm"], "against": "preln"}, {"variant": "ldm-rls", "against": "matched"}],
        "secondary": {"ablations": [{"variant": "ldm-rls(omega=off)", "against": "base"}]},
    }
    out = tmp_path / "out"
    text = report(root, out_dir=out, spec=spec).read_text()

    def p(variant, against):
        seeds = sorted(losses[variant])
        return stats.ttest_rel([losses[variant][s] for s in seeds], [losses[against][s] for s in seeds]).pvalue

    primary = _holm([p("ldm-rls", "preln"), p("ldm", "preln"), p("ldm-rls", "preln(match=ldm-rls)")])
    main = pd.read_csv(out / "tables" / "main.csv").set_index("variant")
    assert main.loc["ldm-rls", "delta_p_holm"] == pytest.approx(primary[0], rel=1e-9)
    assert main.loc["ldm", "delta_p_holm"] == pytest.approx(primary[1], rel=1e-9)
    assert main.loc["ldm-rls", "family"] == "primary"
    # attnres − preln and the ablation − preln are shown, but no family holds them: no adjusted p.
    assert math.isnan(main.loc["attnres", "delta_p_holm"]) and math.isnan(
        main.loc["ldm-rls(omega=off)", "delta_p_holm"]
    )
    assert not isinstance(main.loc["attnres", "family"], str) or main.loc["attnres", "family"] == ""
    matched = pd.read_csv(out / "tables" / "matched.csv").set_index("variant")
    assert matched.loc["ldm-rls", "delta_p_holm"] == pytest.approx(primary[2], rel=1e-9)
    ablations = pd.read_csv(out / "tables" / "ablations.csv").set_index("variant")
    # A family of one test: its adjusted p is its own p.
    assert ablations.loc["ldm-rls(omega=off)", "delta_p_holm"] == pytest.approx(
        p("ldm-rls(omega=off)", "ldm-rls"), rel=1e-9
    )
    assert "## Claims" in text
    assert "- Primary family: 3 test(s)" in text and "- Secondary family *ablations*: 1 test(s)" in text
    shown = (out / "tables" / "main.md").read_text()
    assert "p (Holm, within family)" in shown and "| none " in shown


def test_without_declared_families_each_table_is_one_family(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    losses = random_losses(rng, ["preln", "ldm-rls", "ldm"])
    root = tmp_path / "sweep"
    write_runs(root, losses)
    out = tmp_path / "out"
    text = report(root, out_dir=out, spec={"tables": ["main"], "figures": []}).read_text()
    raw = [
        stats.ttest_rel([losses[v][s] for s in range(4)], [losses["preln"][s] for s in range(4)]).pvalue
        for v in ("ldm", "ldm-rls")
    ]
    main = pd.read_csv(out / "tables" / "main.csv").set_index("variant")
    assert list(main.loc[["ldm", "ldm-rls"], "delta_p_holm"]) == pytest.approx(_holm(raw), rel=1e-9)
    assert "## Claims" not in text and "family" not in main.columns


def test_a_family_tests_only_the_deltas_the_tables_compute(tmp_path, rng_seed):
    """Runs whose token budget is unknown get no Δ in the tables, so their family holds no test and no p either."""
    losses = random_losses(np.random.default_rng(rng_seed), ["preln", "ldm-rls"])
    root = tmp_path / "sweep"
    write_runs(root, losses, tokens=None)
    spec = {"tables": ["main"], "figures": [], "primary": [{"variant": "ldm-rls", "against": "preln"}]}
    out = tmp_path / "out"
    text = report(root, out_dir=out, spec=spec).read_text()
    main = pd.read_csv(out / "tables" / "main.csv").set_index("variant")
    assert math.isnan(main.loc["ldm-rls", "delta"]) and math.isnan(main.loc["ldm-rls", "delta_p_holm"])
    assert "- Primary family: 0 test(s)" in text
