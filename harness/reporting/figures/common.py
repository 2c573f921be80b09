"""What every figure shares: fixed variant colours, panel grids, the setting note, shared legends and saving
with fixed metadata.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.io import atomic_write_bytes
from harness.reporting.results import Run

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


def figure_grid(n_panels: int, *, ncols: int | None = None, panel_size=(4.2, 3.2)) -> tuple[Figure, np.ndarray]:
    ncols = ncols or n_panels
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), layout="constrained")
    # Paused until the figure is complete (``finish``): seaborn's heatmap draws the whole figure to check tick
    # overlap, and a constrained layout on each of those draws costs seconds. The placeholder keeps colorbars
    # made the constrained way, so switching back is allowed.
    fig.set_layout_engine("none")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[n_panels:]:
        fig.delaxes(ax)
    return fig, axes[:n_panels]


def finish(fig: Figure) -> Figure:
    fig.set_layout_engine("constrained")
    return fig


def main_setting(runs: list[Run]) -> str:
    """The setting with the most runs (ties by name): the one panel-per-variant figures show."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.setting] = counts.get(run.setting, 0) + 1
    return sorted(counts, key=lambda s: (-counts[s], s))[0] if counts else ""


def setting_note(runs: list[Run], shown: str) -> str:
    others = sorted({r.setting for r in runs} - {shown})
    return f" Setting shown: {shown}; not shown: {'; '.join(others)}." if others else ""


def shared_legend(fig: Figure, axes) -> None:
    """One legend for the figure, right of the panels, instead of one per panel."""
    finish(fig)  # "outside" legend placement needs the constrained layout
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside right upper", frameon=False)


def sort_key(text: str):
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def interval_text(method: str) -> str:
    return {
        "paired t": "paired t-interval over shared seeds",
        "Welch": "Welch interval (seeds not shared)",
        "one seed": "no interval (one seed)",
    }.get(method, method)


def save_figure(fig: Figure, folder: Path, name: str) -> list[Path]:
    """Write ``<name>.png`` and ``<name>.pdf`` atomically with fixed metadata, so reruns give the same bytes."""
    paths = []
    for fmt, metadata in (("png", {"Software": None}), ("pdf", {"CreationDate": None, "ModDate": None})):
        buf = io.BytesIO()
        # A tight box keeps colorbar labels that the layout engine leaves at the edge.
        fig.savefig(buf, format=fmt, dpi=DPI, metadata=metadata, bbox_inches="tight", pad_inches=0.05)
        paths.append(atomic_write_bytes(Path(folder) / f"{name}.{fmt}", buf.getvalue()))
    return paths
