"""Downstream differences to the baseline paired on items (``downstream_paired``).

The downstream table's intervals say how well each variant's accuracy is known; whether two variants differ is
better asked item by item: both answered the same questions, so the item-to-item difficulty cancels in the
difference and a gap far smaller than either interval can be told from noise.
"""

from __future__ import annotations

import math

from harness.reporting.items import Context, NoData, table
from harness.reporting.render import SIGNIFICANCE, Table, fmt_p
from harness.reporting.results import Run, split_variant
from harness.reporting.stats import MCNEMAR, SIGN_FLIP, holm, paired_items
from harness.reporting.tables.common import group_runs, ordered_keys, with_axes
from harness.reporting.tables.comparisons import choose_metric


def _scores(runs: list[Run], task: str, metric: str) -> dict[int, dict[int, float]]:
    """Seed -> {item id -> score} of ``task``'s ``metric`` over the runs that logged their items."""
    out: dict[int, dict[int, float]] = {}
    for run in runs:
        frame = run.items
        if frame is None or not {"task", "doc_id", "metric", "value"} <= set(frame.columns):
            continue
        rows = frame[(frame["task"].astype(str) == task) & (frame["metric"].astype(str) == metric)]
        rows = rows.dropna(subset=["doc_id", "value"])
        if len(rows):
            out[run.seed] = dict(zip(rows["doc_id"].astype(int), rows["value"].astype(float)))
    return out


def _metrics(runs: list[Run]) -> dict[str, str]:
    """Task -> the metric compared (``acc_norm`` where logged, else ``acc``), over every run's items."""
    seen: dict[str, set[str]] = {}
    for run in runs:
        if run.items is not None and {"task", "metric"} <= set(run.items.columns):
            for task, metric in zip(run.items["task"].astype(str), run.items["metric"].astype(str)):
                seen.setdefault(task, set()).add(metric)
    return {t: m for t, ms in sorted(seen.items()) if (m := choose_metric(ms))}


def _points(delta: float, low: float, high: float) -> str:
    return f"{100 * delta:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


@table("downstream_paired", needs="`eval/items.csv.gz` (each item's score, written by `depthmem eval`)")
def downstream_paired_table(ctx: Context) -> Table:
    """Each variant's downstream accuracy minus the baseline's, in points, paired on items and seeds: a bootstrap
    interval over items, McNemar's exact test for one seed (a sign-flip test over seed-averaged items for
    several), p-values Holm-adjusted over the table."""
    sweep, baseline = ctx.sweep, split_variant(ctx.baseline)[0]
    finished = [r for r in sweep.finished() if r.items is not None]
    metrics = _metrics(finished)
    if not metrics:
        raise NoData("no finished run has eval/items.csv.gz with acc or acc_norm")
    groups = group_runs(finished)
    data, display = [], []
    for setting, variant in ordered_keys(groups, baseline):
        reference = groups.get((setting, baseline))
        if variant == baseline or not reference:
            continue
        for task, metric in metrics.items():
            ref, mine = _scores(reference, task, metric), _scores(groups[(setting, variant)], task, metric)
            c = paired_items(ref, mine)
            if c is None:
                continue
            data.append(
                {
                    "setting": setting,
                    "variant": variant,
                    "task": task,
                    "metric": metric,
                    "seeds": c.seeds,
                    "items": c.items,
                    "discordant": c.discordant,
                    "delta": c.delta,
                    "delta_low": c.low,
                    "delta_high": c.high,
                    "method": c.method,
                    "p": c.p,
                }
            )
            display.append(
                {
                    "Setting": setting,
                    "Variant": variant,
                    "Task": task,
                    "Seeds": str(c.seeds),
                    "Items": str(c.items),
                    "Differing items": str(c.discordant),
                    f"Δ vs {baseline}, points (95% CI)": _points(c.delta, c.low, c.high),
                    "Test": c.method,
                }
            )
    if not data:
        raise NoData(f"no variant shares a seed and items with {baseline}")
    for row, shown, p_holm in zip(data, display, holm(row["p"] for row in data)):
        row["p_holm"] = p_holm
        shown["p (Holm)"] = fmt_p(p_holm)
    methods = {row["method"] for row in data}
    tests = sum(not math.isnan(row["p"]) for row in data)
    data, display = with_axes(data, display, ctx.sweep)
    words = {
        MCNEMAR: "McNemar's exact test (two-sided binomial on the items only one side got right) where a row has one "
        "seed",
        SIGN_FLIP: "a sign-flip test of the item differences averaged over the shared seeds where it has several",
    }
    notes = [
        f"Δ is the row's accuracy − {baseline}'s on the same items, in percentage points, averaged over the seeds "
        "both have (their number in Seeds), with a 95% percentile bootstrap interval over items. Differing items "
        "counts the items whose seed-averaged score differs. Every item counts once, so this interval covers the "
        "draw of items, not the spread between seeds that the downstream table's intervals add.",
        "p (Holm): " + "; ".join(words[m] for m in (MCNEMAR, SIGN_FLIP) if m in methods) + f"; Holm–Bonferroni "
        f"adjusted over the {tests} differences of this table, * below "
        f"{SIGNIFICANCE:g}.",
        "Metric per task: " + ", ".join(f"{t}: {m}" for t, m in metrics.items()) + ".",
    ]
    return Table("downstream_paired", "Downstream differences paired on items", data, display, notes)
