"""What the depth memories learn: λ per layer (and over seeds), ω per layer, and per-layer profiles."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from harness.reporting.figures.common import (
    colour_limits,
    figure_grid,
    finish,
    integer_ticks,
    main_setting,
    panel_title,
    setting_note,
    shared_legend,
)
from harness.reporting.items import Context, NoData, figure
from harness.reporting.results import Run
from harness.reporting.tables import variant_order


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
    return by_variant, setting_note(candidates, shown)


@figure("lambda", needs="`depth_memory.lambda` in `summary.json` (LDM-RLS runs)")
def learned_lambda(ctx: Context) -> tuple[Figure, str]:
    """What the memory learned: the forgetting factor λ of every layer and group as a heatmap, one panel per
    variant (mean over seeds), on one colour scale unless their ranges differ widely."""
    by_variant, note = _depth_memory_runs(ctx, "lambda")
    order = variant_order(by_variant, ctx.ablation_reference)
    grids, dropped = {}, []
    for variant in order:
        mats = [np.asarray(r.summary["depth_memory"]["lambda"], dtype=float) for r in by_variant[variant]]
        same = [m for m in mats if m.ndim == 2 and m.shape == mats[0].shape]
        if len(same) < len(mats):
            dropped.append(variant)
        grids[variant] = np.mean(same, axis=0)
    limits = colour_limits(list(grids.values()))
    shared = len(set(limits)) == 1
    fig, axes = figure_grid(len(order), ncols=min(len(order), 4), panel_size=(3.8, 3.2))
    images = []
    for ax, variant, (vmin, vmax) in zip(axes, order, limits):
        if vmax - vmin < 1e-6:
            vmin, vmax = vmin - 0.01, vmax + 0.01
        g = grids[variant]  # (layers, groups)
        images.append(ax.imshow(g, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest"))
        ax.set(xlabel="group", ylabel="layer")
        panel_title(ax, variant)
        # The cells' centres are the whole numbers: a layer or group index, never 0.5.
        integer_ticks(ax.xaxis)
        integer_ticks(ax.yaxis)
    finish(fig)
    for image, ax in [(images[-1], list(axes))] if shared else zip(images, axes):
        bar = fig.colorbar(image, ax=ax, label="λ (forgetting factor)" if shared else "λ", shrink=0.9)
        bar.formatter.set_useOffset(False)  # λ near 1 reads as 0.99995, not as an offset
    caption = (
        "Learned forgetting factor λ per layer (rows) and memory group (columns) at the last validation, mean "
        "over seeds; "
        + ("one colour scale for all panels." if shared else "each panel its own colour scale (their ranges differ).")
        + note
    )
    if dropped:
        caption += f" Runs of another shape were left out for: {', '.join(dropped)}."
    return fig, caption


@figure("lambda_seeds", needs="`depth_memory.lambda` in `summary.json` (LDM-RLS runs that learn λ)")
def lambda_seeds(ctx: Context) -> tuple[Figure, str]:
    """How far λ moved, seed by seed: λ per layer (mean over memory groups), one line per seed, the band from the
    smallest to the largest value over seeds and groups, and the value every learned λ starts from."""
    from variants.ops.rls import LAMBDA_INIT  # imported here: it loads torch

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
    fig, axes = figure_grid(len(order), ncols=min(len(order), 4), panel_size=(3.8, 3.0))
    moved = 0.0
    for ax, variant in zip(axes, order):
        stack, seeds = stacks[variant]  # (seeds, layers, groups)
        layers = np.arange(stack.shape[1])
        ax.fill_between(layers, stack.min(axis=(0, 2)), stack.max(axis=(0, 2)), alpha=0.2, color="grey", linewidth=0)
        for seed, per_seed in zip(seeds, stack.mean(axis=2)):
            ax.plot(layers, per_seed, marker="o", markersize=3, linewidth=1, label=f"seed {seed}")
        ax.axhline(LAMBDA_INIT, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="layer", ylabel="λ")
        panel_title(ax, variant)
        ax.ticklabel_format(axis="y", useOffset=False)
        integer_ticks(ax.xaxis)
        moved = max(moved, float(np.abs(stack - LAMBDA_INIT).max()))
    shared_legend(fig, axes)
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
        fig, axes = figure_grid(1, panel_size=(5.6, 3.6))
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
        integer_ticks(ax.xaxis)
        shared_legend(fig, axes)
    caption = (
        "Importance weight ω per layer at the last validation: line, mean over tokens averaged over seeds; "
        "dark band, ± the standard deviation over tokens; light band, minimum to maximum over tokens and "
        "seeds." + note
    )
    return finish(fig), caption


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
        fig, axes = figure_grid(2)
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
            integer_ticks(ax.xaxis)
        shared_legend(fig, axes)
    caption = (
        "Per-layer output RMS and gradient norm at the last logged step (layers.csv); mean over seeds with "
        "a min–max band." + setting_note(candidates, shown)
    )
    return finish(fig), caption
