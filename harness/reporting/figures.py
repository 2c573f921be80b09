"""The paper's figures, drawn with seaborn on matplotlib's Agg canvas from a loaded sweep.

Each figure is one function registered with ``@figure`` (``harness.reporting.items``): it takes the report's
``Context`` and returns ``(figure, caption)``, or raises ``NoData`` with the reason it cannot be drawn, which
the report prints instead of failing. Figures are built without pyplot (``Figure`` with an Agg canvas), so no
global backend or state changes and nothing needs closing. Every variant keeps one colour in every figure and
every report: ``palette`` gives each registered variant (at its default knobs) the colour of its place in the
variant registry, so PreLN is always the first tab10 colour; knob settings get colours of their own.
Heatmaps that are compared share one colour scale. ``save_figure`` writes PNG and PDF with fixed metadata (no
timestamps, no software version in the PNG), atomically, so the same inputs give the same bytes.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.io import atomic_write_bytes
from harness.reporting import frontier as fr
from harness.reporting.items import Context, NoData, figure, names
from harness.reporting.results import Run, Sweep, split_variant
from harness.reporting.stats import compare, mean_ci
from harness.reporting.tables import LDM_BASES, variant_order

DPI = 150


def palette(variants) -> dict[str, str]:
    """One fixed colour per variant: a registered variant at its defaults takes the tab10 colour of its place in
    the registry; every other name (knob settings, unknown variants) a husl colour in sorted name order."""
    try:
        # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
        import variants as registry

        order = registry.names()
    except Exception:  # a variant module mid-edit must not stop a report
        order = []
    fixed = sns.color_palette("tab10" if len(order) <= 10 else "husl", max(len(order), 1)).as_hex()
    names_ = sorted(set(variants))
    others = [n for n in names_ if n not in order]
    extra = sns.husl_palette(max(len(others), 1), l=0.55, s=0.8).as_hex()
    colours = {n: fixed[order.index(n)] for n in names_ if n in order}
    colours.update(zip(others, extra))
    return colours


def _figure(n_panels: int, *, ncols: int | None = None, panel_size=(4.2, 3.2)) -> tuple[Figure, np.ndarray]:
    ncols = ncols or n_panels
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), layout="constrained")
    # Paused until the figure is complete (``_finish``): seaborn's heatmap draws the whole figure to check tick
    # overlap, and a constrained layout on each of those draws costs seconds. The placeholder keeps colorbars
    # made the constrained way, so switching back is allowed.
    fig.set_layout_engine("none")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[n_panels:]:
        fig.delaxes(ax)
    return fig, axes[:n_panels]


def _finish(fig: Figure) -> Figure:
    fig.set_layout_engine("constrained")
    return fig


def main_setting(runs: list[Run]) -> str:
    """The setting with the most runs (ties by name): the one panel-per-variant figures show."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.setting] = counts.get(run.setting, 0) + 1
    return sorted(counts, key=lambda s: (-counts[s], s))[0] if counts else ""


def _setting_note(runs: list[Run], shown: str) -> str:
    others = sorted({r.setting for r in runs} - {shown})
    return f" Setting shown: {shown}; not shown: {'; '.join(others)}." if others else ""


def _shared_legend(fig: Figure, axes) -> None:
    """One legend for the figure, right of the panels, instead of one per panel."""
    _finish(fig)  # "outside" legend placement needs the constrained layout
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside right upper", frameon=False)


def _sort_key(text: str):
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def _interval_text(method: str) -> str:
    return {
        "paired t": "paired t-interval over shared seeds",
        "Welch": "Welch interval (seeds not shared)",
        "one seed": "no interval (one seed)",
    }.get(method, method)


# -- figures -----------------------------------------------------------------------------------------------


@figure("loss_curves", needs="`metrics.csv` with `tokens` and `val_loss`")
def loss_curves(ctx: Context) -> tuple[Figure, str]:
    """Validation loss against training tokens: the mean over seeds with a min–max band, one panel per setting."""
    rows = []
    for run in ctx.sweep.finished():
        m = run.metrics
        if m is None or not {"tokens", "val_loss"} <= set(m.columns):
            continue
        m = m.dropna(subset=["tokens", "val_loss"])
        rows += [
            {"setting": run.setting, "variant": run.variant, "seed": run.seed, "tokens": float(t), "val_loss": float(v)}
            for t, v in zip(m["tokens"], m["val_loss"])
        ]
    if not rows:
        raise NoData("no finished run logged val_loss with tokens in metrics.csv")
    frame = pd.DataFrame(rows)
    settings = sorted(frame["setting"].unique())
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(len(settings), ncols=min(len(settings), 4), panel_size=(5.2, 3.6))
        for ax, setting in zip(axes, settings):
            sub = frame[frame["setting"] == setting]
            order = variant_order(sub["variant"], ctx.baseline)
            sns.lineplot(
                data=sub,
                x="tokens",
                y="val_loss",
                hue="variant",
                hue_order=order,
                palette=ctx.colours,
                estimator="mean",
                errorbar=("pi", 100),
                ax=ax,
            )
            ax.set(xlabel="tokens", ylabel="validation loss", title=setting or "validation loss")
        _shared_legend(fig, axes)
    caption = (
        "Validation loss against training tokens; line: mean over seeds, band: minimum to maximum over "
        "seeds. Finished runs only."
    )
    return _finish(fig), caption


@figure("final_loss", needs="`summary.json`")
def final_loss(ctx: Context) -> tuple[Figure, str]:
    """Final validation loss per variant with the main table's 95% t-intervals, one panel per setting."""
    main = ctx.table("main").data
    main = main[main["seeds"] > 0]
    if main.empty:
        raise NoData("no run finished with a final validation loss")
    settings = sorted(main["setting"].unique())
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(
            len(settings),
            ncols=min(len(settings), 4),
            panel_size=(4.8, 0.45 * main.groupby("setting").size().max() + 1.2),
        )
        for ax, setting in zip(axes, settings):
            sub = main[main["setting"] == setting].reset_index(drop=True)
            for i, row in sub.iterrows():
                half = 0.0 if math.isnan(row["val_loss_ci95"]) else row["val_loss_ci95"]
                ax.errorbar(row["val_loss"], i, xerr=half, fmt="o", color=ctx.colours[row["variant"]], capsize=3)
            ax.set_yticks(range(len(sub)), sub["variant"])
            ax.invert_yaxis()
            ax.set(xlabel="final validation loss", title=setting or "final validation loss")
    caption = "Final validation loss, mean over seeds with the 95% t-interval (none drawn for a single seed)."
    return _finish(fig), caption


KNOB_LABELS = {
    "write": "memory write",
    "read": "read",
    "residual_write": "residual write",
    "qk_source": "q/k source",
    "groups": "groups G",
    "key_dim": "key width d_k",
    "qk_hidden": "q/k MLP width",
    "lambda": "forgetting λ",
    "omega": "importance ω",
    "alpha": "ridge α",
}


def knob_label(knob: str) -> str:
    return KNOB_LABELS.get(knob, knob.replace("_", " "))


def _by_seed(runs: list[Run]) -> dict[int, float]:
    """Final loss per seed (the mean where one seed has two runs)."""
    values: dict[int, list[float]] = {}
    for run in runs:
        values.setdefault(run.seed, []).append(run.final_loss)
    return {s: float(np.mean(v)) for s, v in values.items()}


def ablation_comparisons(ctx: Context) -> tuple[pd.DataFrame, str, str]:
    """Each variant that shares the reference's knobs against the reference: the knobs it changes (``axis``,
    joined by `` + `` where it changes several), and Δ final
    loss with its interval from ``harness.reporting.stats.compare`` (paired over shared seeds). Returns the rows, the
    reference and the setting compared in."""
    reference = split_variant(ctx.ablation_reference)[0]
    finished = ctx.sweep.finished()
    ref_runs = [r for r in finished if r.variant == reference]
    if not ref_runs:
        raise NoData(f"no finished run of the ablation reference {reference}")
    ref_knobs = ref_runs[0].knob_values
    # The setting where the ablations are: the most runs of variants that share the reference's knobs.
    shown = main_setting(
        [
            r
            for r in finished
            if r.knob_values and set(r.knob_values) == set(ref_knobs) and any(q.setting == r.setting for q in ref_runs)
        ]
    )
    ref_runs = [r for r in ref_runs if r.setting == shown]
    by_variant: dict[str, list[Run]] = {}
    for run in finished:
        if (
            run.setting == shown
            and run.variant != reference
            and run.knob_values
            and set(run.knob_values) == set(ref_knobs)
        ):
            by_variant.setdefault(run.variant, []).append(run)
    rows = []
    reference_losses = _by_seed(ref_runs)
    for variant, runs in sorted(by_variant.items()):
        changed = {k: v for k, v in runs[0].knob_values.items() if str(v) != str(ref_knobs.get(k))}
        if not changed:
            continue
        c = compare(reference_losses, _by_seed(runs))
        rows.append(
            {
                "variant": variant,
                "axis": " + ".join(changed),
                "value": ", ".join(f"{k}={v}" for k, v in changed.items())
                if len(changed) > 1
                else str(next(iter(changed.values()))),
                "delta": c.delta,
                "low": c.low,
                "high": c.high,
                "method": c.method,
                "n": c.n,
            }
        )
    if not rows:
        raise NoData(f"no finished variant changes a knob of {reference} in its setting")
    return pd.DataFrame(rows), reference, shown


@figure("ablations", needs="finished runs of the ablation reference and of variants changing its knobs")
def ablations(ctx: Context) -> tuple[Figure, str]:
    """Every ablation axis the sweep varies (read, residual write, q/k source, groups, key width, λ, ω, the memory
    write, ...), one panel per knob: Δ final loss of each value against `report.ablation_reference` with its
    paired 95% interval; a variant that changes several knobs at once gets a panel for that combination."""
    frame, reference, shown = ablation_comparisons(ctx)
    rank = {k: i for i, k in enumerate(KNOB_LABELS)}
    axes_order = sorted(
        dict.fromkeys(frame["axis"]), key=lambda a: (a.count(" + "), [rank.get(k, 99) for k in a.split(" + ")], a)
    )
    tallest = frame.groupby("axis").size().max()
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(len(axes_order), ncols=min(len(axes_order), 4), panel_size=(3.6, 0.5 * tallest + 1.4))
        for ax, axis in zip(axes, axes_order):
            sub = frame[frame["axis"] == axis].sort_values("value", key=lambda v: v.map(_sort_key))
            sub = sub.reset_index(drop=True)
            for i, row in sub.iterrows():
                err = None if math.isnan(row["low"]) else [[row["delta"] - row["low"]], [row["high"] - row["delta"]]]
                ax.errorbar(
                    row["delta"], i, xerr=err, fmt="o", capsize=3, color=ctx.colours.get(row["variant"], "black")
                )
            ax.axvline(0.0, color="0.3", lw=0.8, ls="--")
            ax.set_yticks(range(len(sub)), sub["value"])
            ax.invert_yaxis()
            ax.set(xlabel=f"Δ loss vs {reference}", title=" + ".join(knob_label(k) for k in axis.split(" + ")))
    methods = sorted(set(frame["method"]))
    caption = (
        f"Ablations against {reference}, one panel per knob the sweep changes: "
        f"Δ final validation loss (variant − {reference}; negative is better) with its 95% interval: "
        f"{'; '.join(_interval_text(m) for m in methods)}. Dashed line: no difference."
        + (f" Setting: {shown}." if shown else "")
    )
    return _finish(fig), caption


@figure("ablation_grid", needs="runs of the ablation reference's base varying groups, λ and ω")
def ablation_grid(ctx: Context) -> tuple[Figure, str]:
    """Mean final loss over the groups × λ grid of the ablation reference's base variant, one heatmap per ω, for
    runs varying only those knobs."""
    axes_names = ("groups", "lambda", "omega")
    base = split_variant(ctx.ablation_reference)[1]
    runs = [r for r in ctx.sweep.finished() if r.base == base and set(r.knobs) <= set(axes_names)]
    if not runs:
        raise NoData(f"no finished {base} run varies only {', '.join(axes_names)}")
    shown = main_setting(runs)
    runs = [r for r in runs if r.setting == shown]
    frame = pd.DataFrame(
        [{**{k: str(r.knob_values.get(k, "default")) for k in axes_names}, "val_loss": r.final_loss} for r in runs]
    )
    cells = frame.groupby(list(axes_names), as_index=False)["val_loss"].mean()
    if len(cells) < 2:
        raise NoData(f"the {base} runs cover a single knob setting, so there is no grid to show")
    omegas = sorted(cells["omega"].unique(), key=_sort_key)
    rows = sorted(cells["groups"].unique(), key=_sort_key)
    cols = sorted(cells["lambda"].unique(), key=_sort_key)
    vmin, vmax = cells["val_loss"].min(), cells["val_loss"].max()
    fig, axes = _figure(len(omegas), panel_size=(1.1 * len(cols) + 2.2, 0.6 * len(rows) + 1.6))
    for i, (ax, omega) in enumerate(zip(axes, omegas)):
        grid = (
            cells[cells["omega"] == omega]
            .pivot(index="groups", columns="lambda", values="val_loss")
            .reindex(index=rows, columns=cols)
        )
        sns.heatmap(
            grid,
            ax=ax,
            annot=True,
            fmt=".3f",
            cmap="viridis_r",
            vmin=vmin,
            vmax=vmax,
            cbar=i == len(omegas) - 1,
            cbar_kws={"label": "final val loss"},
        )
        ax.tick_params(axis="y", labelrotation=0)
        ax.set(xlabel="λ (lambda)", ylabel="groups G", title=f"ω (omega) = {omega}")
    caption = (
        f"Mean final validation loss of {base} over the knob grid (groups × λ, one panel per ω, one colour "
        f"scale); blank cells were not run." + _setting_note(runs, shown)
    )
    return _finish(fig), caption


BUDGET_KEYS = ("train.tokens", "train.max_steps")


def numeric_axes(sweep: Sweep) -> list[str]:
    """Grid axes (config keys besides variant and seed) with numbers as values and at least two of them; of axes
    that determine each other (a width and the MLP width scaled with it), the first; a budget that follows from
    the other axes (tokens per parameter at each size) is no axis of its own."""
    out = []
    finished = sweep.finished()
    for name in sweep.axis_keys:
        values = [r.axes.get(name) for r in finished]
        if not (
            values
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            and len(set(values)) >= 2
        ):
            continue
        others = [k for k in sweep.axis_keys if k != name and sweep.axis_keys[k] not in BUDGET_KEYS]
        if sweep.axis_keys[name] in BUDGET_KEYS and others and _determines(finished, others, name):
            continue
        if not any(_determines(finished, [name], other) and _determines(finished, [other], name) for other in out):
            out.append(name)
    return out


def _determines(runs: list[Run], given: list[str], b: str) -> bool:
    """Whether the values of the axes ``given`` fix that of axis ``b`` among ``runs``."""
    seen: dict = {}
    for run in runs:
        key = tuple(repr(run.axes.get(a)) for a in given)
        if seen.setdefault(key, run.axes.get(b)) != run.axes.get(b):
            return False
    return True


def axis_slice(sweep: Sweep, axis: str) -> tuple[pd.DataFrame, dict]:
    """Finished runs along ``axis`` with every other axis that does not follow from it held at its most common value:
    one row per run with the axis value, variant, seed and final loss (variants with at least two values of the
    axis), and the values held fixed."""
    finished = sweep.finished()
    held: dict = {}
    for other in sweep.axis_keys:
        # An axis that follows from this one and those already held (the MLP width of a width, the token budget
        # of a size) moves with them instead of being held.
        if other == axis or _determines(finished, [axis, *held], other):
            continue
        counts = pd.Series([repr(r.axes.get(other)) for r in finished]).value_counts()
        top = sorted(counts.index, key=lambda v: (-counts[v], v))[0]
        held[other] = next(r.axes.get(other) for r in finished if repr(r.axes.get(other)) == top)
    rows = [
        {"x": float(r.axes[axis]), "variant": r.variant, "seed": r.seed, "loss": r.final_loss}
        for r in finished
        if all(r.axes.get(k) == v for k, v in held.items())
    ]
    frame = pd.DataFrame(rows, columns=["x", "variant", "seed", "loss"])
    spread = frame.groupby("variant")["x"].nunique()
    return frame[frame["variant"].isin(spread[spread >= 2].index)].reset_index(drop=True), held


def _lines_with_intervals(ax, frame: pd.DataFrame, colours: dict[str, str], baseline: str) -> None:
    """One line per variant through the mean at each x, with the 95% t-interval as error bars."""
    for variant in variant_order(frame["variant"], baseline):
        sub = frame[frame["variant"] == variant]
        stats_rows = [(x, *mean_ci(g["loss"])) for x, g in sub.groupby("x")]
        xs = [r[0] for r in stats_rows]
        means = [r[1] for r in stats_rows]
        halves = [0.0 if math.isnan(r[2]) else r[2] for r in stats_rows]
        ax.errorbar(xs, means, yerr=halves, marker="o", capsize=3, color=colours.get(variant, "black"), label=variant)


def _held_text(held: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in held.items())


@figure("hyperparameters", needs="a sweep that varies a numeric config key (learning rate, width, ...)")
def hyperparameters(ctx: Context) -> tuple[Figure, str]:
    """Final loss against every numeric grid axis (learning rate, width, depth, ...): the axis on x, one line per
    variant through the mean over seeds with its 95% t-interval; the other axes held at their most common value."""
    slices = {name: axis_slice(ctx.sweep, name) for name in numeric_axes(ctx.sweep)}
    slices = {name: sl for name, sl in slices.items() if not sl[0].empty}
    if not slices:
        raise NoData("the sweep varies no numeric config key besides the seed along which a variant has two values")
    held_texts = []
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(len(slices), ncols=min(len(slices), 3), panel_size=(4.4, 3.4))
        for ax, (name, (frame, held)) in zip(axes, slices.items()):
            _lines_with_intervals(ax, frame, ctx.colours, ctx.baseline)
            xs = sorted(frame["x"].unique())
            if xs and xs[0] > 0 and xs[-1] / xs[0] >= 8:
                ax.set_xscale("log")
            ax.set(xlabel=name, ylabel="final validation loss", title=name)
            if held:
                held_texts.append(f"{name}: {_held_text(held)}")
        _shared_legend(fig, axes)
    caption = (
        "Final validation loss against each numeric axis of the grid; points: mean over seeds with the 95% "
        "t-interval (none for one seed)."
    )
    if held_texts:
        caption += " Held fixed per panel — " + "; ".join(held_texts) + "."
    return _finish(fig), caption


@figure("depth", needs="runs that differ in `model.n_blocks` (as `experiments/depth.yaml` makes)")
def depth(ctx: Context) -> tuple[Figure, str]:
    """Depth scaling: final validation loss against the number of layers per variant, mean over seeds with the
    95% t-interval."""
    name = next((n for n, key in ctx.sweep.axis_keys.items() if key == "model.n_blocks"), None)
    if name is None:
        raise NoData("no runs differ in model.n_blocks")
    frame, held = axis_slice(ctx.sweep, name)
    if frame["x"].nunique() < 2:
        raise NoData("fewer than two depths among the finished runs")
    frame["x"] = 2 * frame["x"]  # every block holds an attention and an MLP layer
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(1, panel_size=(5.4, 3.8))
        _lines_with_intervals(axes[0], frame, ctx.colours, ctx.baseline)
        axes[0].set_xticks(sorted(frame["x"].unique()))
        axes[0].set(xlabel="depth (layers: 2 × blocks)", ylabel="final validation loss", title="depth scaling")
        _shared_legend(fig, axes)
    caption = "Final validation loss against depth; mean over seeds with the 95% t-interval (none for one seed)."
    if held:
        caption += f" Held fixed: {_held_text(held)}."
    return _finish(fig), caption


@figure(
    "frontier",
    needs="finished runs of several model sizes at one tokens-per-parameter budget "
    "(as `experiments/scaling.yaml` makes)",
)
def frontier(ctx: Context) -> tuple[Figure, str]:
    """The compute frontier: final loss against training FLOPs on log–log axes, every run as a dot, the mean of
    each size as a marker, and the power law fitted per variant as a line."""

    result = ctx.cached("frontier", lambda: fr.from_sweep(ctx.sweep, ctx.baseline))
    points = result.points
    if points.empty:
        raise NoData(result.reason)
    if points.groupby("variant")["size"].nunique().max() < 2:
        raise NoData("no variant has two model sizes at one tokens-per-parameter budget")
    fits = result.fits.set_index("variant") if not result.fits.empty else pd.DataFrame()
    # A variant with a single size has no frontier to draw; its multiplier is in the table.
    sizes = points.groupby("variant")["size"].nunique()
    points = points[points["variant"].isin(sizes[sizes >= 2].index)]
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(1, panel_size=(6.4, 4.4))
        ax = axes[0]
        for variant in variant_order(points["variant"], ctx.baseline):
            sub = points[points["variant"] == variant]
            colour = ctx.colours.get(variant, "black")
            ax.scatter(sub["flops"], sub["loss"], s=10, alpha=0.35, color=colour)
            cells = sub.groupby("size").agg(flops=("flops", "mean"), loss=("loss", "mean"))
            label = variant
            if variant in fits.index:
                a, b = fits.loc[variant, "a"], fits.loc[variant, "b"]
                grid = np.geomspace(cells["flops"].min(), cells["flops"].max(), 50)
                ax.plot(grid, a * grid ** (-b), color=colour, lw=1.2)
                label = f"{variant}: L = {a:.3g}·C^(−{b:.3f})"
            ax.scatter(cells["flops"], cells["loss"], s=36, marker="D", color=colour, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(xlabel="training FLOPs C", ylabel="final validation loss L", title="compute frontier")
        _shared_legend(fig, axes)
    caption = (
        f"Final validation loss against training compute (3 × forward FLOPs per token × tokens) for every "
        f"model size trained at {result.budget_text}, variants with two sizes or more; dots: runs, "
        f"diamonds: mean over seeds per size, "
        f"lines: L = a·C^(−b) fitted per variant in log–log space. The compute multipliers are in the "
        f"compute_multiplier table."
    )
    return _finish(fig), caption


def _depth_memory_runs(ctx: Context, key: str) -> tuple[dict[str, list[Run]], str]:
    candidates = [
        r
        for r in ctx.sweep.finished()
        if isinstance((r.summary or {}).get("depth_memory"), dict) and r.summary["depth_memory"].get(key)
    ]
    if not candidates:
        raise NoData(f"no finished run has depth_memory.{key} in its summary.json")
    shown = main_setting(candidates)
    by_variant: dict[str, list[Run]] = {}
    for run in candidates:
        if run.setting == shown:
            by_variant.setdefault(run.variant, []).append(run)
    return by_variant, _setting_note(candidates, shown)


@figure("lambda", needs="`depth_memory.lambda` in `summary.json` (LDM-RLS runs)")
def learned_lambda(ctx: Context) -> tuple[Figure, str]:
    """What the memory learned: the forgetting factor λ of every layer and group as a heatmap, one panel per
    variant (mean over seeds), all panels on one colour scale."""
    by_variant, note = _depth_memory_runs(ctx, "lambda")
    order = variant_order(by_variant, ctx.ablation_reference)
    grids, dropped = {}, []
    for variant in order:
        mats = [np.asarray(r.summary["depth_memory"]["lambda"], dtype=float) for r in by_variant[variant]]
        same = [m for m in mats if m.ndim == 2 and m.shape == mats[0].shape]
        if len(same) < len(mats):
            dropped.append(variant)
        grids[variant] = np.mean(same, axis=0)
    vmin = min(float(np.nanmin(g)) for g in grids.values())
    vmax = max(float(np.nanmax(g)) for g in grids.values())
    if vmax - vmin < 1e-6:
        vmin, vmax = vmin - 0.01, vmax + 0.01
    fig, axes = _figure(len(order), ncols=min(len(order), 4), panel_size=(3.8, 3.2))
    image = None
    for ax, variant in zip(axes, order):
        g = grids[variant]  # (layers, groups)
        image = ax.imshow(g, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set(xlabel="group", ylabel="layer", title=variant)
        ax.set_yticks(range(g.shape[0]))
        ax.set_xticks(range(0, g.shape[1], max(1, g.shape[1] // 8)))
    _finish(fig)
    bar = fig.colorbar(image, ax=list(axes), label="λ (forgetting factor)", shrink=0.9)
    bar.formatter.set_useOffset(False)  # λ near 1 reads as 0.99995, not as an offset
    caption = (
        "Learned forgetting factor λ per layer (rows) and memory group (columns) at the last validation, mean "
        "over seeds; one colour scale for all panels." + note
    )
    if dropped:
        caption += f" Runs of another shape were left out for: {', '.join(dropped)}."
    return fig, caption


@figure("lambda_seeds", needs="`depth_memory.lambda` in `summary.json` (LDM-RLS runs that learn λ)")
def lambda_seeds(ctx: Context) -> tuple[Figure, str]:
    """How far λ moved, seed by seed: λ per layer (mean over memory groups), one line per seed, the band from the
    smallest to the largest value over seeds and groups, and the value every learned λ starts from."""
    from variants.rls import LAMBDA_INIT  # imported here: it loads torch

    by_variant, note = _depth_memory_runs(ctx, "lambda")
    # A fixed λ records its constant: only learned ones can have moved.
    by_variant = {
        v: runs for v, runs in by_variant.items() if all(r.knob_values.get("lambda") == "learned" for r in runs)
    }
    if not by_variant:
        raise NoData("no finished run learns λ (every one fixes it with a lambda knob)")
    order = variant_order(by_variant, ctx.ablation_reference)
    stacks = {}
    for variant in order:
        pairs = [(r.seed, np.asarray(r.summary["depth_memory"]["lambda"], dtype=float)) for r in by_variant[variant]]
        # Runs of another shape than the first are left out, as in the heatmap of the lambda figure.
        pairs = [(seed, m) for seed, m in pairs if m.ndim == 2 and m.shape == pairs[0][1].shape]
        stacks[variant] = (np.stack([m for _, m in pairs]), [seed for seed, _ in pairs])
    fig, axes = _figure(len(order), ncols=min(len(order), 4), panel_size=(3.8, 3.0))
    moved = 0.0
    for ax, variant in zip(axes, order):
        stack, seeds = stacks[variant]  # (seeds, layers, groups)
        layers = np.arange(stack.shape[1])
        ax.fill_between(layers, stack.min(axis=(0, 2)), stack.max(axis=(0, 2)), alpha=0.2, color="grey", linewidth=0)
        for seed, per_seed in zip(seeds, stack.mean(axis=2)):
            ax.plot(layers, per_seed, marker="o", markersize=3, linewidth=1, label=f"seed {seed}")
        ax.axhline(LAMBDA_INIT, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="layer", ylabel="λ", title=variant)
        ax.ticklabel_format(axis="y", useOffset=False)
        moved = max(moved, float(np.abs(stack - LAMBDA_INIT).max()))
    _shared_legend(fig, axes)
    caption = (
        f"Learned forgetting factor λ per layer at the last validation, mean over memory groups, one line per seed; "
        f"band: smallest to largest over seeds and groups; dashed: λ = {LAMBDA_INIT:g}, where every learned λ "
        f"starts. The largest distance from it in any run, layer and group: {moved:.3g}." + note
    )
    return fig, caption


@figure("omega", needs="`depth_memory.omega` in `summary.json` (LDM-RLS runs)")
def omega_profile(ctx: Context) -> tuple[Figure, str]:
    """The importance weight ω per layer: the mean over tokens (line, averaged over seeds), ± its standard
    deviation over tokens (dark band) and its minimum to maximum (light band), one line per variant."""
    by_variant, note = _depth_memory_runs(ctx, "omega")
    rows = []
    for variant, runs in by_variant.items():
        for run in runs:
            for layer, rec in enumerate(run.summary["depth_memory"]["omega"]):
                if isinstance(rec, dict):
                    rows.append(
                        {
                            "variant": variant,
                            "seed": run.seed,
                            "layer": layer,
                            **{k: float(rec.get(k, math.nan)) for k in ("mean", "std", "min", "max")},
                        }
                    )
    if not rows:
        raise NoData("depth_memory.omega holds no per-layer records")
    frame = (
        pd.DataFrame(rows)
        .groupby(["variant", "layer"], as_index=False)
        .agg(mean=("mean", "mean"), std=("std", "mean"), min=("min", "min"), max=("max", "max"))
    )
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(1, panel_size=(5.6, 3.6))
        ax = axes[0]
        for variant in variant_order(frame["variant"], ctx.ablation_reference):
            sub = frame[frame["variant"] == variant]
            colour = ctx.colours.get(variant, "black")
            ax.fill_between(sub["layer"], sub["min"], sub["max"], color=colour, alpha=0.12, lw=0)
            ax.fill_between(
                sub["layer"], sub["mean"] - sub["std"], sub["mean"] + sub["std"], color=colour, alpha=0.3, lw=0
            )
            ax.plot(sub["layer"], sub["mean"], marker="o", color=colour, label=variant)
        ax.set(xlabel="layer", ylabel="ω (importance weight)", title="importance weights by layer")
        _shared_legend(fig, axes)
    caption = (
        "Importance weight ω per layer at the last validation: line, mean over tokens averaged over seeds; "
        "dark band, ± the standard deviation over tokens; light band, minimum to maximum over tokens and "
        "seeds." + note
    )
    return _finish(fig), caption


@figure("layers", needs="`layers.csv`")
def layer_profiles(ctx: Context) -> tuple[Figure, str]:
    """Per-layer output RMS and gradient norm against depth at each run's last logged step; mean over seeds with
    a min–max band."""
    candidates = [r for r in ctx.sweep.finished() if r.layers is not None and {"step", "layer"} <= set(r.layers)]
    if not candidates:
        raise NoData("no finished run has a layers.csv")
    shown = main_setting(candidates)
    rows = []
    for run in candidates:
        if run.setting != shown:
            continue
        last = run.layers[run.layers["step"] == run.layers["step"].max()]
        for rec in last.to_dict("records"):
            rows.append(
                {
                    "variant": run.variant,
                    "seed": run.seed,
                    "layer": rec["layer"],
                    "output_rms": rec.get("output_rms", math.nan),
                    "grad_norm": rec.get("grad_norm", math.nan),
                }
            )
    frame = pd.DataFrame(rows)
    order = variant_order(frame["variant"], ctx.baseline)
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(2)
        for ax, column, label in zip(axes, ("output_rms", "grad_norm"), ("output RMS", "gradient norm")):
            sns.lineplot(
                data=frame,
                x="layer",
                y=column,
                hue="variant",
                hue_order=order,
                palette=ctx.colours,
                marker="o",
                errorbar=("pi", 100),
                ax=ax,
            )
            ax.set(xlabel="layer", ylabel=label, title=f"{label} by depth")
            if frame[column].dropna().gt(0).all() and not frame[column].dropna().empty:
                ax.set_yscale("log")
        _shared_legend(fig, axes)
    caption = (
        "Per-layer output RMS and gradient norm at the last logged step (layers.csv); mean over seeds with "
        "a min–max band." + _setting_note(candidates, shown)
    )
    return _finish(fig), caption


def _mixing_runs(ctx: Context, keep) -> tuple[dict[str, list[Run]], list[Run], str]:
    candidates = [r for r in ctx.sweep.finished() if r.mixing and keep(r)]
    shown = main_setting(candidates)
    by_variant: dict[str, list[Run]] = {}
    for run in candidates:
        if run.setting == shown:
            by_variant.setdefault(run.variant, []).append(run)
    return by_variant, candidates, shown


def _mean_same_shape(arrays: list[np.ndarray]) -> tuple[np.ndarray, bool]:
    same = [a for a in arrays if a.shape == arrays[0].shape]
    return np.mean(same, axis=0), len(same) < len(arrays)


@figure("mixing", needs="`mixing.json`")
def mixing_matrices(ctx: Context) -> tuple[Figure, str]:
    """The depth-mixing matrix of every variant as a heatmap, averaged over seeds, one panel per variant, all on
    one colour scale."""
    by_variant, candidates, shown = _mixing_runs(ctx, lambda r: isinstance(r.mixing.get("matrix"), list))
    if not by_variant:
        raise NoData("no finished run has a mixing.json with a matrix")
    order = variant_order(by_variant, ctx.baseline)
    matrices, skipped = {}, []
    for variant in order:
        runs = sorted(by_variant[variant], key=lambda r: r.seed)
        matrices[variant], dropped = _mean_same_shape([np.asarray(r.mixing["matrix"], dtype=float) for r in runs])
        if dropped:
            skipped.append(variant)
    shown_cells = [
        m[np.tril_indices(m.shape[0], 0, m.shape[1])] if m.shape[0] == m.shape[1] else m.ravel()
        for m in matrices.values()
    ]
    vmin = min(float(c.min()) for c in shown_cells)
    vmax = max(float(c.max()) for c in shown_cells)
    fig, axes = _figure(len(order), ncols=min(len(order), 4), panel_size=(4.0, 3.4))
    for i, (ax, variant) in enumerate(zip(axes, order)):
        matrix = matrices[variant]  # (readers, sources)
        first = by_variant[variant][0].mixing
        readers, sources = first.get("readers"), first.get("sources")
        frame = pd.DataFrame(
            matrix,
            index=readers if readers and len(readers) == matrix.shape[0] else None,
            columns=sources if sources and len(sources) == matrix.shape[1] else None,
        )
        # Reader l sees only the embedding and outputs before it: the cells above the diagonal do not exist.
        mask = np.triu(np.ones(matrix.shape, dtype=bool), k=1) if matrix.shape[0] == matrix.shape[1] else None
        sns.heatmap(
            frame,
            ax=ax,
            mask=mask,
            cmap="mako",
            square=True,
            vmin=vmin,
            vmax=vmax,
            cbar=i == len(order) - 1,
            cbar_kws={"label": "mixing weight (shared scale)"},
        )
        ax.set(xlabel="source", ylabel="reader", title=variant)
    caption = (
        "Depth-mixing matrices: entry (reader, source) is the weight with which a layer's input (or the "
        "head's) contains the embedding or an earlier layer's output, averaged over tokens and seeds; one "
        "colour scale for all panels." + _setting_note(candidates, shown)
    )
    if skipped:
        caption += f" Runs whose matrix shape differs were left out for: {', '.join(skipped)}."
    return _finish(fig), caption


MAX_GROUP_PANELS = 16


@figure("mixing_groups", needs="`mixing.json` with `per_group` (LDM and LDM-RLS runs)")
def mixing_groups(ctx: Context) -> tuple[Figure, str]:
    """The depth-mixing matrix of every memory group of LDM and LDM-RLS (at their default knobs, and the ablation
    reference), one row of panels per variant, averaged over seeds, all on one colour scale."""
    reference = split_variant(ctx.ablation_reference)[0]
    by_variant, candidates, shown = _mixing_runs(
        ctx,
        lambda r: (
            (r.variant in LDM_BASES or r.variant == reference)
            and isinstance(r.mixing.get("per_group"), list)
            and len(r.mixing["per_group"]) > 0
        ),
    )
    if not by_variant:
        raise NoData("no finished ldm or ldm-rls run has per-group matrices in mixing.json")
    order = variant_order(by_variant, reference)
    stacks = {
        v: _mean_same_shape([np.asarray(r.mixing["per_group"], dtype=float) for r in by_variant[v]])[0] for v in order
    }  # (groups, readers, sources)
    cols = min(MAX_GROUP_PANELS, max(s.shape[0] for s in stacks.values()))
    vmin = min(float(np.nanmin(s)) for s in stacks.values())
    vmax = max(float(np.nanmax(s)) for s in stacks.values())
    fig, axes = _figure(len(order) * cols, ncols=cols, panel_size=(1.7, 1.7))
    image = None
    for r, variant in enumerate(order):
        stack = stacks[variant]
        for g in range(cols):
            ax = axes[r * cols + g]
            if g >= stack.shape[0]:
                ax.set_axis_off()
                continue
            m = (
                np.where(np.triu(np.ones(stack[g].shape, dtype=bool), k=1), np.nan, stack[g])
                if stack[g].shape[0] == stack[g].shape[1]
                else stack[g]
            )
            image = ax.imshow(m, cmap="mako", vmin=vmin, vmax=vmax, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{variant} g{g}" if g == 0 else f"g{g}", fontsize=7)
    _finish(fig)
    fig.colorbar(image, ax=list(axes), label="mixing weight (shared scale)", shrink=0.8)
    caption = (
        "Per-group depth-mixing matrices of the linear depth memory: in each panel rows are readers (layers, "
        "then the head) and columns sources (the embedding, then layer outputs), averaged over tokens and "
        "seeds; one colour scale for all panels."
    )
    over = [v for v in order if stacks[v].shape[0] > cols]
    if over:
        caption += f" Only the first {cols} groups are drawn for: {', '.join(over)}."
    return fig, caption + _setting_note(candidates, shown)


@figure("downstream", needs="`eval/table.csv`")
def downstream(ctx: Context) -> tuple[Figure, str]:
    """Downstream accuracy per task and the task average, one panel each, with 95% intervals (seed spread and
    item error combined) and the accuracy of uniform guessing as a dashed line."""
    table = ctx.table("downstream").data
    data = table[table["variant"] != "chance"].reset_index(drop=True)
    chance = table[table["variant"] == "chance"]
    tasks = [c[: -len("_ci95")] for c in data.columns if c.endswith("_ci95") and c != "average_ci95"]
    panels = [*tasks, "average"]
    labels = [f"{v} [{s}]" if s else v for s, v in zip(data["setting"], data["variant"])]
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(len(panels), ncols=min(len(panels), 4), panel_size=(3.4, 0.42 * len(data) + 1.3))
        for ax, task in zip(axes, panels):
            for i, (variant, mean, half) in enumerate(zip(data["variant"], data[task], data[f"{task}_ci95"])):
                if math.isnan(mean):
                    continue
                ax.errorbar(
                    100 * mean,
                    i,
                    xerr=0.0 if math.isnan(half) else 100 * half,
                    fmt="o",
                    capsize=3,
                    color=ctx.colours.get(variant, "black"),
                )
            ax.set_yticks(range(len(data)), labels if task == panels[0] else [""] * len(data))
            ax.invert_yaxis()
            level = float(chance[task].iloc[0]) if len(chance) and task in chance else math.nan
            if not math.isnan(level):
                ax.axvline(100 * level, color="grey", linestyle="--", linewidth=1)
            low, high = ax.get_xlim()
            ax.set_xlim(max(low, 0.0), min(high, 100.0))  # an interval past 0% or 100% says nothing more
            ax.set(xlabel="accuracy (%)", title=task)
    caption = (
        "Downstream accuracy in percent (acc_norm where the task reports it, else acc) with its 95% interval: "
        "the t-interval over seeds and 1.96 × the runs' item standard error, added in quadrature (the item error "
        "alone for a single seed). Dashed: the accuracy of guessing uniformly among the task's choices."
    )
    return _finish(fig), caption


@figure("overhead", needs="a benchmark CSV")
def overhead(ctx: Context) -> tuple[Figure, str]:
    """Step time and peak memory relative to the baseline against depth, from the benchmark CSV."""
    bench, baseline = ctx.bench, ctx.baseline
    if bench is None or bench.empty:
        raise NoData("no benchmark CSV (results/<sweep>/bench.csv or --bench)")
    sizes = bench.groupby(["width", "seq_len"]).size().reset_index(name="n")
    sizes = sizes.sort_values(["n", "width", "seq_len"], ascending=[False, True, True])
    width, seq_len = sizes.iloc[0]["width"], sizes.iloc[0]["seq_len"]
    frame = bench[(bench["width"] == width) & (bench["seq_len"] == seq_len)]
    order = variant_order(frame["variant"], baseline)
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(2)
        for ax, column, label in zip(axes, ("ratio_time", "ratio_mem"), ("step time", "peak memory")):
            sns.lineplot(
                data=frame,
                x="depth",
                y=column,
                hue="variant",
                hue_order=order,
                palette=ctx.colours,
                marker="o",
                errorbar=None,
                ax=ax,
            )
            ax.set(xlabel="depth (layers)", ylabel=f"{label} / {baseline}", title=f"{label} overhead")
        _shared_legend(fig, axes)
    caption = f"Measured overhead relative to {baseline} against depth (width {width}, sequence length {seq_len})."
    if len(sizes) > 1:
        caption += " Other sizes are in the benchmark table."
    return _finish(fig), caption


FIGURES = names("figure")


def save_figure(fig: Figure, folder: Path, name: str) -> list[Path]:
    """Write ``<name>.png`` and ``<name>.pdf`` atomically with fixed metadata, so reruns give the same bytes."""
    paths = []
    for fmt, metadata in (("png", {"Software": None}), ("pdf", {"CreationDate": None, "ModDate": None})):
        buf = io.BytesIO()
        # A tight box keeps colorbar labels that the layout engine leaves at the edge.
        fig.savefig(buf, format=fmt, dpi=DPI, metadata=metadata, bbox_inches="tight", pad_inches=0.05)
        paths.append(atomic_write_bytes(Path(folder) / f"{name}.{fmt}", buf.getvalue()))
    return paths
