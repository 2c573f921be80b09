"""What a benchmark run writes: the growth fits of extra cost against ``L``, ``d`` and ``T``, the printed table,
the overhead plot and the files.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

from harness.benchmarks.reference import BASELINE
from harness.io import atomic_write_bytes, atomic_write_json, atomic_write_text

AXES = (("depth", "L"), ("width", "d"), ("seq_len", "T"))


def _fit_exponents(rows, column: str) -> tuple[dict[str, float], int]:
    """Least-squares exponents of ``column`` against the varied axes on log-log scales (positive values only)."""
    import numpy as np

    varied = [axis for axis, _ in AXES if rows[axis].nunique() > 1]
    usable = rows[rows[column] > 0]
    if not varied or len(usable) < len(varied) + 1:
        return {axis: math.nan for axis, _ in AXES}, len(usable)
    x = np.column_stack([np.ones(len(usable))] + [np.log(usable[a].to_numpy(float)) for a in varied])
    y = np.log(usable[column].to_numpy(float))
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    fitted = dict(zip(varied, coef[1:]))
    return {axis: float(fitted.get(axis, math.nan)) for axis, _ in AXES}, len(usable)


def scaling(df):
    """Per variant, exponents ``a`` with extra cost ∝ L^a_L · d^a_d · T^a_T, fitted log-log over the grid."""
    import pandas as pd

    out = []
    for name, rows in df[df["variant"] != BASELINE].groupby("variant", sort=False):
        t_exp, n_t = _fit_exponents(rows, "extra_time_ms")
        m_exp, n_m = _fit_exponents(rows, "extra_mem_bytes")
        row = {"variant": name, "points": len(rows), "time_points": n_t, "mem_points": n_m}
        row.update({f"time_exp_{a}": v for a, v in t_exp.items()})
        row.update({f"mem_exp_{a}": v for a, v in m_exp.items()})
        out.append(row)
    columns = ["variant", "points", "time_points", "mem_points"] + [
        f"{k}_exp_{a}" for k in ("time", "mem") for a, _ in AXES
    ]
    return pd.DataFrame(out, columns=columns)


def scaling_lines(fits) -> list[str]:
    """One sentence per variant: how its extra time and extra memory grow with L, d and T."""

    def law(row, kind):
        parts = [
            f"{sym}^{row[f'{kind}_exp_{axis}']:.2f}" for axis, sym in AXES if not math.isnan(row[f"{kind}_exp_{axis}"])
        ]
        return " · ".join(parts) if parts else "n/a (needs two values of an axis and a positive extra cost)"

    return [
        f"{row['variant']}: extra time ∝ {law(row, 'time')}; extra memory ∝ {law(row, 'mem')}"
        for _, row in fits.iterrows()
    ]


def format_table(df) -> str:
    """The measurements as a fixed-width table with the analytic floor and the target beside each ratio."""
    view = df.assign(
        peak_mem_MiB=df["peak_mem_bytes"] / 2**20,
        state_B_per_tok=df["floor_state_bytes_per_token"],
    )[
        [
            "variant",
            "depth",
            "width",
            "seq_len",
            "step_time_ms",
            "tokens_per_s",
            "peak_mem_MiB",
            "ratio_time",
            "ratio_time_iqr",
            "ratio_mem",
            "floor_time_ratio",
            "state_B_per_tok",
            "target",
            "met",
            "ref_impl",
            "ratio_time_vs_ref",
            "ratio_mem_vs_ref",
            "vs_ref",
        ]
    ]
    return view.to_string(index=False, float_format=lambda x: f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}")


AXIS_LABELS = {"depth": "depth L", "width": "width d", "seq_len": "sequence length T"}


AXIS_SYMBOLS = {"depth": "L", "width": "d", "seq_len": "T"}


def plot_axis(df) -> str:
    """The grid axis a plot runs along: depth when it varies (or when nothing does), else width, else T."""
    for axis in ("depth", "width", "seq_len"):
        if df[axis].nunique() > 1:
            return axis
    return "depth"


def plot_overhead(df, path: str | os.PathLike) -> Path:
    """Ratio to PreLN (time and memory) against the varying axis (``plot_axis``), one line per variant, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    axis = plot_axis(df)
    long = df.melt(
        id_vars=["variant", "depth", "width", "seq_len"],
        value_vars=["ratio_time", "ratio_mem"],
        var_name="metric",
        value_name="ratio to preln",
    )
    others = [a for a in AXIS_SYMBOLS if a != axis]  # the fixed axes label each line's shape, e.g. "d=256, T=128"
    long["shape"] = long.apply(lambda r: ", ".join(f"{AXIS_SYMBOLS[a]}={r[a]}" for a in others), axis=1)
    several = long["shape"].nunique() > 1
    grid = sns.relplot(
        data=long,
        x=axis,
        y="ratio to preln",
        hue="variant",
        col="metric",
        kind="line",
        marker="o",
        style="shape" if several else None,
        height=3.6,
        aspect=1.2,
        facet_kws={"sharey": False},
    )
    grid.set_titles("{col_name}")
    values = sorted(df[axis].unique())
    for ax in grid.axes.flat:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if len(values) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.set_xlabel(AXIS_LABELS[axis])
        ax.minorticks_off()
    grid.figure.suptitle(f"Overhead over PreLN against {AXIS_LABELS[axis]}", y=1.03)
    buf = io.BytesIO()
    grid.figure.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(grid.figure)

    return atomic_write_bytes(path, buf.getvalue())


def write_outputs(df, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the CSV, the scaling fits, the run's settings and the plot into ``out_dir``."""

    out = Path(out_dir)
    paths = {
        "csv": atomic_write_text(out / "bench.csv", df.to_csv(index=False)),
        "scaling": atomic_write_text(out / "bench_scaling.csv", scaling(df).to_csv(index=False)),
        "meta": atomic_write_json(out / "bench_meta.json", df.attrs.get("meta", {})),
        "plot": plot_overhead(df, out / f"overhead_vs_{plot_axis(df)}.png"),
    }
    return paths
