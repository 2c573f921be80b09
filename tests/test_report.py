"""The report on a synthetic results tree with known numbers: tables against scipy, listings, figures, reruns."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from harness.cli import main as cli_main
from harness.errors import UsageError
from harness.reporting import figures as figs
from harness.reporting.items import Context
from harness.reporting.report import report, report_spec, resolve_target
from harness.reporting.results import aggregate, load_sweep, split_variant

# The study runs the reports read are trained first.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("report")]

N_LAYERS = 4
TASKS = {"arc_easy": ("acc", "acc_norm"), "piqa": ("acc", "acc_norm"), "lambada_openai": ("acc", "perplexity")}
# (variant as a user writes it, seeds, state, message): every run of the synthetic sweep.
RUNS = [
    ("preln", (0, 1, 2), "done", ""),
    ("ldm-rls", (0, 1, 2), "done", ""),
    ("ldm-rls(groups=4)", (0, 1), "done", ""),
    ("ldm-rls(omega=off)", (0, 1, 2), "done", ""),
    ("attnres", (0,), "done", ""),
    ("denseformer", (7, 8, 9), "done", ""),  # seeds no other variant has: a Welch interval
    ("hc", (0,), "failed", "CUDA out of memory at step 12"),
    ("ldm", (5,), "diverged", "non-finite loss at step 30"),
    ("preln", (3,), "running", ""),
]
PRESET = {
    "preset": "tiny",
    "vocab_size": 512,
    "d_model": 64,
    "n_blocks": N_LAYERS // 2,
    "n_heads": 4,
    "ffn_hidden": 192,
    "max_seq_len": 64,
}


def _write_run(folder, variant, seed, state, message, rng):
    folder.mkdir(parents=True)
    config = {
        "name": "synthetic",
        "variant": variant,
        "model": PRESET,
        "data": {"corpus": "shakespeare"},
        "train": {"seed": seed, "lr": 3e-3},
        "eval": {"tasks": list(TASKS)},
        "slurm": {"partition": ""},
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "status.json").write_text(
        json.dumps(
            {"state": state, "step": 40 if state == "done" else 20, "message": message, "job_id": "1", "node": "n1"}
        )
    )
    steps = [0, 10, 20, 30, 40] if state == "done" else [0, 10, 20]
    val = 6.0 - 0.05 * np.arange(len(steps)) + rng.uniform(0.0, 0.2)
    lines = ["step,tokens,train_loss,val_loss,val_bpb,lr,grad_norm,tokens_per_s"]
    for i, step in enumerate(steps):
        # Validation only on even rows: blanks where a metric was not measured.
        v = f"{val[i]:.6f}" if i % 2 == 0 else ""
        lines.append(f"{step},{step * 1000},{val[i] + 0.1:.6f},{v},,0.003,{rng.uniform(0.5, 2):.4f},1000")
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    layer_lines = ["step,layer,kind,input_rms,output_rms,grad_norm"]
    for step in (0, steps[-1]):
        for layer in range(N_LAYERS):
            layer_lines.append(
                f"{step},{layer},{'attn' if layer % 2 == 0 else 'mlp'},{rng.uniform(0.5, 2):.5f},"
                f"{rng.uniform(0.1, 1):.5f},{rng.uniform(0.01, 0.1):.5f}"
            )
    (folder / "layers.csv").write_text("\n".join(layer_lines) + "\n")
    if state != "done":
        return None
    final = float(rng.normal(3.3, 0.05))
    summary = {
        "val_loss": final,
        "val_bpb": final / math.log(2),
        "val_ppl": math.exp(final),
        "step": 40,
        "tokens": 40000,
        "params": 100000 + 1000 * len(variant),
        "extra_params": 1000 * len(variant),
        "stream_floats_per_token": 64 * (1 + len(variant) % 3),
        "extra_flops_per_token": 5000,
        "tokens_per_s": float(rng.uniform(900, 1100)),
        "peak_mem_bytes": int(rng.uniform(1e8, 2e8)),
        "peak_mem_method": "cpu",
        "cores_shared": False,
        "train_tokens": 40000,
        "train_steps": 40,
        "wall_s": 12.5,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    matrix = np.tril(rng.uniform(0.1, 1.0, (N_LAYERS + 1, N_LAYERS + 1)))
    (folder / "mixing.json").write_text(
        json.dumps(
            {
                "readers": [f"layer {i}" for i in range(N_LAYERS)] + ["head"],
                "sources": ["embed"] + [f"v{i}" for i in range(N_LAYERS)],
                "groups": 1,
                "matrix": matrix.tolist(),
                "per_group": [matrix.tolist()],
            }
        )
    )
    eval_lines = ["task,metric,value,stderr"]
    for task, metrics in TASKS.items():
        for metric in metrics:
            eval_lines.append(f"{task},{metric},{rng.uniform(0.2, 0.8):.6f},0.01")
    (folder / "eval").mkdir()
    (folder / "eval" / "table.csv").write_text("\n".join(eval_lines) + "\n")
    return summary


@pytest.fixture(scope="module")
def sweep_tree(tmp_path_factory, module_seed):
    """A results tree of known numbers (random, from the module's seed), its bench CSV, and the expected finals."""
    seed = module_seed
    rng = np.random.default_rng(seed)
    root = tmp_path_factory.mktemp(f"results-seed{seed}") / "synthetic"
    finals: dict[str, list[dict]] = {}
    for variant, seeds, state, message in RUNS:
        for s in seeds:
            folder = root / variant.replace("(", "_").replace(")", "").replace("=", "-") / f"run-s{s}"
            summary = _write_run(folder, variant, s, state, message, rng)
            if summary is not None:
                finals.setdefault(split_variant(variant)[0], []).append(
                    {"summary": summary, "eval": pd.read_csv(folder / "eval" / "table.csv")}
                )
    # A running run's metrics.csv with a last line still being appended.
    with open(root / "preln" / "run-s3" / "metrics.csv", "a") as f:
        f.write("30,30000,5.7")
    # A finished run whose summary.json was cut off mid-write: listed, noted, never averaged.
    broken = root / "mhc" / "run-s0"
    _write_run(broken, "mhc", 0, "done", "", rng)
    (broken / "summary.json").write_text('{"val_loss": 3.2, "step"')
    bench = pd.DataFrame(
        [
            {
                "variant": v,
                "depth": d,
                "width": 256,
                "seq_len": 256,
                "step_time_ms": t,
                "ratio_time": t / (10.0 * d),
                "peak_mem_bytes": 1e8 * d,
                "ratio_mem": r,
            }
            for v, r in (("preln", 1.0), ("ldm-rls", 1.3))
            for d in (4, 8, 16)
            for t in [10.0 * d * r]
        ]
    )
    bench.to_csv(root / "bench.csv", index=False)
    out = tmp_path_factory.mktemp("report-out")
    path = report(root, out_dir=out)
    return {"root": root, "out": out, "report": path, "finals": finals, "seed": seed}


def _losses(tree, variant):
    return np.array([f["summary"]["val_loss"] for f in tree["finals"][split_variant(variant)[0]]])


def _row(frame, variant):
    rows = frame[frame["variant"] == split_variant(variant)[0]]
    assert len(rows) == 1, f"expected one row for {variant}"
    return rows.iloc[0]


def _by_seed(tree, variant):
    seeds = next(s for v, s, state, _ in RUNS if v == variant and state == "done")
    return dict(zip(seeds, _losses(tree, variant)))


def test_main_table_differences_are_paired_on_shared_seeds_else_welch_as_scipy_computes(sweep_tree):
    main = pd.read_csv(sweep_tree["out"] / "tables" / "main.csv")
    base = _by_seed(sweep_tree, "preln")
    for variant in ("ldm-rls", "ldm-rls(omega=off)", "ldm-rls(groups=4)"):
        own, row = _by_seed(sweep_tree, variant), _row(main, variant)
        shared = sorted(set(own) & set(base))
        paired = stats.ttest_rel([own[s] for s in shared], [base[s] for s in shared])
        ci = paired.confidence_interval(0.95)
        assert row["delta_method"] == "paired t"
        assert row["delta"] == pytest.approx(np.mean([own[s] - base[s] for s in shared]), rel=1e-12)
        assert row["delta_ci95"] == pytest.approx((ci.high - ci.low) / 2, rel=1e-9)
    x, row = _losses(sweep_tree, "denseformer"), _row(main, "denseformer")
    welch = stats.ttest_ind(x, list(base.values()), equal_var=False).confidence_interval(0.95)
    assert row["delta_method"] == "Welch"
    assert row["delta"] == pytest.approx(x.mean() - np.mean(list(base.values())), rel=1e-12)
    assert row["delta_ci95"] == pytest.approx((welch.high - welch.low) / 2, rel=1e-9)
    text = sweep_tree["report"].read_text()
    assert "(paired t, 3 pairs)" in text and "(Welch, 3 vs 3 runs)" in text
    assert "Every run trained on 40.00K tokens." in text


def test_main_table_means_and_cis_match_scipy(sweep_tree):
    main = pd.read_csv(sweep_tree["out"] / "tables" / "main.csv")
    for variant in ("preln", "ldm-rls", "ldm-rls(omega=off)", "ldm-rls(groups=4)"):
        x, row = _losses(sweep_tree, variant), _row(main, variant)
        lo, hi = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
        assert row["seeds"] == len(x)
        assert row["val_loss"] == pytest.approx(x.mean(), rel=1e-12)
        assert row["val_loss_ci95"] == pytest.approx((hi - lo) / 2, rel=1e-9)
        ppl = np.exp(x)
        plo, phi = stats.t.interval(0.95, len(x) - 1, loc=ppl.mean(), scale=stats.sem(ppl))
        assert row["val_ppl"] == pytest.approx(ppl.mean(), rel=1e-12)
        assert row["val_ppl_ci95"] == pytest.approx((phi - plo) / 2, rel=1e-9)
    one_seed = _row(main, "attnres")
    assert one_seed["seeds"] == 1 and math.isnan(one_seed["val_loss_ci95"]) and math.isnan(one_seed["delta_ci95"])
    text = sweep_tree["report"].read_text()
    # One seed: the cell holds the mean alone, and a note under the table says why, once per table.
    assert f"| {_losses(sweep_tree, 'attnres')[0]:.4f} " in text and "(no CI: one seed)" not in text
    main_section = text.split("## Main comparison")[1].split("\n## ")[0]
    assert main_section.count("No CI: one seed") == 1
    x = _losses(sweep_tree, "ldm-rls")
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    assert f"{x.mean():.4f} ± {half:.4f}" in text


def test_unfinished_runs_are_listed_and_never_averaged(sweep_tree):
    text = sweep_tree["report"].read_text()
    excluded = pd.read_csv(sweep_tree["out"] / "tables" / "excluded_runs.csv")
    states = dict(zip(excluded["variant"], excluded["state"]))
    assert states[split_variant("hc")[0]] == "failed"
    assert states[split_variant("ldm")[0]] == "diverged"
    assert states[split_variant("mhc")[0]] == "done"
    assert "running" in set(excluded["state"])
    for message in (
        "CUDA out of memory at step 12",
        "non-finite loss at step 30",
        "finished without a readable final validation loss",
    ):
        assert message in text
    assert "mhc/run-s0/summary.json" in text  # the unreadable file is named
    main = pd.read_csv(sweep_tree["out"] / "tables" / "main.csv")
    assert _row(main, "preln")["seeds"] == 3  # the running fourth seed is not averaged in
    assert _row(main, "hc")["seeds"] == 0 and "no finished run" in text


def test_ablation_table_is_against_the_rows_own_base(sweep_tree):
    abl = pd.read_csv(sweep_tree["out"] / "tables" / "ablations.csv")
    ref = _by_seed(sweep_tree, "ldm-rls")
    assert abl.iloc[0]["variant"] == split_variant("ldm-rls")[0]
    # ldm at its defaults has no knob setting here, so it heads no block of its own
    assert list(abl["variant"]) == [split_variant(v)[0] for v in ("ldm-rls", "ldm-rls(groups=4)", "ldm-rls(omega=off)")]
    assert set(abl["reference"]) == {"ldm-rls"}
    for variant in ("ldm-rls(groups=4)", "ldm-rls(omega=off)"):
        own, row = _by_seed(sweep_tree, variant), _row(abl, variant)
        shared = sorted(set(own) & set(ref))
        ci = stats.ttest_rel([own[s] for s in shared], [ref[s] for s in shared]).confidence_interval(0.95)
        assert row["delta_method"] == "paired t"
        assert row["delta"] == pytest.approx(np.mean([own[s] - ref[s] for s in shared]), rel=1e-12)
        assert row["delta_ci95"] == pytest.approx((ci.high - ci.low) / 2, rel=1e-9)


def test_downstream_uses_acc_norm_where_reported_and_averages_tasks(sweep_tree):
    down = pd.read_csv(sweep_tree["out"] / "tables" / "downstream.csv")
    for variant in ("preln", "ldm-rls", "attnres"):
        evals = [f["eval"] for f in sweep_tree["finals"][split_variant(variant)[0]]]
        expected = {}
        for task, metric in (("arc_easy", "acc_norm"), ("piqa", "acc_norm"), ("lambada_openai", "acc")):
            expected[task] = np.mean([e[(e.task == task) & (e.metric == metric)]["value"].item() for e in evals])
        row = _row(down, variant)
        for task, value in expected.items():
            assert row[task] == pytest.approx(value, rel=1e-12)
        assert row["average"] == pytest.approx(np.mean(list(expected.values())), rel=1e-12)


def test_cost_table_is_relative_to_preln(sweep_tree):
    cost = pd.read_csv(sweep_tree["out"] / "tables" / "cost.csv")
    summaries = {v: [f["summary"] for f in fs] for v, fs in sweep_tree["finals"].items()}
    base = summaries[split_variant("preln")[0]]
    for variant in ("ldm-rls", "attnres"):
        own, row = summaries[split_variant(variant)[0]], _row(cost, variant)
        for name in ("tokens_per_s", "peak_mem_bytes", "params"):
            mean = np.mean([s[name] for s in own])
            assert row[name] == pytest.approx(mean, rel=1e-12)
            assert row[f"{name}_rel"] == pytest.approx(mean / np.mean([s[name] for s in base]), rel=1e-12)
    bench = pd.read_csv(sweep_tree["out"] / "tables" / "bench.csv")
    assert len(bench) == 6 and list(bench["variant"][:3]) == [split_variant("preln")[0]] * 3


def test_tables_render_markdown_and_booktabs_latex(sweep_tree):
    tables = sweep_tree["out"] / "tables"
    for name in ("main", "downstream", "ablations", "cost", "bench", "excluded_runs"):
        tex = (tables / f"{name}.tex").read_text()
        assert "\\toprule" in tex and "\\midrule" in tex and "\\bottomrule" in tex
        assert "±" not in tex and "×" not in tex
        md = (tables / f"{name}.md").read_text()
        assert md.splitlines()[1].startswith("|:") and md in sweep_tree["report"].read_text() + "\n"
    assert "$\\pm$" in (tables / "main.tex").read_text()


def test_aggregate_is_one_tidy_row_per_run_step_metric(sweep_tree):
    tidy = aggregate(sweep_tree["root"])
    assert {
        "run_id",
        "variant",
        "base",
        "knobs",
        "knob_groups",
        "knob_omega",
        "preset",
        "seed",
        "state",
        "step",
        "tokens",
        "metric",
        "value",
        "stderr",
    } <= set(tidy.columns)
    assert not tidy.duplicated(["run_dir", "source", "task", "step", "metric"]).any()
    groups4 = tidy[tidy["variant"] == split_variant("ldm-rls(groups=4)")[0]]
    assert set(groups4["base"]) == {"ldm-rls"} and set(groups4["knob_groups"]) == {4}
    assert str(tidy["knob_groups"].dtype) == "Int64" and set(tidy["knob_omega"]) - {""} == {"on", "off"}
    done = tidy[tidy["state"] == "done"]
    assert str(tidy["train_tokens"].dtype) == "Int64" and set(done["train_tokens"].dropna()) == {40000}
    assert set(groups4["knobs"]) == {"groups=4"} and set(groups4["preset"]) == {"tiny"}
    # val_loss is blank on odd rows of metrics.csv: 3 of 5 steps for a finished run.
    curve = groups4[(groups4["source"] == "train") & (groups4["metric"] == "val_loss") & (groups4["seed"] == 0)]
    assert list(curve["step"]) == [0, 20, 40] and list(curve["tokens"]) == [0, 20000, 40000]
    finals = groups4[(groups4["source"] == "final") & (groups4["metric"] == "val_loss")]
    assert sorted(finals["value"]) == sorted(_losses(sweep_tree, "ldm-rls(groups=4)"))
    evals = groups4[groups4["source"] == "eval"]
    assert len(evals) == 2 * sum(len(m) for m in TASKS.values()) and evals["stderr"].eq(0.01).all()
    saved = pd.read_parquet(sweep_tree["out"] / "aggregate.parquet")
    pd.testing.assert_frame_equal(saved, tidy)
    assert len(pd.read_csv(sweep_tree["out"] / "aggregate.csv")) == len(tidy)


# Figures this tree has no data for (no numeric axis, no sizes, no depth memory): tests/test_figures.py draws them.
NOT_HERE = {"hyperparameters", "depth", "frontier", "lambda", "lambda_seeds", "omega"}


def test_every_figure_is_written_with_its_panels(sweep_tree):
    out, text = sweep_tree["out"], sweep_tree["report"].read_text()
    for name in set(figs.FIGURES) - NOT_HERE:
        for ext in ("png", "pdf"):
            assert (out / "figures" / f"{name}.{ext}").stat().st_size > 1000
        assert f"](figures/{name}.png)" in text
    for name in NOT_HERE:
        assert f"- figure `{name}`: " in text and not (out / "figures" / f"{name}.png").exists()
    sweep = load_sweep(sweep_tree["root"])
    colours = figs.palette(r.variant for r in sweep.runs)
    ctx = Context(sweep, colours=colours)
    with_mixing = {r.variant for r in sweep.finished()}
    fig, _ = figs.mixing_matrices(ctx)
    assert sorted(ax.get_title() for ax in fig.axes if ax.get_title()) == sorted(with_mixing)
    # One colour scale: every heatmap's colour limits are the same.
    limits = {
        tuple(round(v, 12) for v in coll.get_clim())
        for ax in fig.axes
        for coll in ax.collections
        if coll.get_array() is not None and None not in coll.get_clim()
    }
    assert len(limits) == 1 and len([ax for ax in fig.axes if ax.get_title()]) == len(with_mixing)
    fig, _ = figs.ablation_grid(ctx)
    assert len([ax for ax in fig.axes if ax.get_title().startswith("ω")]) == 2  # omega on (default) and off
    fig, _ = figs.layer_profiles(ctx)
    assert len(fig.axes) == 2
    fig, _ = figs.loss_curves(ctx)
    line_colours = {line.get_color() for line in fig.axes[0].get_lines()}
    assert {colours[v] for v in with_mixing} <= line_colours  # each variant in its fixed colour


def test_report_twice_gives_identical_files(sweep_tree, tmp_path):
    # Every table and the data files; two figures stand for all (drawing all of them again only costs time).
    again = report(sweep_tree["root"], out_dir=tmp_path, spec={"figures": ["mixing", "loss_curves"]})
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and p != again)
    assert len(written) == 6 * 3 + 4 + 4
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (sweep_tree["out"] / rel).read_bytes(), rel


def test_figures_without_data_are_skipped_with_a_reason(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    for s in (0, 1):
        run = tmp_path / "sweep" / f"preln-s{s}"
        _write_run(run, "preln", s, "done", "", rng)
        for name in ("mixing.json", "layers.csv"):
            (run / name).unlink()
        (run / "eval" / "table.csv").unlink()
    path = report(tmp_path / "sweep")
    text = path.read_text()
    assert "figure `mixing`: no finished run has a mixing.json" in text
    assert "figure `layers`: no finished run has a layers.csv" in text
    assert "figure `overhead`: no benchmark CSV" in text
    assert "table `ablations`: no run of ldm or ldm-rls" in text
    assert (tmp_path / "sweep" / "figures" / "loss_curves.png").exists()
    assert not (tmp_path / "sweep" / "figures" / "mixing.png").exists()


def test_grid_file_report_section_selects_outputs(tmp_path, rng_seed, monkeypatch):
    rng = np.random.default_rng(rng_seed)
    _write_run(tmp_path / "results" / "paper" / "preln-s0", "preln", 0, "done", "", rng)
    grid = tmp_path / "paper.yaml"
    grid.write_text("name: paper\nreport:\n  tables: [main]\n  figures: [final_loss]\n  title: Depth memory\n")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["report", str(grid)]) == 0
    text = (tmp_path / "results" / "paper" / "REPORT.md").read_text()
    assert text.startswith("# Depth memory") and "cost" not in text.lower().split("## data")[0]
    assert sorted(p.name for p in (tmp_path / "results" / "paper" / "figures").iterdir()) == [
        "final_loss.pdf",
        "final_loss.png",
    ]
    folder, spec = resolve_target("paper")
    assert folder.resolve() == tmp_path / "results" / "paper" and spec == report_spec(None)


def test_bad_input_is_one_sentence_naming_allowed_values(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["report", "no-such-sweep"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("depthmem: No sweep 'no-such-sweep'") and "\n" not in err
    with pytest.raises(UsageError, match="Allowed: main, downstream, downstream_paired, matched, ablations, cost, "):
        report_spec({"tables": ["mian"]})
    with pytest.raises(UsageError, match="Allowed keys"):
        report_spec({"figure": ["mixing"]})
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="No run directories"):
        report(tmp_path / "empty")
    with pytest.raises(UsageError, match="benchmark CSV"):
        report(tmp_path / "empty", bench=tmp_path / "missing.csv")


def _budget_runs(root, runs, rng):
    """Finished runs of (variant, tokens in the summary, train.tokens in the config or None), seeds 0 and 1."""
    for variant, tokens, configured in runs:
        for seed in (0, 1):
            folder = root / f"{variant}-{tokens}-{configured}" / f"s{seed}"
            summary = _write_run(folder, variant, seed, "done", "", rng)
            summary.update(train_tokens=tokens, train_steps=tokens // 100)
            (folder / "summary.json").write_text(json.dumps(summary))
            if configured is not None:
                config = json.loads((folder / "config.json").read_text())
                config["train"]["tokens"] = configured
                (folder / "config.json").write_text(json.dumps(config))
    return load_sweep(root)


def test_runs_of_different_budgets_are_never_compared(tmp_path, rng_seed):
    from harness.reporting import tables

    rng = np.random.default_rng(rng_seed)
    # One config for all, but ldm-rls trained on more tokens (a budget counted from each run's own parameters).
    sweep = _budget_runs(tmp_path / "s", [("preln", 1000, None), ("ldm-rls", 2000, None), ("ldm", 1000, None)], rng)
    table = tables.main_table(Context(sweep))
    assert math.isnan(_row(table.data, "ldm-rls")["delta"]) and not math.isnan(_row(table.data, "ldm")["delta"])
    shown = table.display.set_index("Variant")
    assert (
        shown.loc["ldm-rls", "Δ loss vs preln (95% CI, method, pairs)"]
        == "— (trained on 2.00K tokens, preln on 1.00K tokens)"
    )
    assert list(shown["Train tokens"]) == ["1.00K", "1.00K", "2.00K"]
    assert any("No Δ for ldm-rls" in n for n in table.notes)
    tidy = aggregate(sweep)  # every row carries its run's budget, typed
    assert str(tidy["train_tokens"].dtype) == "Int64" and "train_tokens" not in set(tidy["metric"])
    assert dict(tidy.groupby("variant")["train_tokens"].unique().map(list)) == {
        split_variant(v)[0]: [t] for v, t in (("preln", 1000), ("ldm-rls", 2000), ("ldm", 1000))
    }
    assert set(tidy["train_steps"]) == {10, 20}


def test_a_budget_varied_on_purpose_is_shown_and_compared_within_each_budget(tmp_path, rng_seed):
    from harness.reporting import tables

    rng = np.random.default_rng(rng_seed)
    sweep = _budget_runs(
        tmp_path / "s",
        [("preln", 1000, 1000), ("ldm-rls", 1000, 1000), ("preln", 3000, 3000), ("ldm-rls", 3000, 3000)],
        rng,
    )
    table = tables.main_table(Context(sweep))
    assert list(table.display["Train tokens"]) == ["1.00K", "1.00K", "3.00K", "3.00K"]
    # The budget is a grid axis: a typed column of its own (named apart from the budget columns).
    assert list(table.display["axis_train_tokens"]) == ["1000", "1000", "3000", "3000"]
    assert list(table.data["axis_train_tokens"]) == [1000, 1000, 3000, 3000]
    assert table.data["delta"].notna().all() and set(table.data["delta_method"]) == {"", "paired t"}
    assert any("training budget differs between rows" in n for n in table.notes)


def _holm_by_definition(pvalues: list[float], alpha_grid) -> list[float]:
    """Holm's adjusted p-values from the step-down procedure itself: the smallest level at which it rejects."""
    m = len(pvalues)
    adjusted = [1.0] * m
    for alpha in sorted(alpha_grid, reverse=True):
        order = sorted(range(m), key=lambda i: pvalues[i])
        for j, i in enumerate(order):
            if pvalues[i] > alpha / (m - j):
                break
            adjusted[i] = min(adjusted[i], alpha)
    return adjusted


def test_main_table_p_values_are_scipys_holm_adjusted_within_the_table(sweep_tree):
    main = pd.read_csv(sweep_tree["out"] / "tables" / "main.csv")
    base = _by_seed(sweep_tree, "preln")
    raw = {}
    for variant in ("ldm-rls", "ldm-rls(omega=off)", "ldm-rls(groups=4)"):
        own = _by_seed(sweep_tree, variant)
        shared = sorted(set(own) & set(base))
        raw[variant] = stats.ttest_rel([own[s] for s in shared], [base[s] for s in shared]).pvalue
    raw["denseformer"] = stats.ttest_ind(
        _losses(sweep_tree, "denseformer"), list(base.values()), equal_var=False
    ).pvalue
    for variant, p in raw.items():
        assert _row(main, variant)["delta_p"] == pytest.approx(p, rel=1e-9)
    names = list(raw)
    candidates = [p * k for p in raw.values() for k in range(1, len(raw) + 1)] + [1.0]
    expected = dict(zip(names, _holm_by_definition([raw[n] for n in names], candidates)))
    for variant in names:
        assert _row(main, variant)["delta_p_holm"] == pytest.approx(min(1.0, expected[variant]), rel=1e-9)
    # One-seed rows and the reference have no test, and so no place in the family.
    assert math.isnan(_row(main, "attnres")["delta_p_holm"]) and math.isnan(_row(main, "preln")["delta_p_holm"])
    assert f"adjusted over the {len(raw)} differences of this table" in sweep_tree["report"].read_text()


def test_failed_and_diverged_runs_are_counted_per_variant(sweep_tree):
    main = pd.read_csv(sweep_tree["out"] / "tables" / "main.csv")
    assert (_row(main, "ldm")["diverged"], _row(main, "ldm")["failed"]) == (1, 0)
    assert (_row(main, "hc")["diverged"], _row(main, "hc")["failed"]) == (0, 1)
    assert _row(main, "preln")[["diverged", "failed"]].sum() == 0  # a running run is no failure
    section = sweep_tree["report"].read_text().split("## Main comparison")[1].split("\n## ")[0]
    assert "| 1 diverged " in section and "| 1 failed " in section


def _small_sweep(root, rows, rng):
    """Finished runs of (variant, seed, final loss or NaN, {task: (accuracy, stderr)})."""
    for variant, seed, loss, scores in rows:
        folder = root / variant / f"s{seed}"
        summary = _write_run(folder, variant, seed, "done", "", rng)
        summary["val_loss"] = loss
        (folder / "summary.json").write_text(json.dumps(summary))
        lines = ["task,metric,value,stderr"] + [f"{t},acc,{v},{e}" for t, (v, e) in scores.items()]
        (folder / "eval" / "table.csv").write_text("\n".join(lines) + "\n")
    return load_sweep(root)


def test_partial_seed_overlap_shows_the_pairs_and_is_flagged(tmp_path, rng_seed):
    from harness.reporting import tables

    rng = np.random.default_rng(rng_seed)
    losses = {("preln", s): 3.0 + 0.1 * s + rng.normal(0, 0.01) for s in (0, 1, 5)}
    losses |= {("ldm-rls", s): 2.9 + 0.1 * s + rng.normal(0, 0.01) for s in (0, 1, 2)}
    sweep = _small_sweep(tmp_path / "s", [(v, s, x, {}) for (v, s), x in losses.items()], rng)
    table = tables.main_table(Context(sweep))
    row = _row(table.data, "ldm-rls")
    assert row["seeds"] == 3 and row["delta_pairs"] == 2 and row["delta_partial_seeds"]
    d = [losses[("ldm-rls", s)] - losses[("preln", s)] for s in (0, 1)]
    assert row["delta"] == pytest.approx(np.mean(d), rel=1e-12)
    assert row["delta_p"] == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue, rel=1e-9)
    cell = table.display.set_index("Variant").loc["ldm-rls", "Δ loss vs preln (95% CI, method, pairs)"]
    assert cell.endswith("(paired t, 2 pairs; seeds differ)")
    assert any(n.startswith("Seeds differ for ldm-rls") for n in table.notes)


def test_a_non_finite_final_loss_is_a_divergence_of_its_variant(tmp_path, rng_seed):
    from harness.reporting import tables

    rng = np.random.default_rng(rng_seed)
    rows = [("preln", s, 3.0 + 0.01 * s, {}) for s in (0, 1)]
    rows += [("ldm-rls", 0, 2.9, {}), ("ldm-rls", 1, float("nan"), {})]
    sweep = _small_sweep(tmp_path / "s", rows, rng)
    table = tables.main_table(Context(sweep))
    row = _row(table.data, "ldm-rls")
    assert row["seeds"] == 1 and row["diverged"] == 1
    assert table.display.set_index("Variant").loc["ldm-rls", "Failed runs"] == "1 diverged"
    listed = tables.runs_table(Context(sweep)).display
    assert list(listed["Message"]) == ["finished with a non-finite final validation loss (diverged)"]


def test_downstream_intervals_keep_the_item_error_and_show_chance(tmp_path, rng_seed):
    from harness.reporting import tables

    rng = np.random.default_rng(rng_seed)
    # Two seeds that answer 20 documents alike: no seed spread, but each run's item error is 0.105.
    rows = [("preln", s, 3.0 + 0.01 * s, {"offline_copa": (0.75, 0.105), "piqa": (0.6, 0.05)}) for s in (0, 1)]
    piqa = rng.uniform(0.5, 0.7, 3)
    rows += [("ldm-rls", s, 2.9, {"offline_copa": (0.5, 0.1), "piqa": (piqa[s], 0.05)}) for s in (0, 1, 2)]
    table = tables.downstream_table(Context(_small_sweep(tmp_path / "s", rows, rng)))
    z = stats.norm.ppf(0.975)
    preln, ldm = _row(table.data, "preln"), _row(table.data, "ldm-rls")
    assert preln["offline_copa_ci95"] == pytest.approx(z * 0.105, rel=1e-12)
    assert table.display.set_index("Variant").loc["preln", "offline_copa"] == "75.0 ± 20.6"
    seeds = (stats.t.interval(0.95, 2, loc=piqa.mean(), scale=stats.sem(piqa))[1] - piqa.mean()) ** 2
    assert ldm["piqa_ci95"] == pytest.approx(math.sqrt(seeds + (z * 0.05) ** 2), rel=1e-9)
    # The average's item error: the two tasks' errors in quadrature, over two tasks.
    assert preln["average_ci95"] == pytest.approx(z * math.hypot(0.105, 0.05) / 2, rel=1e-9)
    chance = table.display.set_index("Variant").loc["chance"]
    assert (chance["offline_copa"], chance["piqa"], chance["Average"]) == ("50.0", "50.0", "50.0")
    assert any("guessing uniformly" in n for n in table.notes)


def test_a_last_line_cut_short_in_metrics_is_dropped_with_a_note(tmp_path, rng_seed):
    folder = tmp_path / "sweep" / "preln" / "run-s0"
    _write_run(folder, "preln", 0, "done", "", np.random.default_rng(rng_seed))
    whole = (folder / "metrics.csv").read_bytes()
    # Half of one more row: its step and a tokens_per_s of 15 that no step logged.
    (folder / "metrics.csv").write_bytes(whole + b"50,50000,3.1,,,0.003,1.0,15")
    sweep = load_sweep(tmp_path / "sweep")
    (run,) = sweep.runs
    assert list(run.metrics["step"]) == [0, 10, 20, 30, 40] and 15 not in set(run.metrics["tokens_per_s"])
    assert any("Dropped the last line of preln/run-s0/metrics.csv: it was cut short." == n for n in sweep.notes)


def test_a_result_file_that_changed_after_saving_is_named_and_left_out(tmp_path, rng_seed):
    from harness.io import atomic_write_checked, json_bytes

    rng = np.random.default_rng(rng_seed)
    for seed in (0, 1):
        folder = tmp_path / "sweep" / "preln" / f"run-s{seed}"
        _write_run(folder, "preln", seed, "done", "", rng)
        summary = json.loads((folder / "summary.json").read_text())
        atomic_write_checked(folder / "summary.json", json_bytes(summary))  # as training writes it
    assert len(load_sweep(tmp_path / "sweep").finished()) == 2
    # one digit of the final loss overwritten in place, the file still valid JSON
    damaged = tmp_path / "sweep" / "preln" / "run-s1" / "summary.json"
    text = damaged.read_text()
    digit = text.index('"val_loss": ') + len('"val_loss": ')
    damaged.write_text(text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1 :])
    sweep = load_sweep(tmp_path / "sweep")
    assert [r.run_id for r in sweep.finished()] == ["run-s0"]
    assert (
        "Left out preln/run-s1/summary.json: it does not match the checksum written when it was saved "
        "(summary.json.sha256), so its bytes changed on disk after saving." in sweep.notes
    )


def test_a_key_an_older_run_lacks_counts_as_its_default(tmp_path, rng_seed):
    """A run written before a config key existed and one that holds the key's default are the same setting; one
    that sets another value is not."""
    rng = np.random.default_rng(rng_seed)
    for seed in (0, 1, 2):
        _write_run(tmp_path / "sweep" / f"run-s{seed}", "preln", seed, "done", "", rng)
    for seed, value in ((1, False), (2, True)):
        path = tmp_path / "sweep" / f"run-s{seed}" / "config.json"
        config = json.loads(path.read_text())
        config["train"]["activation_checkpointing"] = value
        path.write_text(json.dumps(config))
    runs = {r.run_id: r.setting for r in load_sweep(tmp_path / "sweep").runs}
    assert runs["run-s0"] == runs["run-s1"]
    assert runs["run-s0"] != runs["run-s2"] and "activation_checkpointing" in runs["run-s2"]
