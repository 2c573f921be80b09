"""LDM and LDM-RLS ablations: each knob's change against the ablation reference, and the grid over groups, λ and ω."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from harness.reporting.figures.common import (
    figure_grid,
    finish,
    interval_text,
    main_setting,
    setting_note,
    sort_key,
    wrapped,
)
from harness.reporting.items import Context, NoData, figure
from harness.reporting.results import Run, split_variant
from harness.reporting.stats import compare

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
        if "write" in changed:
            # One side writes outer products, for which λ, ω, α and their gain mean nothing: the write is the change.
            from variants.ops.ldm_knobs import RLS_ONLY  # imported here: it loads torch

            changed = {k: v for k, v in changed.items() if k not in RLS_ONLY}
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
        fig, axes = figure_grid(len(axes_order), ncols=min(len(axes_order), 4), panel_size=(3.6, 0.5 * tallest + 1.4))
        for ax, axis in zip(axes, axes_order):
            sub = frame[frame["axis"] == axis].sort_values("value", key=lambda v: v.map(sort_key))
            sub = sub.reset_index(drop=True)
            for i, row in sub.iterrows():
                err = None if math.isnan(row["low"]) else [[row["delta"] - row["low"]], [row["high"] - row["delta"]]]
                ax.errorbar(
                    row["delta"], i, xerr=err, fmt="o", capsize=3, color=ctx.colours.get(row["variant"], "black")
                )
            ax.axvline(0.0, color="0.3", lw=0.8, ls="--")
            ax.set_yticks(range(len(sub)), sub["value"])
            ax.invert_yaxis()
            ax.set(xlabel=f"Δ loss vs {reference}", title=wrapped(" + ".join(knob_label(k) for k in axis.split(" + "))))
            # Four ticks at most: signed differences like −0.004 are wide labels.
            ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
    methods = sorted(set(frame["method"]))
    caption = (
        f"Ablations against {reference}, one panel per knob the sweep changes: "
        f"Δ final validation loss (variant − {reference}; negative is better) with its 95% interval: "
        f"{'; '.join(interval_text(m) for m in methods)}. Dashed line: no difference."
        + (f" Setting: {shown}." if shown else "")
    )
    return finish(fig), caption


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
    omegas = sorted(cells["omega"].unique(), key=sort_key)
    rows = sorted(cells["groups"].unique(), key=sort_key)
    cols = sorted(cells["lambda"].unique(), key=sort_key)
    vmin, vmax = cells["val_loss"].min(), cells["val_loss"].max()
    fig, axes = figure_grid(len(omegas), panel_size=(1.1 * len(cols) + 2.2, 0.6 * len(rows) + 1.6))
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
        f"scale); blank cells were not run." + setting_note(runs, shown)
    )
    return finish(fig), caption
