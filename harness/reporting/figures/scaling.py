"""Figures along a numeric axis: hyperparameters, depth, and the compute frontier."""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from harness.reporting import frontier as fr
from harness.reporting.figures.common import dodged, dodged_errorbar, figure_grid, finish, shared_legend
from harness.reporting.items import Context, NoData, figure
from harness.reporting.results import Run, Sweep
from harness.reporting.stats import mean_ci
from harness.reporting.tables import variant_order

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
    """One line per variant through the mean at each x, with the 95% t-interval as error bars; variants are set
    side by side on screen so their bars at one x never cover each other."""
    order = variant_order(frame["variant"], baseline)
    for variant, transform in zip(order, dodged(ax, len(order))):
        sub = frame[frame["variant"] == variant]
        stats_rows = [(x, *mean_ci(g["loss"])) for x, g in sub.groupby("x")]
        xs, means, halves = zip(*((r[0], r[1], r[2]) for r in stats_rows))
        colour = colours.get(variant, "black")
        dodged_errorbar(ax, transform, xs, means, halves, marker="o", capsize=3, color=colour, label=variant)
    ax.autoscale_view()


def _held_text(held: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in held.items())


RATE_KEYS = {"lr", "learning_rate", "min_lr_ratio", "weight_decay"}


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
        fig, axes = figure_grid(len(slices), ncols=min(len(slices), 3), panel_size=(4.4, 3.4))
        for ax, (name, (frame, held)) in zip(axes, slices.items()):
            xs = sorted(frame["x"].unique())
            # Learning rates are compared by ratio, as is any axis spanning more than a factor of ten.
            rate = ctx.sweep.axis_keys.get(name, name).rsplit(".", 1)[-1] in RATE_KEYS
            log = bool(xs and xs[0] > 0 and (rate or xs[-1] / xs[0] > 10))
            _lines_with_intervals(ax, frame, ctx.colours, ctx.baseline)
            if log:
                ax.set_xscale("log")
            elif all(float(x).is_integer() for x in xs):
                ax.set_xticks(xs)  # a count (width, blocks): ticks at the values run, never between them
            ax.set(xlabel=name, ylabel="final validation loss", title=name)
            if held:
                held_texts.append(f"{name}: {_held_text(held)}")
        shared_legend(fig, axes)
    caption = (
        "Final validation loss against each numeric axis of the grid; points: mean over seeds with the 95% "
        "t-interval (none for one seed); variants at one value are set side by side."
    )
    if held_texts:
        caption += " Held fixed per panel — " + "; ".join(held_texts) + "."
    return finish(fig), caption


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
        fig, axes = figure_grid(1, panel_size=(5.4, 3.8))
        _lines_with_intervals(axes[0], frame, ctx.colours, ctx.baseline)
        axes[0].set_xticks(sorted(frame["x"].unique()))
        axes[0].set(xlabel="depth (layers: 2 × blocks)", ylabel="final validation loss", title="depth scaling")
        shared_legend(fig, axes)
    caption = (
        "Final validation loss against depth; mean over seeds with the 95% t-interval (none for one seed); "
        "variants at one depth are set side by side."
    )
    if held:
        caption += f" Held fixed: {_held_text(held)}."
    return finish(fig), caption


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
        fig, axes = figure_grid(1, panel_size=(6.4, 4.4))
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
        shared_legend(fig, axes)
    caption = (
        f"Final validation loss against training compute (3 × forward FLOPs per token × tokens) for every "
        f"model size trained at {result.budget_text}, variants with two sizes or more; dots: runs, "
        f"diamonds: mean over seeds per size, "
        f"lines: L = a·C^(−b) fitted per variant in log–log space. The compute multipliers are in the "
        f"compute_multiplier table."
    )
    return finish(fig), caption
