"""Two sweeps side by side: the same runs under a base change, a code change or another cluster, paired by seed.

A row of the comparison is a variant at one value of every grid axis either sweep varies (the config keys in which
its runs differ, besides variant and seed). Its runs in sweep A and in sweep B pair where they have the same seed:
``delta = B - A`` is the mean of the per-seed differences on the shared seeds, with its paired t-interval
(``harness.reporting.stats.compare``: Welch's interval where fewer than two seeds are shared, none with one value on
a side). Each table's p-values are Holm-adjusted over that table. A row only one sweep has is kept, marked as such,
without a difference. The final validation loss is one table; downstream accuracy per task (``eval/table.csv``:
``acc_norm`` where a task reports it, else ``acc``) is another, over the runs both sweeps evaluated.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.errors import UsageError
from harness.reporting.axes import axis_column_names
from harness.reporting.render import fmt_delta, fmt_p, frame_markdown
from harness.reporting.results import Run, Sweep, load_sweep, typed_values
from harness.reporting.stats import compare, holm
from harness.reporting.tables.comparisons import chosen_metrics

VAL_LOSS, DOWNSTREAM = "val_loss", "downstream"
BOTH, ONLY_A, ONLY_B = "both", "A only", "B only"
STAT_COLUMNS = [
    "seeds_a",
    "mean_a",
    "seeds_b",
    "mean_b",
    "delta",
    "low",
    "high",
    "method",
    "pairs",
    "partial",
    "p",
    "p_holm",
]

# (variant, the axis values as JSON) -> seed -> values of that seed's runs
Cells = dict[tuple[str, tuple[str, ...]], dict[int, list[float]]]


def compare_sweeps(a: str | Path | Sweep, b: str | Path | Sweep) -> pd.DataFrame:
    """One row per table × task × variant × grid-axis value found in either sweep, ``delta = B - A`` paired by seed.

    ``a`` and ``b`` are sweep folders, archives ``depthmem pack`` wrote, or loaded sweeps. Columns: ``table``
    (``val_loss`` or ``downstream``), ``task`` (empty for the loss), ``variant``, one column per grid axis, ``in``
    (``both``, ``A only``, ``B only``), then per side the number of seeds and their mean, and the difference:
    ``delta``, its 95% interval ``low``–``high``, ``method``, ``pairs``, ``partial`` (the seed sets differ, only
    the shared ones are paired), ``p`` and ``p_holm`` (Holm over the rows of the same table). ``attrs["notes"]``
    lists the files either sweep could not read. Raises
    ``UsageError`` when no variant at the same grid values has a finished run in both sweeps.
    """
    sweeps = [s if isinstance(s, Sweep) else load_sweep(s) for s in (a, b)]
    keys = sorted(set(sweeps[0].axis_keys.values()) | set(sweeps[1].axis_keys.values()))
    columns = axis_column_names(keys)
    loss = _table(VAL_LOSS, "", [_cells(s, keys, _final_loss) for s in sweeps])
    if not (loss["in"] == BOTH).any():
        names = " and ".join(repr(str(s.root)) for s in sweeps)
        raise UsageError(
            f"The sweeps {names} have no finished run in common: none has the same variant and grid values "
            f"({', '.join(['variant', *columns]) or 'variant'}) in both."
        )
    tables = [loss]
    chosen = chosen_metrics(r for sweep in sweeps for r in sweep.finished())
    metrics = {task: metric for task, metric in chosen.items() if metric}
    for task, metric in metrics.items():
        cells = [_cells(s, keys, lambda run, t=task, m=metric: _score(run, t, m)) for s in sweeps]
        if all(cells):
            tables.append(_table(DOWNSTREAM, task, cells))
    frame = pd.concat(tables, ignore_index=True)
    for name in (VAL_LOSS, DOWNSTREAM):
        rows = frame["table"] == name
        frame.loc[rows, "p_holm"] = holm(frame.loc[rows, "p"])
    frame = _with_axes(frame, columns)
    # What could not be read changes what a row rests on, so it travels with the rows.
    frame.attrs["notes"] = [f"{side}: {note}" for side, s in zip("AB", sweeps) for note in s.notes]
    return frame


def _final_loss(run: Run) -> float | None:
    return run.final_loss


def _score(run: Run, task: str, metric: str) -> float | None:
    """The run's value of ``metric`` on ``task`` from its eval/table.csv, None where it has none."""
    table = run.eval
    if table is None or not {"task", "metric", "value"} <= set(table):
        return None
    values = table.loc[(table["task"].astype(str) == task) & (table["metric"].astype(str) == metric), "value"]
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(values.iloc[-1]) if len(values) else None


def _axis_value(value: Any) -> str:
    # JSON, so that 3e-3 in one sweep and 0.003 in the other are the same value, and lists compare by content.
    return json.dumps(value, sort_keys=True)


def _cells(sweep: Sweep, keys: list[str], value: Callable[[Run], float | None]) -> Cells:
    """The finished runs' values by (variant, axis values) and seed; a run without a value is left out."""
    cells: Cells = defaultdict(lambda: defaultdict(list))
    for run in sweep.finished():
        v = value(run)
        if v is not None and math.isfinite(v):
            key = (run.variant, tuple(_axis_value(run.config_value(k)) for k in keys))
            cells[key][run.seed].append(v)
    return cells


def _table(name: str, task: str, sides: list[Cells]) -> pd.DataFrame:
    """One row per (variant, axis values) either side has, the difference where both have it."""
    rows = []
    for key in sorted(set(sides[0]) | set(sides[1]), key=_order):
        # Two runs of one seed at the same grid values (a rerun kept beside the first) count as their mean.
        a, b = ({s: float(np.mean(v)) for s, v in side.get(key, {}).items()} for side in sides)
        row: dict[str, Any] = {"table": name, "task": task, "variant": key[0], "_axes": key[1]}
        row.update(seeds_a=len(a), mean_a=_mean(a), seeds_b=len(b), mean_b=_mean(b))
        if a and b:
            c = compare(a, b)
            row.update(
                {"in": BOTH, "delta": c.delta, "low": c.low, "high": c.high, "method": c.method}
                | {"pairs": c.pairs, "partial": c.partial, "p": c.p}
            )
        else:
            row.update({"in": ONLY_A if a else ONLY_B, "delta": math.nan, "low": math.nan, "high": math.nan})
            row.update(method="", pairs=0, partial=False, p=math.nan)
        rows.append(row)
    return pd.DataFrame(rows, columns=["table", "task", "variant", "_axes", "in", *STAT_COLUMNS])


def _order(key: tuple[str, tuple[str, ...]]) -> tuple:
    """Rows by variant, then by each axis value: numbers by size (``1e-4`` before ``3e-3``), before any text."""
    values = [json.loads(v) for v in key[1]]
    number = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in values]
    return key[0], tuple((0, v, "") if n else (1, 0, json.dumps(v)) for v, n in zip(values, number))


def _mean(values: dict[int, float]) -> float:
    return float(np.mean(list(values.values()))) if values else math.nan


def _with_axes(frame: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """The JSON axis values unpacked into one column per axis: numbers where every value is one, else text."""
    values = [[json.loads(v) for v in axes] for axes in frame["_axes"]]
    head = frame[["table", "task", "variant"]].copy()
    for i, name in enumerate(columns):
        head[name] = typed_values(pd.Series([row[i] for row in values], dtype=object)).to_numpy()
    out = pd.concat([head, frame.drop(columns=["table", "task", "variant", "_axes"])], axis=1)
    for col in ("seeds_a", "seeds_b", "pairs"):
        out[col] = out[col].astype("int64")
    out["partial"] = out["partial"].astype(bool)
    return out


def to_markdown(frame: pd.DataFrame, a: str, b: str) -> str:
    """The comparison as Markdown: a table for the loss, one for downstream accuracy, and what the columns mean."""
    axes = [c for c in frame.columns if c not in ("table", "task", "variant", "in", *STAT_COLUMNS)]
    parts = [f"A = {a}\nB = {b}"]
    for name, title, scale, digits in (
        ("val_loss", "Final validation loss", 1.0, 4),
        ("downstream", "Downstream accuracy (%)", 100.0, 1),
    ):
        rows = frame[frame["table"] == name]
        if rows.empty:
            continue
        shown = rows[[*(["task"] if name == "downstream" else []), "variant", *axes, "in"]].copy()
        shown["A"] = [_cell(m, n, scale, digits) for m, n in zip(rows["mean_a"], rows["seeds_a"])]
        shown["B"] = [_cell(m, n, scale, digits) for m, n in zip(rows["mean_b"], rows["seeds_b"])]
        shown["Δ = B − A (95% CI)"] = [
            fmt_delta(scale * d, scale * (hi - lo) / 2, digits) + (" †" if partial else "")
            for d, lo, hi, partial in zip(rows["delta"], rows["low"], rows["high"], rows["partial"])
        ]
        shown["method"] = rows["method"]
        shown["pairs"] = rows["pairs"].astype(str)
        shown["p (Holm)"] = [fmt_p(p) for p in rows["p_holm"]]
        parts.append(f"## {title}\n\n" + frame_markdown(shown.astype(str)))
    parts.append(
        "A and B: the mean over each sweep's finished runs (its seeds in parentheses). Δ: the mean of the per-seed "
        "differences on the seeds both sweeps have, with its paired t-interval (Welch's where fewer than two "
        "seeds are shared); † marks a row whose seed sets differ, so Δ rests on the shared seeds only. "
        "p: the t-test of no difference, Holm-adjusted over the rows of its table; * below 0.05."
    )
    if frame.attrs.get("notes"):
        parts.append("\n".join(f"- {note}" for note in frame.attrs["notes"]))
    return "\n\n".join(parts)


def _cell(mean: float, seeds: int, scale: float, digits: int) -> str:
    return "—" if seeds == 0 else f"{scale * mean:.{digits}f} ({seeds})"
