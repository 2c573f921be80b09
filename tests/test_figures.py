"""The paper figures and their numbers on synthetic run directories of known laws: frontier, depth, λ/ω, ablations."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from harness.measure import CoreLoad, live_training_bytes
from harness.reporting import figures as figs
from harness.reporting import frontier as fr
from harness.reporting import items as report_items
from harness.reporting import tables
from harness.reporting.items import Context, NoData
from harness.reporting.report import report
from harness.reporting.results import aggregate, load_sweep, split_variant

pytestmark = pytest.mark.xdist_group("report")

A, B = 40.0, 0.08  # the baseline's law, L = A · C^(-B)
MULTIPLIER = 1.5  # ldm-rls reaches at C the loss the baseline reaches at 1.5 C
SEEDS = (0, 1, 2)
VOCAB, SEQ = 512, 64
TOKENS_PER_PARAM = 20.0
EXTRA_FLOPS = {"preln": 0, "ldm-rls": 9000, "ldm": 7000}
WIDTHS = (32, 48, 64, 96)
DEPTHS = (1, 2, 4)
ABLATIONS = (
    "ldm",
    "ldm-rls(groups=4)",
    "ldm-rls(omega=off)",
    "ldm-rls(lambda=1.0)",
    "ldm-rls(read=memory)",
    "ldm-rls(qk_source=read)",
    "ldm-rls(key_dim=8)",
    "ldm-rls(residual_write=off)",
    "ldm-rls(groups=4,omega=off)",
)
GROUPS = 4


def _model(d: int, n_blocks: int) -> dict:
    return {
        "preset": "tiny",
        "vocab_size": VOCAB,
        "d_model": d,
        "n_blocks": n_blocks,
        "n_heads": 4,
        "ffn_hidden": 3 * d,
        "max_seq_len": SEQ,
    }


def _params(m: dict) -> int:
    d, f, n = m["d_model"], m["ffn_hidden"], m["n_blocks"]
    return VOCAB * d + n * (4 * d * d + 3 * d * f + 2 * d) + d


def _train_flops(m: dict, variant: str, tokens: int) -> float:
    """Counted by hand: 2 FLOPs per multiply-add of every matmul, attention over the full context, × 3 for training."""
    d, f, n = m["d_model"], m["ffn_hidden"], m["n_blocks"]
    forward = 2 * (n * (4 * d * d + 3 * d * f) + d * VOCAB) + n * 4 * SEQ * d + EXTRA_FLOPS[split_variant(variant)[1]]
    return 3.0 * forward * tokens


def _loss(variant: str, flops: float, seed_noise: float) -> float:
    effective = flops * (MULTIPLIER if split_variant(variant)[1] != "preln" else 1.0)
    return A * effective ** (-B) * math.exp(seed_noise)


def write_run(
    folder: Path,
    variant: str,
    seed: int,
    model: dict,
    rng,
    *,
    noise: float,
    lr: float = 3e-3,
    eval_stderr: float = 0.05,
) -> dict:
    folder.mkdir(parents=True)
    params = _params(model)
    tokens = int(TOKENS_PER_PARAM * params)
    # As a sweep writes it: the budget per parameter resolved into tokens, one count per model size.
    config = {
        "name": "study",
        "variant": variant,
        "model": model,
        "data": {"corpus": "shakespeare"},
        "train": {"seed": seed, "lr": lr, "max_steps": 0, "tokens": tokens, "tokens_per_param": TOKENS_PER_PARAM},
        "eval": {},
        "slurm": {},
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "status.json").write_text(json.dumps({"state": "done", "step": 10, "message": "done"}))
    flops = _train_flops(model, variant, tokens)
    loss = _loss(variant, flops, noise)
    summary = {
        "val_loss": loss,
        "val_ppl": math.exp(loss),
        "step": 10,
        "tokens": tokens,
        "train_tokens": tokens,
        "train_steps": 10,
        "params": params,
        "extra_params": 0,
        "extra_flops_per_token": EXTRA_FLOPS[split_variant(variant)[1]],
        "tokens_per_s": 1000.0,
        "peak_mem_bytes": 1e8,
        "peak_mem_method": "cpu",
        "cores_shared": False,
    }
    n_layers = 2 * model["n_blocks"]
    if split_variant(variant)[1] == "ldm-rls":
        summary["depth_memory"] = {
            "lambda": rng.uniform(0.5, 1.0, (n_layers, GROUPS)).tolist(),
            "omega": [
                {"mean": m, "std": s, "min": m - 2 * s, "max": m + 2 * s}
                for m, s in zip(rng.uniform(0.5, 2.0, n_layers), rng.uniform(0.05, 0.2, n_layers))
            ],
        }
        per_group = [np.tril(rng.uniform(0.0, 1.0, (n_layers + 1, n_layers + 1))) for _ in range(GROUPS)]
        (folder / "mixing.json").write_text(
            json.dumps(
                {
                    "readers": [f"layer {i}" for i in range(n_layers)] + ["head"],
                    "sources": ["embedding"] + [f"v{i}" for i in range(n_layers)],
                    "groups": GROUPS,
                    "matrix": np.mean(per_group, axis=0).tolist(),
                    "per_group": [g.tolist() for g in per_group],
                }
            )
        )
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.csv").write_text(f"step,tokens,val_loss\n0,0,6.0\n10,{tokens},{loss}\n")
    (folder / "layers.csv").write_text(
        "step,layer,output_rms,grad_norm\n"
        + "".join(f"10,{i},{rng.uniform(0.5, 2):.5f},{rng.uniform(0.01, 0.1):.5f}\n" for i in range(n_layers))
    )
    (folder / "eval").mkdir()
    correct = rng.binomial(1, rng.uniform(0.4, 0.7), 40)
    (folder / "eval" / "table.csv").write_text(
        f"task,metric,value,stderr\ncopa,acc,{correct.mean():.6f},{eval_stderr}\n"
    )
    pd.DataFrame({"task": "copa", "doc_id": range(40), "metric": "acc", "value": correct}).to_csv(
        folder / "eval" / "items.csv.gz", index=False
    )
    return summary


def _dirname(variant: str, model: dict, seed: int) -> str:
    name = re.sub(r"[^A-Za-z0-9]+", "-", variant).strip("-")
    return f"{name}-d{model['d_model']}-n{model['n_blocks']}-s{seed}"


@pytest.fixture(scope="module")
def study(tmp_path_factory, module_seed):
    """A study like the reference one: widths and depths of preln and ldm-rls, ablations at the main size."""
    seed = module_seed
    rng = np.random.default_rng(seed)
    root = tmp_path_factory.mktemp(f"study-seed{seed}") / "study"
    noise = {s: rng.normal(0.0, 0.002) for s in SEEDS}  # per seed, shared by every variant (same data order)
    runs = []
    for variant in ("preln", "ldm-rls"):
        shapes = [(d, 2) for d in WIDTHS] + [(64, n) for n in DEPTHS if n != 2]
        for d, n in shapes:
            for s in SEEDS:
                runs.append((variant, _model(d, n), s))
    for variant in ABLATIONS:
        for s in SEEDS:
            runs.append((variant, _model(64, 2), s))
    summaries = {}
    for variant, model, s in runs:
        own = noise[s] + rng.normal(0.0, 0.001)
        summaries[(split_variant(variant)[0], model["d_model"], model["n_blocks"], s)] = write_run(
            root / _dirname(variant, model, s), variant, s, model, rng, noise=own
        )
    return {"root": root, "sweep": load_sweep(root), "summaries": summaries, "seed": seed}


def _ctx(study, **kw) -> Context:
    sweep = study["sweep"]
    return Context(sweep, colours=figs.palette(r.variant for r in sweep.runs), **kw)


def test_frontier_fit_recovers_a_known_power_law_and_multiplier(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    for variant in ("preln", "ldm-rls"):
        for d in WIDTHS:
            for s in SEEDS:
                model = _model(d, 2)
                write_run(tmp_path / _dirname(variant, model, s), variant, s, model, rng, noise=0.0)
    result = fr.from_sweep(load_sweep(tmp_path), "preln", resamples=50)
    fits = result.fits.set_index("variant")
    # Noise-free losses: the fit and the multiplier are exact up to rounding.
    assert fits.loc["preln", "a"] == pytest.approx(A, rel=1e-8)
    assert fits.loc["preln", "b"] == pytest.approx(B, rel=1e-8)
    assert fits.loc["ldm-rls", "b"] == pytest.approx(B, rel=1e-8)
    assert fits.loc["ldm-rls", "a"] == pytest.approx(A * MULTIPLIER ** (-B), rel=1e-8)
    rows = result.multipliers
    assert len(rows) == len(WIDTHS) + 1 and set(rows["variant"]) == {"ldm-rls"}  # each size and their mean
    assert np.allclose(rows["multiplier"], MULTIPLIER, rtol=1e-8)
    # Identical seeds: every resample gives the same multiplier, so the interval closes on it.
    assert np.allclose(rows["low"], MULTIPLIER, rtol=1e-8) and np.allclose(rows["high"], MULTIPLIER, rtol=1e-8)
    points = result.points.sort_values(["variant", "params"])
    hand = [
        _train_flops(_model(d, 2), v, int(TOKENS_PER_PARAM * _params(_model(d, 2))))
        for v in ("ldm-rls", "preln")
        for d in WIDTHS
        for _ in SEEDS
    ]
    assert np.allclose(points["flops"], hand, rtol=1e-12)


def test_compute_multiplier_interval_with_few_seeds_comes_from_the_fit(study):
    result = fr.from_sweep(study["sweep"], "preln", resamples=400)
    rows = result.multipliers
    overall = rows[rows["params"].isna()].set_index("variant").loc["ldm-rls"]
    # Noise of 0.2% in the loss moves the multiplier by about 0.002 / B = 2.5% in log space.
    assert overall["multiplier"] == pytest.approx(MULTIPLIER, rel=0.1)
    assert overall["low"] < overall["multiplier"] < overall["high"]
    assert overall["seeds"] == len(SEEDS) < fr.MIN_BOOTSTRAP_SEEDS
    assert set(rows["interval"]) == {"fit"}
    # The interval against an independent computation: scipy's regression standard errors, a numerical
    # gradient, and each cell's seed variance.
    pts = result.points
    ref = pts[pts["variant"] == "preln"].groupby("size").agg(c=("flops", "mean"), l=("loss", "mean"))
    x, y = np.log(ref["c"].to_numpy()), np.log(ref["l"].to_numpy())
    fit = stats.linregress(x, y)
    cov = np.array(
        [
            [fit.intercept_stderr**2, -x.mean() * fit.stderr**2],
            [-x.mean() * fit.stderr**2, fit.stderr**2],
        ]
    )
    mine = pts[pts["variant"] == "ldm-rls"].groupby("size")["loss"]
    yv, xv = (
        np.log(mine.mean().to_numpy()),
        np.log(pts[pts["variant"] == "ldm-rls"].groupby("size")["flops"].mean().to_numpy()),
    )

    def log_multiplier(b0, b1):
        return np.mean((yv - b0) / b1 - xv)

    h = 1e-6
    grad = np.array(
        [
            (log_multiplier(fit.intercept + h, fit.slope) - log_multiplier(fit.intercept - h, fit.slope)) / (2 * h),
            (log_multiplier(fit.intercept, fit.slope + h) - log_multiplier(fit.intercept, fit.slope - h)) / (2 * h),
        ]
    )
    var_y = np.sum(mine.var(ddof=1).to_numpy() / mine.count().to_numpy() / mine.mean().to_numpy() ** 2)
    var = grad @ cov @ grad + var_y / (fit.slope**2 * len(yv) ** 2)
    half = stats.t.ppf(0.975, len(x) - 2) * math.sqrt(var)
    centre = log_multiplier(fit.intercept, fit.slope)
    assert (math.log(overall["low"]), math.log(overall["high"])) == pytest.approx(
        (centre - half, centre + half), rel=1e-6
    )
    # The point estimate against an independent computation: numpy's fit of the baseline means, inverted.
    pts = result.points
    ref = pts[pts["variant"] == "preln"].groupby("size").agg(c=("flops", "mean"), l=("loss", "mean"))
    slope, intercept = np.polyfit(np.log(ref["c"]), np.log(ref["l"]), 1)
    mine = pts[pts["variant"] == "ldm-rls"].groupby("size").agg(c=("flops", "mean"), l=("loss", "mean"))
    need = np.exp((np.log(mine["l"]) - intercept) / slope)
    assert overall["multiplier"] == pytest.approx(math.exp(np.mean(np.log(need / mine["c"]))), rel=1e-9)
    table = Context(study["sweep"]).table("compute_multiplier")
    assert "× [" in table.display["Compute multiplier (95% CI)"].iloc[-1]
    assert table.display["Interval"].iloc[-1] == "fit" and any(n.startswith("Interval fit") for n in table.notes)


def test_compute_multiplier_bootstraps_only_with_five_seeds(rng_seed):
    rng = np.random.default_rng(rng_seed)
    rows = []
    for seeds in ((0, 1, 2, 3, 4), (0, 1, 2, 3), (0,)):
        for variant, factor in (("preln", 1.0), ("ldm-rls", MULTIPLIER)):
            for size, flops in enumerate((1e12, 4e12, 1.6e13)):
                for s in seeds:
                    loss = A * (factor * flops) ** (-B) * math.exp(rng.normal(0, 0.002))
                    rows.append(
                        {
                            "variant": variant,
                            "size": str(size),
                            "setting": "",
                            "params": 1e6 * (size + 1),
                            "flops": flops,
                            "seed": s,
                            "loss": loss,
                            "tokens_per_param": 20.0,
                        }
                    )
        result = fr.analyse(pd.DataFrame(rows), "preln", resamples=300)
        expected = "bootstrap" if len(seeds) >= fr.MIN_BOOTSTRAP_SEEDS else "fit" if len(seeds) > 1 else "fit, one seed"
        assert set(result.multipliers["interval"]) == {expected}
        assert (result.multipliers["low"] < result.multipliers["high"]).all()
        rows = []


def test_frontier_figure_is_log_log_with_one_fit_per_variant(study):
    fig, caption = figs.frontier(_ctx(study))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert len(ax.get_lines()) == 2  # one fitted law per variant
    assert "tokens per parameter" in caption


def test_depth_figure_draws_loss_against_layers_with_intervals(study):
    fig, caption = figs.depth(_ctx(study))
    ax = fig.axes[0]
    lines = {c.get_label(): c.lines[0] for c in ax.containers}  # one error-bar line per variant
    assert set(lines) == {"preln", "ldm-rls"}
    for variant, line in lines.items():
        assert list(line.get_xdata()) == [2 * n for n in DEPTHS]
        expected = [np.mean([study["summaries"][(variant, 64, n, s)]["val_loss"] for s in SEEDS]) for n in DEPTHS]
        assert np.allclose(line.get_ydata(), expected, rtol=1e-12)
    assert "d_model=64" in caption  # the width held fixed is named; the token budget follows each size
    assert "axis_train_tokens" in study["sweep"].axis_keys and "train_tokens" not in caption
    assert figs.numeric_axes(study["sweep"]) == ["d_model", "n_blocks"]


def test_hyperparameter_axes_are_typed_columns_and_numeric_x(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    lrs = (1e-3, 3e-3, 1e-2)
    for variant in ("preln", "ldm-rls"):
        for lr in lrs:
            for s in (0, 1):
                write_run(
                    tmp_path / f"{variant}-lr{lr}-s{s}",
                    variant,
                    s,
                    _model(64, 2),
                    rng,
                    noise=rng.normal(0, 0.01),
                    lr=lr,
                )
    sweep = load_sweep(tmp_path)
    tidy = aggregate(sweep)
    assert tidy["lr"].dtype == np.float64 and set(tidy["lr"]) == set(lrs)
    main = Context(sweep).table("main")
    assert main.data["lr"].dtype == np.float64 and "lr" in main.display.columns and "Setting" not in main.display
    fig, _ = figs.hyperparameters(Context(sweep, colours=figs.palette(r.variant for r in sweep.runs)))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "lr"
    assert sorted(c.get_label() for c in ax.containers) == ["ldm-rls", "preln"]
    for c in ax.containers:
        assert list(c.lines[0].get_xdata()) == list(lrs)


def test_lambda_and_omega_figures_average_seeds_on_one_scale(study):
    ctx = _ctx(study)
    fig, _ = figs.learned_lambda(ctx)
    panels = {ax.get_title(): ax.images[0] for ax in fig.axes if ax.images}
    # Every ldm-rls setting of the main size has λ; all panels share the limits of all their values.
    assert set(panels) == {split_variant(v)[0] for v in ABLATIONS if v != "ldm"} | {"ldm-rls"}
    assert len({im.get_clim() for im in panels.values()}) == 1
    runs = [
        r
        for r in study["sweep"].finished()
        if r.variant == "ldm-rls" and r.axes["d_model"] == 64 and r.axes["n_blocks"] == 2
    ]
    expected = np.mean([r.summary["depth_memory"]["lambda"] for r in runs], axis=0)
    assert np.allclose(panels["ldm-rls"].get_array(), expected, rtol=1e-12)
    every = np.concatenate([im.get_array().ravel() for im in panels.values()])
    assert panels["ldm-rls"].get_clim() == pytest.approx((every.min(), every.max()))
    fig, _ = figs.omega_profile(ctx)
    line = fig.axes[0].get_lines()[0]
    means = np.mean([[rec["mean"] for rec in r.summary["depth_memory"]["omega"]] for r in runs], axis=0)
    assert np.allclose(line.get_ydata(), means, rtol=1e-12)


def test_lambda_seeds_figure_draws_every_seed_and_how_far_lambda_moved(study):
    fig, caption = figs.lambda_seeds(_ctx(study))
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    runs = sorted(
        (
            r
            for r in study["sweep"].finished()
            if r.variant == "ldm-rls" and r.axes["d_model"] == 64 and r.axes["n_blocks"] == 2
        ),
        key=lambda r: r.seed,
    )
    lines = [line for line in panels["ldm-rls"].get_lines() if line.get_label().startswith("seed")]
    assert [line.get_label() for line in lines] == [f"seed {r.seed}" for r in runs]
    for line, run in zip(lines, runs):
        assert np.allclose(line.get_ydata(), np.mean(run.summary["depth_memory"]["lambda"], axis=1), rtol=1e-12)
    learned = [
        r
        for r in study["sweep"].finished()
        if r.summary.get("depth_memory") and r.axes["d_model"] == 64 and r.axes["n_blocks"] == 2
        if r.knob_values.get("lambda") == "learned"
    ]
    # A fixed λ has nothing to learn and gets no panel.
    assert set(panels) == {r.variant for r in learned} and "ldm-rls(lambda=1.0)" not in panels
    everything = [np.asarray(r.summary["depth_memory"]["lambda"]) for r in learned]
    moved = max(float(np.abs(m - 0.99).max()) for m in everything)
    assert f"The largest distance from it in any run, layer and group: {moved:.3g}." in caption


def test_per_group_mixing_shares_one_colour_scale(study):
    fig, _ = figs.mixing_groups(_ctx(study))
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == GROUPS  # ldm-rls at its defaults; ldm has no mixing.json in this study
    assert len({im.get_clim() for im in images}) == 1


def test_ablations_figure_has_every_axis_with_paired_intervals(study):
    frame, reference, _ = figs.ablation_comparisons(_ctx(study))
    assert reference == "ldm-rls"
    # One axis per knob; residual_write=off also reads its queries and keys from the read (qk_source=read).
    assert set(frame["axis"]) == {
        "write",
        "groups",
        "omega",
        "lambda",
        "read",
        "qk_source",
        "key_dim",
        "residual_write + qk_source",
        "groups + omega",
    }
    ref = {s: study["summaries"][("ldm-rls", 64, 2, s)]["val_loss"] for s in SEEDS}
    for variant in ("ldm-rls(groups=4)", "ldm"):
        row = frame.set_index("variant").loc[split_variant(variant)[0]]
        other = [study["summaries"][(split_variant(variant)[0], 64, 2, s)]["val_loss"] for s in SEEDS]
        test = stats.ttest_rel(other, [ref[s] for s in SEEDS])
        ci = test.confidence_interval(0.95)
        assert row["method"] == "paired t"
        assert (row["low"], row["high"]) == pytest.approx((ci.low, ci.high), rel=1e-9)
    fig, _ = figs.ablations(_ctx(study))
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 9 and titles[-1] == "groups G + importance ω" and "q/k source" in titles
    # The reference follows report.ablation_reference, as the table does.
    frame, reference, _ = figs.ablation_comparisons(_ctx(study, ablation_reference="ldm-rls(groups=4)"))
    assert reference == "ldm-rls(groups=4)"
    assert frame.set_index("variant").loc["ldm-rls", "value"] == "16"


def test_palette_is_fixed_by_registry_order():
    alone = figs.palette(["preln", "mhc"])
    many = figs.palette(["preln", "ldm", "ldm-rls", "ldm-rls(groups=4)", "attnres", "hc"])
    assert alone["preln"] == many["preln"] == "#1f77b4" and alone["mhc"] != alone["preln"]
    assert len(set(many.values())) == len(many)


def test_downstream_intervals_combine_seeds_and_item_error(study, tmp_path, rng_seed):
    data = Context(study["sweep"]).table("downstream").data.set_index("variant")
    runs = [
        r
        for r in study["sweep"].finished()
        if r.variant == "preln" and r.axes["d_model"] == 64 and r.axes["n_blocks"] == 2
    ]
    values = [float(r.eval["value"].iloc[0]) for r in runs]
    errors = np.array([float(r.eval["stderr"].iloc[0]) for r in runs])
    main_row = data[(data["d_model"] == 64) & (data["n_blocks"] == 2)].loc["preln"]
    seeds = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    items = stats.norm.ppf(0.975) * math.sqrt(np.mean(errors**2))
    assert main_row["copa_ci95"] == pytest.approx(math.hypot(seeds, items), rel=1e-9)
    assert data.loc["chance", "copa"] == 0.5
    rng = np.random.default_rng(rng_seed)
    write_run(tmp_path / "one", "preln", 0, _model(64, 2), rng, noise=0.0, eval_stderr=0.05)
    one = Context(load_sweep(tmp_path)).table("downstream").data.iloc[0]
    assert one["copa_ci95"] == pytest.approx(stats.norm.ppf(0.975) * 0.05, rel=1e-6)


@pytest.mark.slow
def test_report_on_the_study_draws_every_figure_and_lists_the_registry(study, tmp_path):
    bench = pd.DataFrame(
        [
            {
                "variant": v,
                "depth": d,
                "width": 64,
                "seq_len": 64,
                "step_time_ms": 1.0 * d,
                "ratio_time": r,
                "peak_mem_bytes": 1e6 * d,
                "ratio_mem": r,
            }
            for v, r in (("preln", 1.0), ("ldm-rls", 1.4))
            for d in (2, 4)
        ]
    )
    bench.to_csv(tmp_path / "bench.csv", index=False)
    text = report(study["root"], out_dir=tmp_path / "out", bench=tmp_path / "bench.csv").read_text()
    # The study has no tuning stage and no matched PreLN: only the items drawn from those are left out, with reasons.
    for name in report_items.names("figure"):
        assert (tmp_path / "out" / "figures" / f"{name}.png").exists() or name == "lr_sensitivity", name
    left_out = text.split("## Not produced\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert sorted(left_out) == [
        "- figure `lr_sensitivity`: no tuning.json with tuning runs (a grid with a tune section).",
        "- table `lr_neighbours`: no tuning.json with tuning runs (a grid with a tune section).",
        "- table `lr_sensitivity`: no tuning.json with tuning runs (a grid with a tune section).",
        "- table `matched`: no variant ran beside its matched PreLN, preln(match=<variant>).",
    ]
    # Every run finished: the list of runs left out is omitted, not printed empty.
    assert "Runs not counted" not in text and not (tmp_path / "out" / "tables" / "excluded_runs.csv").exists()
    tex = (tmp_path / "out" / "tables" / "main.tex").read_text()
    spec = re.search(r"\\begin\{tabular\}\{([lr]+)\}", tex).group(1)
    columns = list(Context(study["sweep"]).table("main").display.columns)
    assert spec[columns.index("Variant")] == "l" and spec[columns.index("Val loss (95% CI)")] == "r"
    assert spec[columns.index("d_model")] == "r"
    docs = (Path(__file__).parents[1] / "docs" / "report.md").read_text()
    assert report_items.listing() in docs, "docs/report.md lists the registry: paste report_items.listing() there"


def test_cost_table_labels_memory_and_shared_cores(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    for variant, shared, method in (("preln", False, "cpu"), ("ldm-rls", True, "cpu"), ("ldm", False, None)):
        write_run(tmp_path / variant, variant, 0, _model(64, 2), rng, noise=0.0)
        path = tmp_path / variant / "summary.json"
        summary = json.loads(path.read_text())
        summary.update(cores_shared=shared, peak_mem_method=method)
        path.write_text(json.dumps(summary))
    table = Context(load_sweep(tmp_path)).table("cost")
    rows = table.data.set_index("variant")
    assert math.isnan(rows.loc["ldm-rls", "tokens_per_s_rel"]) and rows.loc["ldm-rls", "cores_shared"]
    assert math.isnan(rows.loc["ldm", "peak_mem_bytes"]) and rows.loc["preln", "peak_mem_bytes"] == 1e8
    shown = table.display.set_index("Variant")
    assert "(shared cores)" in shown.loc["ldm-rls", "Tokens/s"]
    notes = " ".join(table.notes)
    assert "allocator" in notes and "RSS" in notes and "shared cores" in notes


def test_live_bytes_and_core_sharing(rng_seed):
    import torch

    torch.manual_seed(rng_seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert live_training_bytes(model, [opt]) == 4 * n * 4 + sum(
        s["step"].untyped_storage().nbytes() for s in opt.state.values()
    )  # weights, grads, two moments, steps
    load = CoreLoad()
    load.others = [3, 3]
    assert load.summary(threads=1)["cores_shared"] is (3 + 1 > load.summary(1)["cpu_cores"])
    load.others = [0]
    assert load.summary(threads=1)["cores_shared"] is (1 > load.summary(1)["cpu_cores"])


def test_a_registered_item_without_data_says_why(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    write_run(tmp_path / "preln", "preln", 0, _model(64, 2), rng, noise=0.0)
    ctx = Context(load_sweep(tmp_path))
    for kind, name, reason in (
        ("figure", "frontier", "model size"),
        ("figure", "depth", "n_blocks"),
        ("figure", "lambda", "depth_memory"),
        ("table", "compute_multiplier", "size"),
    ):
        with pytest.raises(NoData, match=reason):
            report_items.get(kind, name).fn(ctx)
    assert (
        tables.column_alignment(pd.DataFrame({"a": ["x", "y"], "b": ["1.0", "—"], "c": ["+0.1 ± 0.2", "-3"]})) == "lrr"
    )


def test_frontier_compute_of_a_matched_preln_counts_its_widened_mlps(tmp_path, rng_seed):
    import dataclasses

    import torch

    from harness.config import ModelConfig
    from harness.model.factory import build_model

    rng = np.random.default_rng(rng_seed)
    model = _model(64, 2)
    summary = write_run(tmp_path / "matched", "preln(match=ldm-rls)", 0, model, rng, noise=0.0)
    run = load_sweep(tmp_path).runs[0]
    with torch.device("meta"):
        wide = build_model(ModelConfig(**model), "preln(match=ldm-rls)").cfg
    assert wide.ffn_hidden > model["ffn_hidden"]
    # By hand, as for every other run, at the widened MLP width: 6 d FLOPs per extra unit and block.
    by_hand = _train_flops(dataclasses.asdict(wide), "preln", summary["train_tokens"]) / (3.0 * summary["train_tokens"])
    assert fr.forward_flops_per_token(run) == pytest.approx(by_hand, rel=1e-12)


def test_the_registry_imports_neither_package_that_registers_into_it():
    """Registration runs one way: the tables and figures packages import the registry, the report imports them."""
    code = (
        "import sys; from harness.reporting import items; items.names('table'); "
        "print(sorted(m for m in sys.modules if m.split('.')[:3] in "
        "(['harness', 'reporting', 'figures'], ['harness', 'reporting', 'tables'])))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # This module imported the report, which imports both packages: every item is registered, in order.
    assert {"main", "excluded_runs"} <= set(report_items.names("table", selectable=False))
    assert report_items.names("figure")[:2] == ("loss_curves", "final_loss")


def test_mixing_tick_labels_are_short_and_never_overlap_at_48_layers(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    write_run(tmp_path / "deep", "ldm-rls", 0, _model(64, 24), rng, noise=0.0)
    sweep = load_sweep(tmp_path)
    fig, _ = figs.mixing_matrices(Context(sweep, colours=figs.palette(r.variant for r in sweep.runs)))
    fig.canvas.draw()
    ax = fig.axes[0]
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        shown = [t for t in labels if t.get_text()]
        assert 2 <= len(shown) <= 13 and all(len(t.get_text()) <= 2 for t in shown)
        boxes = [t.get_window_extent() for t in shown]
        assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
    assert {t.get_text() for t in ax.get_xticklabels()} >= {"e"}


def test_learning_rate_axis_is_logarithmic_even_over_a_narrow_span(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    for lr in (1e-3, 2e-3, 3e-3):
        for s in (0, 1):
            write_run(tmp_path / f"preln-lr{lr}-s{s}", "preln", s, _model(64, 2), rng, noise=rng.normal(0, 0.01), lr=lr)
    sweep = load_sweep(tmp_path)
    fig, _ = figs.hyperparameters(Context(sweep, colours=figs.palette(r.variant for r in sweep.runs)))
    assert fig.axes[0].get_xscale() == "log"


def test_final_loss_panels_share_one_loss_scale(study):
    fig, _ = figs.final_loss(_ctx(study))
    limits = {tuple(round(v, 9) for v in ax.get_xlim()) for ax in fig.axes}
    assert len(fig.axes) > 1 and len(limits) == 1


def test_ablation_table_without_an_ablation_is_left_out_with_its_reason(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    for s in (0, 1):
        write_run(tmp_path / f"ldm-rls-s{s}", "ldm-rls", s, _model(64, 2), rng, noise=rng.normal(0, 0.01))
    with pytest.raises(NoData, match="no knob setting of ldm or ldm-rls"):
        tables.ablation_table(Context(load_sweep(tmp_path)))


def test_mixing_draws_the_mean_magnitude_where_a_signed_mean_cancels(tmp_path, rng_seed):
    """A source read with weights of both signs has a signed mean near zero; the figure shows how much it is read."""
    rng = np.random.default_rng(rng_seed)
    folder = tmp_path / "ldm-rls-s0"
    write_run(folder, "ldm-rls", 0, _model(64, 2), rng, noise=0.0)
    mixing = json.loads((folder / "mixing.json").read_text())
    size = len(mixing["matrix"])
    magnitude = np.tril(rng.uniform(0.5, 1.5, (size, size)))
    mixing["matrix"] = np.tril(rng.normal(0.0, 1e-3, (size, size))).tolist()  # cancelled
    mixing["matrix_abs"] = magnitude.tolist()
    (folder / "mixing.json").write_text(json.dumps(mixing))
    sweep = load_sweep(tmp_path)
    fig, caption = figs.mixing_matrices(Context(sweep, colours=figs.palette(r.variant for r in sweep.runs)))
    drawn = fig.axes[0].collections[0].get_array()
    lower = np.tril_indices(size)
    np.testing.assert_allclose(np.asarray(drawn).reshape(size, size)[lower], magnitude[lower])
    assert "magnitude" in caption and "signed mean" in caption
