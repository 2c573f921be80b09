"""Variants compared: validation loss (``main``) and downstream accuracy (``downstream``), each difference to the
reference paired over shared seeds where it can be; the LDM ablations (``harness.reporting.tables.ablations``) use
the same rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd

from harness.reporting.items import Context, NoData, table
from harness.reporting.render import SIGNIFICANCE, Table, fmt_ci, fmt_count, fmt_delta, fmt_p
from harness.reporting.results import Run, Sweep, knobs_text, split_variant
from harness.reporting.stats import holm, mean_ci, score_ci
from harness.reporting.tables.common import (
    budget_text,
    delta,
    failures,
    failures_text,
    finished_runs,
    group_runs,
    one_budget,
    one_seed_note,
    ordered_keys,
    perplexity,
    train_tokens,
    with_axes,
)
from harness.reporting.tables.families import Family, declared, lookup


def _delta_text(row: dict, reference: str, ref_runs: list[Run], tokens: set, ref_tokens: set, n: int) -> str:
    """The Δ cell: the difference with its interval and method, or why there is none."""
    if row["variant"] == reference:
        return "reference"
    if not ref_runs:
        return f"— (no finished {reference} run)"
    if not row["same_budget"]:
        return f"— (trained on {budget_text(tokens)}, {reference} on {budget_text(ref_tokens)})"
    if not n:
        return "—"
    if math.isnan(row["delta_ci95"]):
        return fmt_delta(row["delta"], row["delta_ci95"], 4)  # one seed on a side: the table's note says so
    if row["delta_method"] == "paired t":
        what = f"{row['delta_pairs']} pairs" + ("; seeds differ" if row["delta_partial_seeds"] else "")
    else:
        what = f"{n} vs {len(ref_runs)} runs"
    return fmt_delta(row["delta"], row["delta_ci95"], 4) + f" ({row['delta_method']}, {what})"


def comparison_row(groups, setting: str, variant: str, reference: str, used: dict, *, with_ppl: bool):
    """One row of a comparison with ``reference``: its numbers and its cells (the p column filled later)."""
    runs, ref_runs = finished_runs(groups, setting, variant), finished_runs(groups, setting, reference)
    loss, loss_half, n = mean_ci(r.final_loss for r in runs)
    ppl, ppl_half, _ = mean_ci(perplexity(r) for r in runs)
    tokens, ref_tokens = {train_tokens(r) for r in runs}, {train_tokens(r) for r in ref_runs}
    used["tokens"] |= tokens
    same_budget = not runs or not ref_runs or one_budget(runs, ref_runs)
    c = delta(runs, ref_runs) if variant != reference else None
    if c is not None:
        used["methods"].add(c.method)
        if c.partial:
            used["partial"].append(variant if not setting else f"{variant} ({setting})")
    failed = failures(groups[(setting, variant)])
    used["failures"] = used["failures"] or bool(failed)
    zero = 0.0 if variant == reference else math.nan
    row = {
        "setting": setting,
        "variant": variant,
        "base": runs[0].base if runs else "",
        "knobs": knobs_text(groups[(setting, variant)][0].knobs),
        "reference": reference,
        "seeds": n,
        "diverged": failed.get("diverged", 0),
        "failed": failed.get("failed", 0),
        "val_loss": loss,
        "val_loss_ci95": loss_half,
        **({"val_ppl": ppl, "val_ppl_ci95": ppl_half} if with_ppl else {}),
        "delta": c.delta if c else zero,
        "delta_ci95": c.half_width if c else zero,
        "delta_method": c.method if c else "",
        "delta_pairs": c.pairs if c else 0,
        "delta_partial_seeds": c.partial if c else False,
        "delta_p": c.p if c else math.nan,
        "train_tokens": next(iter(tokens)) if len(tokens) == 1 else None,
        "same_budget": same_budget,
    }
    if not same_budget and ref_runs and variant != reference:
        used["refused"].append(variant)
    shown = {"Setting": setting, "Variant": variant}
    if not with_ppl:
        shown["Knobs"] = row["knobs"]
    shown["Seeds"] = str(n)
    shown["Val loss (95% CI)"] = fmt_ci(loss, loss_half, n, 4)
    if with_ppl:
        shown["Val ppl (95% CI)"] = fmt_ci(ppl, ppl_half, n, 2)
    shown["Failed runs"] = failures_text(failed)
    shown["Δ"] = _delta_text(row, reference, ref_runs, tokens, ref_tokens, n)
    del row["same_budget"]
    return row, shown


def comparison_rows(
    groups: dict[tuple[str, str], list[Run]],
    keys: list[tuple[str, str]],
    reference: str | Callable[[str], str],
    *,
    with_ppl: bool,
    tests: list[Family] | None = None,
) -> tuple[list[dict], list[dict], dict]:
    """Rows of a comparison with ``reference`` (one variant, or a function giving each row's), and what the notes
    must say: the interval methods used, the budgets that kept a row from being compared, the rows paired on part
    of their seeds and the Holm family. ``tests`` are the grid's declared families: each Δ then takes the p-value
    adjusted within its family, and a Δ in none is shown without one; without them the table is one family."""
    reference_of = reference if callable(reference) else (lambda _variant: reference)
    used = {"methods": set(), "refused": [], "tokens": set(), "partial": [], "tests": 0, "failures": False}
    used["families"] = tests is not None
    data, display = [], []
    for setting, variant in keys:
        row, shown = comparison_row(groups, setting, variant, reference_of(variant), used, with_ppl=with_ppl)
        data.append(row)
        display.append(shown)
    header = (
        f"Δ loss vs {reference} (95% CI, method, pairs)"
        if isinstance(reference, str)
        else "Δ loss vs its reference (95% CI, method, pairs)"
    )
    for shown in display:
        shown[header] = shown.pop("Δ")
    if tests is None:
        # One family per table: every Δ of the table is a test of "no difference", corrected together.
        adjusted = holm(row["delta_p"] for row in data)
        used["tests"] = sum(not math.isnan(row["delta_p"]) for row in data)
        for row, shown, p_holm in zip(data, display, adjusted):
            row["delta_p_holm"] = p_holm
            shown["p (Holm)"] = "" if row["variant"] == row["reference"] else fmt_p(p_holm)
    else:
        for row, shown in zip(data, display):
            found = lookup(tests, row["setting"], row["variant"], row["reference"])
            row["family"] = found[0] if found else ""
            row["delta_p_holm"] = found[1] if found else math.nan
            shown["Family"] = found[0] if found else ("" if row["variant"] == row["reference"] else "none")
            shown["p (Holm, within family)"] = fmt_p(found[1]) if found else ""
    if isinstance(reference, str):
        for row in data:
            del row["reference"]
    if not used["failures"]:
        for shown in display:
            del shown["Failed runs"]
    return data, display, used


def comparison_notes(used: dict, reference: str, display: list[dict], rows: list[dict]) -> list[str]:
    """How the Δ column was computed, and the training budget of the compared runs."""
    methods = used["methods"]
    notes = []
    if methods:
        words = {
            "paired t": "paired t-interval of the per-seed differences on the seeds the row shares with "
            f"{reference} (their number is in the cell)",
            "Welch": "Welch interval (unequal variances) where they share none",
            "one seed": "no interval where a side has one seed",
        }
        notes.append(
            f"Δ is the row − {reference} in final validation loss with a 95% interval: "
            + "; ".join(words[m] for m in ("paired t", "Welch", "one seed") if m in methods)
            + ". Negative Δ is better."
        )
    if used["families"]:
        notes.append(
            "p (Holm, within family): the two-sided p-value of the t-test behind each Δ, Holm–Bonferroni adjusted "
            "within the declared family named in column Family (the report lists each family and its size under "
            f"Claims); * marks an adjusted p below {SIGNIFICANCE:g}. A Δ in no family (none) is shown with its "
            "interval only: the grid makes no claim on it."
        )
    elif used["tests"]:
        notes.append(
            f"p (Holm): the two-sided p-value of the t-test behind each Δ, Holm–Bonferroni adjusted over the "
            f"{used['tests']} differences of this table; * marks an adjusted p below {SIGNIFICANCE:g}."
        )
    if used["partial"]:
        notes.append(
            f"Seeds differ for {', '.join(used['partial'])}: the row and {reference} finished different sets of "
            "seeds, so Δ pairs only the seeds both have and the Seeds column counts more runs than the pairs."
        )
    if used["failures"]:
        notes.append(
            "Failed runs: runs of the row that diverged (non-finite loss) or stopped with an error; they count "
            "in no average and are listed under Runs not counted in any average."
        )
    tokens = {t for t in used["tokens"] if t is not None}
    if used["refused"]:
        notes.append(
            f"No Δ for {', '.join(used['refused'])}: their runs trained on another number of tokens "
            f"than {reference}'s, so a difference would mix the method with the budget."
        )
    if len(tokens) == 1:
        notes.append(f"Every run trained on {fmt_count(next(iter(tokens)))} tokens.")
    elif len(tokens) > 1:
        # The budget varies between settings on purpose (an axis of the grid): say so in every row.
        for shown, row in zip(display, rows):
            value = row.get("train_tokens")
            shown["Train tokens"] = (
                "—" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt_count(value)
            )
        notes.append(
            "The training budget differs between rows (column Train tokens); Δ is only taken between "
            "runs of one budget."
        )
    return notes


@table("main", needs="`summary.json`")
def main_table(ctx: Context) -> Table:
    """Final validation loss and perplexity per variant: the mean over seeds ± the half-width of the two-sided 95%
    Student-t interval, Δ to the baseline with its 95% interval, paired over shared seeds (Welch where the runs
    share none) with the number of pairs, only between runs of one training budget, its p-value Holm-adjusted
    over the table (within its declared family, where the grid declares `report.primary`), and the runs of each
    variant that diverged or failed."""
    sweep, baseline = ctx.sweep, split_variant(ctx.baseline)[0]
    groups = group_runs(sweep.runs)
    if not groups:
        raise NoData("no run directories")
    keys = ordered_keys(groups, baseline)
    data, display, used = comparison_rows(groups, keys, baseline, with_ppl=True, tests=declared(ctx))
    notes = [
        "Mean over seeds ± half-width of the two-sided 95% Student-t interval. Only finished runs are counted.",
        *comparison_notes(used, baseline, display, data),
    ]
    data, display = with_axes(data, display, sweep)
    notes += one_seed_note(data)
    return Table("main", "Main comparison: final validation loss and perplexity", data, display, notes)


def choose_metric(metrics: set[str]) -> str | None:
    """``acc_norm`` where a task reports it, else ``acc``, else None."""
    return "acc_norm" if "acc_norm" in metrics else "acc" if "acc" in metrics else None


def chosen_metrics(runs: Iterable[Run]) -> dict[str, str | None]:
    """Task -> the accuracy metric ``choose_metric`` takes from what the evaluated ``runs`` report (None for a task
    with neither), one choice over all of them, so that runs compared on a task are compared on the same metric."""
    reported: dict[str, set[str]] = defaultdict(set)
    for run in runs:
        if run.eval is not None and {"task", "metric"} <= set(run.eval):
            for task, metric in zip(run.eval["task"].astype(str), run.eval["metric"].astype(str)):
                reported[task].add(metric)
    return {task: choose_metric(metrics) for task, metrics in sorted(reported.items())}


def downstream_scores(sweep: Sweep) -> tuple[pd.DataFrame, dict[str, str]]:
    """One row per finished run × task with the chosen metric's value and lm-eval's stderr, and the metric chosen."""
    finished = [r for r in sweep.finished() if r.eval is not None and {"task", "metric", "value"} <= set(r.eval)]
    chosen = chosen_metrics(finished)
    rows = []
    for run in finished:
        stderr = run.eval["stderr"] if "stderr" in run.eval else [math.nan] * len(run.eval)
        for t, m, v, e in zip(run.eval["task"].astype(str), run.eval["metric"].astype(str), run.eval["value"], stderr):
            if chosen.get(t) == m and not math.isnan(float(v)):
                rows.append(
                    {
                        "setting": run.setting,
                        "variant": run.variant,
                        "seed": run.seed,
                        "task": t,
                        "value": float(v),
                        "stderr": float(e) if e is not None else math.nan,
                    }
                )
    return pd.DataFrame(rows, columns=["setting", "variant", "seed", "task", "value", "stderr"]), chosen


# Accuracy of guessing uniformly among a task's choices, by lm-eval task name (the offline suite's prefix dropped).
# ARC's questions have three to five choices, four for all but a few; LAMBADA asks for a word, not a choice.
CHANCE = {
    "arc_easy": 0.25,
    "arc_challenge": 0.25,
    "boolq": 0.5,
    "copa": 0.5,
    "hellaswag": 0.25,
    "lambada_openai": 0.0,
    "openbookqa": 0.25,
    "piqa": 0.5,
    "sciq": 0.25,
    "winogrande": 0.5,
}


def chance_level(task: str) -> float:
    """The accuracy of uniform guessing on ``task`` (NaN for a task whose choices are not known here)."""
    return CHANCE.get(task.removeprefix("offline_"), math.nan)


def _pct(mean: float, half: float) -> str:
    if math.isnan(mean):
        return "—"
    return f"{100 * mean:.1f}" if math.isnan(half) else f"{100 * mean:.1f} ± {100 * half:.1f}"


def _average_over_tasks(mine, tasks: list[str]) -> tuple[float, float, str]:
    """The mean over tasks of each seed that has every task, then over seeds, with its interval and its kind."""
    per_seed = mine.pivot_table(index="seed", columns="task", values="value").reindex(columns=tasks)
    errors = mine.pivot_table(index="seed", columns="task", values="stderr", dropna=False).reindex(
        index=per_seed.index, columns=tasks
    )
    complete = per_seed.dropna()
    if not len(complete):
        return math.nan, math.nan, ""
    # Tasks draw independent items: the average's item error is the root sum of squares over T tasks, / T.
    item_error = np.sqrt((errors.loc[complete.index] ** 2).sum(axis=1, min_count=len(tasks))) / len(tasks)
    return score_ci(list(complete.mean(axis=1)), list(item_error))


@table("downstream", needs="`eval/table.csv`")
def downstream_table(ctx: Context) -> Table:
    """Accuracy per task in percent (`acc_norm` where the task reports it, else `acc`) with its 95% interval —
    seed spread and each run's item standard error combined — the average over tasks, and a row with the
    accuracy of uniform guessing."""
    sweep, baseline = ctx.sweep, split_variant(ctx.baseline)[0]
    scores, chosen = downstream_scores(sweep)
    tasks = [t for t, m in chosen.items() if m]
    if scores.empty or not tasks:
        raise NoData("no finished run has eval/table.csv with acc or acc_norm")
    groups = group_runs([r for r in sweep.finished() if r.eval is not None])
    data, display, kinds = [], [], set()
    for setting, variant in ordered_keys(groups, baseline):
        mine = scores[(scores["setting"] == setting) & (scores["variant"] == variant)]
        if mine.empty:
            continue
        row = {"setting": setting, "variant": variant, "seeds": int(mine["seed"].nunique())}
        shown = {"Setting": setting, "Variant": variant, "Seeds": str(row["seeds"])}
        for task in tasks:
            cell = mine[mine["task"] == task]
            mean, half, kind = score_ci(list(cell["value"]), list(cell["stderr"]))
            kinds.add(kind)
            row[task], row[f"{task}_ci95"] = mean, half
            shown[task] = _pct(mean, half)
        avg, avg_half, kind = _average_over_tasks(mine, tasks)
        kinds.add(kind)
        row["average"], row["average_ci95"] = avg, avg_half
        shown["Average"] = _pct(avg, avg_half)
        data.append(row)
        display.append(shown)
    chance = {task: chance_level(task) for task in tasks}
    known = [v for v in chance.values() if not math.isnan(v)]
    data.append(
        {
            "setting": "",
            "variant": "chance",
            "seeds": 0,
            **{t: v for t, v in chance.items()},
            "average": float(np.mean(list(chance.values()))) if len(known) == len(tasks) else math.nan,
        }
    )
    display.append(
        {
            "Setting": "",
            "Variant": "chance",
            "Seeds": "—",
            **{t: "?" if math.isnan(v) else f"{100 * v:.1f}" for t, v in chance.items()},
            "Average": _pct(data[-1]["average"], math.nan),
        }
    )
    data, display = with_axes(data, display, sweep)
    metric_list = ", ".join(f"{t}: {m}" for t, m in chosen.items() if m)
    words = {
        "seeds+items": "where a row has two or more seeds, the Student-t interval over seeds and 1.96 × the root "
        "mean square of the runs' standard errors (lm-eval's stderr over items), added in quadrature: every seed "
        "answers the same items, so more seeds do not shrink the item error",
        "items": "for a single seed, 1.96 × lm-eval's standard error of the run",
        "seeds": "where the runs report no standard error, the Student-t interval over seeds alone, which leaves "
        "out the error of the items drawn",
    }
    notes = [
        "Accuracy in percent with a 95% interval: "
        + "; ".join(words[k] for k in ("seeds+items", "items", "seeds") if k in kinds)
        + f". Metric per task: {metric_list}. The average is over all tasks of each seed that has every task "
        "(its item error the root sum of squares of the tasks' errors over the number of tasks), then over seeds.",
        "The chance row is the accuracy of guessing uniformly among each task's choices"
        + (" (? where the task's number of choices is not known)" if len(known) < len(tasks) else "")
        + "; a score within its interval of chance shows no ability on that task.",
    ]
    skipped = [t for t, m in chosen.items() if not m]
    if skipped:
        notes.append(f"Tasks without acc or acc_norm, not shown: {', '.join(skipped)}.")
    return Table("downstream", "Downstream accuracy", data, display, notes)
