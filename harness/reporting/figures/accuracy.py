"""Downstream accuracy with intervals and the chance level."""

from __future__ import annotations

import math

import seaborn as sns
from matplotlib.figure import Figure

from harness.reporting.figures.common import figure_grid, finish
from harness.reporting.items import Context, figure


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
        fig, axes = figure_grid(len(panels), ncols=min(len(panels), 4), panel_size=(3.4, 0.42 * len(data) + 1.3))
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
    return finish(fig), caption
