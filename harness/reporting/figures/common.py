"""What every figure shares: fixed variant colours, panel grids, the setting note, shared legends and saving
with fixed metadata.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import ScaledTranslation

from harness.io import atomic_write_bytes
from harness.reporting.results import Run

DPI = 150
MAX_COLUMNS = 4


# tab20's ten strong hues, then its ten light ones: 20 colours that differ in hue or lightness.
_STRONG = sns.color_palette("tab20", 20).as_hex()[0::2]
_LIGHT = sns.color_palette("tab20", 20).as_hex()[1::2]
QUALITATIVE = _STRONG + _LIGHT


def palette(variants) -> dict[str, str]:
    """One fixed colour per variant: a registered variant at its defaults takes the colour of its place in the
    registry (PreLN the first tab10 colour); every other name (knob settings, unknown variants) the next free colours
    in sorted name order. The first 20 names are told apart by tab20's hues and lightness, more by husl colours."""
    try:
        # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
        import variants as registry

        order = registry.names()
    except Exception:  # a variant module mid-edit must not stop a report
        order = []
    names_ = sorted(set(variants))
    others = [n for n in names_ if n not in order]
    pool = QUALITATIVE + sns.husl_palette(max(len(order) + len(others) - len(QUALITATIVE), 1), l=0.55).as_hex()
    colours = {n: pool[order.index(n)] for n in names_ if n in order}
    colours.update(zip(others, pool[len(order) :]))
    return colours


def figure_grid(n_panels: int, *, ncols: int | None = None, panel_size=(4.2, 3.2)) -> tuple[Figure, np.ndarray]:
    # Wider than four panels a figure turns into a strip that reads only when zoomed.
    ncols = min(ncols or n_panels, MAX_COLUMNS)
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


def shared_legend(fig: Figure, axes, *, title: str | None = None) -> None:
    """One legend for the figure, below the panels and outside them, instead of one per panel; the figure grows by
    the legend's height, so the panels keep their size."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    finish(fig)  # "outside" legend placement needs the constrained layout
    if not seen:
        return
    width, height = fig.get_size_inches()
    # About 0.075 in per character at the legend's font size, plus the handle and the gap between columns.
    column = 0.075 * max(len(label) for label in seen) + 0.8
    ncols = max(1, min(len(seen), int(width // column)))
    rows = math.ceil(len(seen) / ncols)
    fig.set_size_inches(width, height + 0.25 * rows + (0.45 if title else 0.25))
    fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncols=ncols, frameon=False, title=title)


def wrapped(text: str, width: int = 32) -> str:
    """A panel title broken into lines of at most ``width`` characters (after a space or a comma, so a knob
    setting stays whole), so neighbouring titles never touch."""
    lines = [""]
    for piece in re.split(r"(?<=[, ])", str(text)):
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(line.rstrip() for line in lines)


def panel_title(ax, text: str, chars: int = 30) -> None:
    """A variant's name as the panel title, in a smaller font when it is long, so it stays one readable name that
    does not run into the next panel's."""
    size = 12 if len(text) <= chars else max(7.0, 12 * chars / len(text))
    ax.set_title(text, fontsize=size)


def integer_ticks(axis) -> None:
    """Ticks only at whole numbers, for axes that count (layers, blocks, groups)."""
    axis.set_major_locator(MaxNLocator(integer=True))


def colour_limits(arrays) -> list[tuple[float, float]]:
    """The colour limits of each heatmap panel: one shared scale when every panel spans at least a quarter of the common
    range, else each panel its own, so a panel of small values is not washed into one flat colour."""
    spans = [(float(np.nanmin(a)), float(np.nanmax(a))) for a in arrays]
    low, high = min(s[0] for s in spans), max(s[1] for s in spans)
    if all(hi - lo >= 0.25 * (high - low) for lo, hi in spans):
        return [(low, high)] * len(spans)
    return spans


def dodged(ax, n: int, points: float = 5.0) -> list:
    """Transforms that set ``n`` series side by side, ``points`` apart on screen, so error bars at one x never
    cover each other; the data keep their true x values, on a linear or a log axis alike."""
    fig = ax.get_figure()
    shifts = (np.arange(n) - (n - 1) / 2) * min(points, 40.0 / max(n, 1))
    return [ax.transData + ScaledTranslation(dx / 72, 0, fig.dpi_scale_trans) for dx in shifts]


def dodged_errorbar(ax, transform, x, y, half, **kwargs):
    """``ax.errorbar`` of means ``y`` ± ``half`` (NaN: no bar; a pair of rows: below and above) at ``x``, drawn with
    a ``dodged`` transform; the data limits are widened by hand, which artists on a shifted transform do not do
    (call ``ax.autoscale_view()`` once every series is drawn)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    err = np.nan_to_num(np.asarray(half, dtype=np.float64))
    below, above = (err[0], err[1]) if err.ndim == 2 else (err, err)
    bars = ax.errorbar(x, y, yerr=err, transform=transform, **kwargs)
    ax.update_datalim(np.column_stack([np.r_[x, x], np.r_[y - below, y + above]]))
    return bars


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
