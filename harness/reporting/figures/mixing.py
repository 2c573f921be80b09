"""Mixing matrices: how much each layer reads of every earlier one, averaged and per group."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from harness.reporting.figures.common import (
    colour_limits,
    figure_grid,
    finish,
    main_setting,
    panel_title,
    setting_note,
    wrapped,
)
from harness.reporting.items import Context, NoData, figure
from harness.reporting.results import Run, split_variant
from harness.reporting.tables import LDM_BASES, variant_order


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


MAX_TICKS = 12


def short_labels(names: list[str]) -> list[str]:
    """Readers and sources as tick labels: ``e`` the embedding, ``h`` the head, a layer or output by its number."""
    short = []
    for name in names:
        text = str(name)
        if text.startswith("embed"):
            short.append("e")
        elif text == "head":
            short.append("h")
        else:
            short.append(text.rsplit(" ", 1)[-1].lstrip("v"))
    return short


@figure("mixing", needs="`mixing.json`")
def mixing_matrices(ctx: Context) -> tuple[Figure, str]:
    """The depth-mixing matrix of every variant as a heatmap, averaged over seeds, one panel per variant,
    on one colour scale unless their ranges differ widely."""
    by_variant, candidates, shown = _mixing_runs(ctx, lambda r: isinstance(r.mixing.get("matrix"), list))
    if not by_variant:
        raise NoData("no finished run has a mixing.json with a matrix")
    order = variant_order(by_variant, ctx.baseline)
    matrices, skipped, signed = {}, [], []
    for variant in order:
        runs = sorted(by_variant[variant], key=lambda r: r.seed)
        # The mean magnitude where every run recorded it: a memory read's weight k_iᵀq changes sign from token to
        # token, so its signed mean can be near zero for a source that every token reads with weight of order one.
        key = "matrix_abs" if all(isinstance(r.mixing.get("matrix_abs"), list) for r in runs) else "matrix"
        if key == "matrix":
            signed.append(variant)
        matrices[variant], dropped = _mean_same_shape([np.asarray(r.mixing[key], dtype=float) for r in runs])
        if dropped:
            skipped.append(variant)
    shown_cells = [
        m[np.tril_indices(m.shape[0], 0, m.shape[1])] if m.shape[0] == m.shape[1] else m.ravel()
        for m in matrices.values()
    ]
    # Hyper-connection weights reach 4 where a depth memory's stay below 1: then each panel keeps its own scale.
    limits = colour_limits(shown_cells)
    shared = len(set(limits)) == 1
    fig, axes = figure_grid(len(order), ncols=min(len(order), 4), panel_size=(4.0, 3.4))
    for i, (ax, variant, (vmin, vmax)) in enumerate(zip(axes, order, limits)):
        matrix = matrices[variant]  # (readers, sources)
        first = by_variant[variant][0].mixing
        readers, sources = first.get("readers"), first.get("sources")
        frame = pd.DataFrame(
            matrix,
            index=short_labels(readers) if readers and len(readers) == matrix.shape[0] else None,
            columns=short_labels(sources) if sources and len(sources) == matrix.shape[1] else None,
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
            cbar=not shared or i == len(order) - 1,
            cbar_kws={
                "label": ("mixing weight" if variant in signed else "mean |mixing weight|")
                + (" (shared scale)" if shared else "")
            },
            # At most about a dozen labels per axis, whatever the depth, so they never run into each other.
            xticklabels=max(1, math.ceil(matrix.shape[1] / MAX_TICKS)),
            yticklabels=max(1, math.ceil(matrix.shape[0] / MAX_TICKS)),
        )
        ax.tick_params(labelsize=7, labelrotation=0)
        ax.set(xlabel="source (e: embedding, n: output of layer n)", ylabel="reader (h: head)")
        panel_title(ax, variant)
    caption = (
        "Depth-mixing matrices: entry (reader, source) is the magnitude of the weight with which a layer's input "
        "(or the head's) contains the embedding or an earlier layer's output, averaged over tokens, memory groups "
        "and seeds (each run's mixing.json also keeps the signed mean, `matrix`, which cancels towards zero where "
        "the weight's sign changes from token to token); "
        + ("one colour scale for all panels." if shared else "each panel its own colour scale (their ranges differ).")
        + setting_note(candidates, shown)
    )
    if signed:
        caption += f" Runs that recorded only the signed mean show it for: {', '.join(signed)}."
    if skipped:
        caption += f" Runs whose matrix shape differs were left out for: {', '.join(skipped)}."
    return finish(fig), caption


MAX_GROUP_PANELS = 16


@figure("mixing_groups", needs="`mixing.json` with `per_group` (LDM and LDM-RLS runs)")
def mixing_groups(ctx: Context) -> tuple[Figure, str]:
    """The depth-mixing matrix of every memory group of LDM and LDM-RLS (at their default knobs, and the ablation
    reference), the groups of each variant in a block of at most four columns, averaged over seeds, on one colour
    scale unless the variants' ranges differ widely."""
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
    shown_groups = {v: min(MAX_GROUP_PANELS, stacks[v].shape[0]) for v in order}
    cols = min(4, math.ceil(math.sqrt(max(shown_groups.values()))))
    # Each variant starts a row of its own; its groups wrap into a near-square block of at most four columns.
    rows = {v: math.ceil(shown_groups[v] / cols) for v in order}
    fig, axes = figure_grid(sum(rows.values()) * cols, ncols=cols, panel_size=(2.4, 2.4))
    limits = dict(zip(order, colour_limits([stacks[v] for v in order])))
    shared = len(set(limits.values())) == 1
    first_slot, bars = 0, []
    for variant in order:
        stack, slots = stacks[variant], axes[first_slot : first_slot + rows[variant] * cols]
        first_slot += len(slots)
        for g, ax in enumerate(slots):
            if g >= shown_groups[variant]:
                ax.set_axis_off()
                continue
            _group_panel(ax, stack[g], limits[variant], f"{variant} g{g}" if g == 0 else f"g{g}")
        drawn = [a for a in slots if a.images]
        bars.append((drawn[0].images[0], drawn))
    finish(fig)
    for image, panels in [(bars[0][0], list(axes))] if shared else bars:
        fig.colorbar(image, ax=panels, label="mixing weight" + (" (shared scale)" if shared else ""), shrink=0.8)
    caption = (
        "Per-group depth-mixing matrices of the linear depth memory: in each panel rows are readers (layer "
        "indices, the last row the head) and columns sources (0 the embedding, n the output of layer n − 1), "
        "averaged over tokens and seeds; "
        + ("one colour scale for all panels." if shared else "one colour scale per variant (their ranges differ).")
    )
    over = [v for v in order if stacks[v].shape[0] > MAX_GROUP_PANELS]
    if over:
        caption += f" Only the first {MAX_GROUP_PANELS} groups are drawn for: {', '.join(over)}."
    return fig, caption + setting_note(candidates, shown)


def _group_panel(ax, matrix: np.ndarray, limits: tuple[float, float], title: str) -> None:
    """One group's matrix, the cells above the diagonal (sources a reader cannot see) left blank, ticks at whole
    cell indices."""
    if matrix.shape[0] == matrix.shape[1]:
        matrix = np.where(np.triu(np.ones(matrix.shape, dtype=bool), k=1), np.nan, matrix)
    ax.imshow(matrix, cmap="mako", vmin=limits[0], vmax=limits[1], interpolation="nearest")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    ax.tick_params(labelsize=7)
    ax.set_title(wrapped(title, 24), fontsize=8)
