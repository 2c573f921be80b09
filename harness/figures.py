"""The paper's figures, drawn with seaborn on matplotlib's Agg canvas from a loaded sweep.

Each figure function returns ``(figure, caption)`` or raises ``NoData`` with the reason a figure cannot be
drawn, which the report prints instead of failing. Figures are built without pyplot (``Figure`` with an Agg
canvas), so no global backend or state changes and nothing needs closing. Every variant keeps one colour in
every figure: ``palette`` assigns colours in sorted name order. ``save_figure`` writes PNG and PDF with fixed
metadata (no timestamps, no software version in the PNG), atomically, so the same inputs give the same bytes.
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

from harness.results import Run, Sweep
from harness.io import atomic_write_bytes
from harness.tables import variant_order

FIGURES = ("loss_curves", "final_loss", "ablation_grid", "layers", "mixing", "downstream", "overhead")
ABLATION_AXES = ("groups", "lambda", "omega")
DPI = 150


class NoData(Exception):
    """A figure that cannot be drawn from this sweep; the message says why."""


def palette(variants) -> dict[str, str]:
    """One fixed colour per variant, assigned in sorted name order (tab10, or husl beyond ten variants)."""
    names = sorted(set(variants))
    colours = sns.color_palette("tab10" if len(names) <= 10 else "husl", max(len(names), 1)).as_hex()
    return dict(zip(names, colours))


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
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", frameon=False)


def _sort_key(text: str):
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


# -- figures -----------------------------------------------------------------------------------------------

def loss_curves(sweep: Sweep, colours: dict[str, str], baseline: str = "preln") -> tuple[Figure, str]:
    """Validation loss against tokens: mean over seeds with a min–max band, one panel per setting."""
    rows = []
    for run in sweep.finished():
        m = run.metrics
        if m is None or not {"tokens", "val_loss"} <= set(m.columns):
            continue
        m = m.dropna(subset=["tokens", "val_loss"])
        rows += [{"setting": run.setting, "variant": run.variant, "seed": run.seed, "tokens": float(t),
                  "val_loss": float(v)} for t, v in zip(m["tokens"], m["val_loss"])]
    if not rows:
        raise NoData("no finished run logged val_loss with tokens in metrics.csv")
    frame = pd.DataFrame(rows)
    settings = sorted(frame["setting"].unique())
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(len(settings), panel_size=(5.2, 3.6))
        for ax, setting in zip(axes, settings):
            sub = frame[frame["setting"] == setting]
            order = variant_order(sub["variant"], baseline)
            sns.lineplot(data=sub, x="tokens", y="val_loss", hue="variant", hue_order=order, palette=colours,
                         estimator="mean", errorbar=("pi", 100), ax=ax)
            ax.set(xlabel="tokens", ylabel="validation loss", title=setting or "validation loss")
        _shared_legend(fig, axes)
    caption = ("Validation loss against training tokens; line: mean over seeds, band: minimum to maximum over "
               "seeds. Finished runs only.")
    return _finish(fig), caption


def final_loss(main: pd.DataFrame, colours: dict[str, str]) -> tuple[Figure, str]:
    """Final validation loss per variant with its 95% t-interval (the main table's numbers)."""
    main = main[main["seeds"] > 0]
    if main.empty:
        raise NoData("no run finished with a final validation loss")
    settings = sorted(main["setting"].unique())
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(len(settings), panel_size=(4.8, 0.45 * main.groupby("setting").size().max() + 1.2))
        for ax, setting in zip(axes, settings):
            sub = main[main["setting"] == setting].reset_index(drop=True)
            for i, row in sub.iterrows():
                half = 0.0 if math.isnan(row["val_loss_ci95"]) else row["val_loss_ci95"]
                ax.errorbar(row["val_loss"], i, xerr=half, fmt="o", color=colours[row["variant"]], capsize=3)
            ax.set_yticks(range(len(sub)), sub["variant"])
            ax.invert_yaxis()
            ax.set(xlabel="final validation loss", title=setting or "final validation loss")
    caption = "Final validation loss, mean over seeds with the 95% t-interval (none drawn for a single seed)."
    return _finish(fig), caption


def ablation_grid(sweep: Sweep, base: str = "ldm-rls") -> tuple[Figure, str]:
    """Mean final loss over the groups × λ grid, one heatmap per ω, for runs varying only those knobs."""
    runs = [r for r in sweep.finished() if r.base == base and set(r.knobs) <= set(ABLATION_AXES)]
    if not runs:
        raise NoData(f"no finished {base} run varies only {', '.join(ABLATION_AXES)}")
    shown = main_setting(runs)
    runs = [r for r in runs if r.setting == shown]
    frame = pd.DataFrame([{**{k: r.knob_values.get(k, "default") for k in ABLATION_AXES},
                           "val_loss": r.final_loss} for r in runs])
    cells = frame.groupby(list(ABLATION_AXES), as_index=False)["val_loss"].mean()
    if len(cells) < 2:
        raise NoData(f"the {base} runs cover a single knob setting, so there is no grid to show")
    omegas = sorted(cells["omega"].unique(), key=_sort_key)
    rows = sorted(cells["groups"].unique(), key=_sort_key)
    cols = sorted(cells["lambda"].unique(), key=_sort_key)
    vmin, vmax = cells["val_loss"].min(), cells["val_loss"].max()
    fig, axes = _figure(len(omegas), panel_size=(1.1 * len(cols) + 2.2, 0.6 * len(rows) + 1.6))
    for i, (ax, omega) in enumerate(zip(axes, omegas)):
        grid = (cells[cells["omega"] == omega].pivot(index="groups", columns="lambda", values="val_loss")
                .reindex(index=rows, columns=cols))
        sns.heatmap(grid, ax=ax, annot=True, fmt=".3f", cmap="viridis_r", vmin=vmin, vmax=vmax,
                    cbar=i == len(omegas) - 1, cbar_kws={"label": "final val loss"})
        ax.tick_params(axis="y", labelrotation=0)
        ax.set(xlabel="λ (lambda)", ylabel="groups G", title=f"ω (omega) = {omega}")
    caption = (f"Mean final validation loss of {base} over the knob grid (groups × λ, one panel per ω); blank "
               f"cells were not run; 'default' is the variant's default value." + _setting_note(runs, shown))
    return _finish(fig), caption


def layer_profiles(sweep: Sweep, colours: dict[str, str], baseline: str = "preln") -> tuple[Figure, str]:
    """Per-layer output RMS and gradient norm against depth at each run's last logged step."""
    candidates = [r for r in sweep.finished() if r.layers is not None and {"step", "layer"} <= set(r.layers)]
    if not candidates:
        raise NoData("no finished run has a layers.csv")
    shown = main_setting(candidates)
    rows = []
    for run in candidates:
        if run.setting != shown:
            continue
        last = run.layers[run.layers["step"] == run.layers["step"].max()]
        for rec in last.to_dict("records"):
            rows.append({"variant": run.variant, "seed": run.seed, "layer": rec["layer"],
                         "output_rms": rec.get("output_rms", math.nan), "grad_norm": rec.get("grad_norm", math.nan)})
    frame = pd.DataFrame(rows)
    order = variant_order(frame["variant"], baseline)
    with sns.axes_style("whitegrid"):
        fig, axes = _figure(2)
        for ax, column, label in zip(axes, ("output_rms", "grad_norm"), ("output RMS", "gradient norm")):
            sns.lineplot(data=frame, x="layer", y=column, hue="variant", hue_order=order, palette=colours,
                         marker="o", errorbar=("pi", 100), ax=ax)
            ax.set(xlabel="layer", ylabel=label, title=f"{label} by depth")
            if frame[column].dropna().gt(0).all() and not frame[column].dropna().empty:
                ax.set_yscale("log")
        _shared_legend(fig, axes)
    caption = ("Per-layer output RMS and gradient norm at the last logged step (layers.csv); mean over seeds with "
               "a min–max band." + _setting_note(candidates, shown))
    return _finish(fig), caption


def mixing_matrices(sweep: Sweep, baseline: str = "preln") -> tuple[Figure, str]:
    """The depth-mixing matrix of every variant as a heatmap, averaged over seeds, one panel per variant."""
    candidates = [r for r in sweep.finished() if r.mixing and isinstance(r.mixing.get("matrix"), list)]
    if not candidates:
        raise NoData("no finished run has a mixing.json with a matrix")
    shown = main_setting(candidates)
    by_variant: dict[str, list[Run]] = {}
    for run in candidates:
        if run.setting == shown:
            by_variant.setdefault(run.variant, []).append(run)
    order = variant_order(by_variant, baseline)
    fig, axes = _figure(len(order), ncols=min(len(order), 4), panel_size=(4.0, 3.4))
    skipped = []
    for ax, variant in zip(axes, order):
        runs = sorted(by_variant[variant], key=lambda r: r.seed)
        matrices = [np.asarray(r.mixing["matrix"], dtype=float) for r in runs]
        same = [m for m in matrices if m.shape == matrices[0].shape]
        if len(same) < len(matrices):
            skipped.append(variant)
        matrix = np.mean(same, axis=0)  # (readers, sources)
        readers, sources = runs[0].mixing.get("readers"), runs[0].mixing.get("sources")
        frame = pd.DataFrame(matrix,
                             index=readers if readers and len(readers) == matrix.shape[0] else None,
                             columns=sources if sources and len(sources) == matrix.shape[1] else None)
        # Reader l sees only the embedding and outputs before it: the cells above the diagonal do not exist.
        mask = np.triu(np.ones(matrix.shape, dtype=bool), k=1) if matrix.shape[0] == matrix.shape[1] else None
        sns.heatmap(frame, ax=ax, mask=mask, cmap="mako", square=True, cbar=True)
        ax.set(xlabel="source", ylabel="reader", title=variant)
    caption = ("Depth-mixing matrices: entry (reader, source) is the weight with which a layer's input (or the "
               "head's) contains the embedding or an earlier layer's output, averaged over tokens and seeds."
               + _setting_note(candidates, shown))
    if skipped:
        caption += f" Runs whose matrix shape differs were left out for: {', '.join(skipped)}."
    return _finish(fig), caption


def downstream_heatmap(downstream: pd.DataFrame, tasks: list[str]) -> tuple[Figure, str]:
    """Downstream accuracy (percent) as a variant × task heatmap, with the average as the last column."""
    if downstream is None or downstream.empty or not tasks:
        raise NoData("no finished run has downstream results (eval/table.csv) with acc or acc_norm")
    index = [f"{v} [{s}]" if s else v for s, v in zip(downstream["setting"], downstream["variant"])]
    grid = pd.DataFrame(100 * downstream[[*tasks, "average"]].to_numpy(dtype=float), index=index,
                        columns=[*tasks, "average"])
    fig, axes = _figure(1, panel_size=(1.0 * len(grid.columns) + 3.0, 0.5 * len(grid) + 1.6))
    sns.heatmap(grid, ax=axes[0], annot=True, fmt=".1f", cmap="crest", cbar_kws={"label": "accuracy (%)"})
    axes[0].set(xlabel="task", ylabel="variant", title="downstream accuracy (%)")
    caption = "Downstream accuracy in percent (acc_norm where the task reports it, else acc), mean over seeds."
    return _finish(fig), caption


def overhead(bench: pd.DataFrame, colours: dict[str, str], baseline: str = "preln") -> tuple[Figure, str]:
    """Step time and peak memory relative to the baseline against depth, from the benchmark CSV."""
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
            sns.lineplot(data=frame, x="depth", y=column, hue="variant", hue_order=order, palette=colours,
                         marker="o", errorbar=None, ax=ax)
            ax.set(xlabel="depth (layers)", ylabel=f"{label} / {baseline}", title=f"{label} overhead")
        _shared_legend(fig, axes)
    caption = f"Measured overhead relative to {baseline} against depth (width {width}, sequence length {seq_len})."
    if len(sizes) > 1:
        caption += " Other sizes are in the benchmark table."
    return _finish(fig), caption


def save_figure(fig: Figure, folder: Path, name: str) -> list[Path]:
    """Write ``<name>.png`` and ``<name>.pdf`` atomically with fixed metadata, so reruns give the same bytes."""
    paths = []
    for fmt, metadata in (("png", {"Software": None}), ("pdf", {"CreationDate": None, "ModDate": None})):
        buf = io.BytesIO()
        # A tight box keeps colorbar labels that the layout engine leaves at the edge.
        fig.savefig(buf, format=fmt, dpi=DPI, metadata=metadata, bbox_inches="tight", pad_inches=0.05)
        paths.append(atomic_write_bytes(Path(folder) / f"{name}.{fmt}", buf.getvalue()))
    return paths
