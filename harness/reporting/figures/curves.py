"""Validation loss against tokens, and the final loss of every variant."""

from __future__ import annotations

import math

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from harness.reporting.figures.common import figure_grid, finish, shared_legend, wrapped
from harness.reporting.items import Context, NoData, figure
from harness.reporting.tables import variant_order


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
        fig, axes = figure_grid(len(settings), ncols=min(len(settings), 4), panel_size=(5.2, 3.6))
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
            ax.set(xlabel="tokens", ylabel="validation loss", title=wrapped(setting or "validation loss", 40))
        shared_legend(fig, axes)
    caption = (
        "Validation loss against training tokens; line: mean over seeds, band: minimum to maximum over "
        "seeds. Finished runs only. Each panel has its own loss scale: settings of different sizes reach "
        "different losses."
    )
    return finish(fig), caption


@figure("final_loss", needs="`summary.json`")
def final_loss(ctx: Context) -> tuple[Figure, str]:
    """Final validation loss per variant with the main table's 95% t-intervals, one panel per setting."""
    main = ctx.table("main").data
    main = main[main["seeds"] > 0]
    if main.empty:
        raise NoData("no run finished with a final validation loss")
    settings = sorted(main["setting"].unique())
    with sns.axes_style("whitegrid"):
        fig, axes = figure_grid(
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
            ax.set(xlabel="final validation loss", title=wrapped(setting or "final validation loss"))
        # Panels are read side by side, so they share one loss scale.
        low, high = min(ax.get_xlim()[0] for ax in axes), max(ax.get_xlim()[1] for ax in axes)
        for ax in axes:
            ax.set_xlim(low, high)
    caption = (
        "Final validation loss, mean over seeds with the 95% t-interval (none drawn for a single seed); one loss "
        "scale for every panel."
    )
    return finish(fig), caption
