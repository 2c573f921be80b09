"""Measured overhead against the baseline, from the benchmark."""

from __future__ import annotations

import seaborn as sns
from matplotlib.figure import Figure

from harness.reporting.figures.common import figure_grid, finish, shared_legend
from harness.reporting.items import Context, NoData, figure
from harness.reporting.tables import variant_order


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
        fig, axes = figure_grid(2)
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
        shared_legend(fig, axes)
    caption = f"Measured overhead relative to {baseline} against depth (width {width}, sequence length {seq_len})."
    if len(sizes) > 1:
        caption += " Other sizes are in the benchmark table."
    return finish(fig), caption
