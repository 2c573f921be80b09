"""The paper's tables, computed from a loaded sweep and rendered as Markdown and LaTeX (booktabs).

Every table keeps two frames: ``data`` with the numbers at full precision (written as CSV, what tests and
plots read) and ``display`` with the formatted cells. Means over seeds carry a two-sided 95% Student-t
interval; a difference to a reference variant is paired where the two share seeds (a t-interval of the per-seed
differences, ``harness.reporting.stats.compare``) and a Welch interval only where they do not; the column says
which. One seed gives no interval; a note under the table says so once. Only finished runs (state ``done`` with a finite
final validation loss) enter any average; the rest are listed. A difference is only taken between runs that
trained on the same number of tokens: a row whose runs trained on another budget than the reference's gets no Δ,
and says why. Every table is registered with ``@table`` (``harness.reporting.items``) and built from one
``Context``; a table without rows raises ``NoData`` and is left out of the report, with its reason.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from harness.io import atomic_write_text
from harness.registry import format_value
from harness.reporting import frontier
from harness.reporting.items import Context, NoData, table
from harness.reporting.results import Run, Sweep, knobs_text, split_variant, typed_columns

LDM_BASES = ("ldm", "ldm-rls")
NO_CI = "no CI: one seed"


@dataclass
class Table:
    """One table: its file name, title, numbers, formatted cells and the notes printed under it."""

    name: str
    title: str
    data: pd.DataFrame
    display: pd.DataFrame
    notes: list[str] = field(default_factory=list)


# -- statistics --------------------------------------------------------------------------------------------

from harness.reporting.stats import compare, holm, mean_ci, score_ci, welch_ci  # noqa: E402,F401  (re-exported: figures and tests read them)

SIGNIFICANCE = 0.05


def failures(runs: Iterable[Run]) -> dict[str, int]:
    """Runs that ended without a result, by kind: ``diverged`` (a non-finite loss, whether the run stopped itself
    or finished with a non-finite final validation loss) and ``failed`` (an error)."""
    counts: dict[str, int] = {}
    for run in runs:
        value = (run.summary or {}).get("val_loss")
        nonfinite = isinstance(value, (int, float)) and not math.isfinite(value)
        kind = "diverged" if run.state == "diverged" or (run.state == "done" and nonfinite) else None
        kind = "failed" if run.state == "failed" else kind
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def failures_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[k]} {k}" for k in ("diverged", "failed") if counts.get(k)) or "—"


def fmt_p(p: float) -> str:
    """Two significant digits, ``*`` below the significance level: ``0.012 *``, ``0.21``, ``<0.0001 *``; ``—``
    without a test."""
    if math.isnan(p):
        return "—"
    mark = " *" if p < SIGNIFICANCE else ""
    return ("<0.0001" if p < 1e-4 else f"{p:.2g}") + mark


def train_tokens(run: Run) -> int | None:
    """Tokens a finished run trained on: ``train_tokens`` of its summary, else the tokens of its last step."""
    summary = run.summary or {}
    for key in ("train_tokens", "tokens"):
        value = summary.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return int(value)
    return None


def budget_text(tokens: set[int | None]) -> str:
    known = sorted(t for t in tokens if t is not None)
    words = [fmt_count(t) for t in known] + (["unknown"] if None in tokens else [])
    return " and ".join(words) + " tokens"


# -- grouping ----------------------------------------------------------------------------------------------


def variant_order(names: Iterable[str], reference: str) -> list[str]:
    """The reference variant first, then the others sorted by name: the row order of every table."""
    names = sorted(set(names))
    return ([reference] if reference in names else []) + [n for n in names if n != reference]


def group_runs(runs: Iterable[Run]) -> dict[tuple[str, str], list[Run]]:
    """Runs by (setting, variant), each group sorted by seed."""
    groups: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        groups[(run.setting, run.variant)].append(run)
    return {k: sorted(v, key=lambda r: (r.seed, r.rel)) for k, v in groups.items()}


def _ordered_keys(groups: dict[tuple[str, str], list[Run]], reference: str) -> list[tuple[str, str]]:
    keys = []
    for setting in sorted({s for s, _ in groups}):
        keys += [(setting, v) for v in variant_order([v for s, v in groups if s == setting], reference)]
    return keys


def _ppl(run: Run) -> float:
    value = run.summary.get("val_ppl") if run.summary else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.exp(run.final_loss)


# -- formatting --------------------------------------------------------------------------------------------


def fmt_ci(mean: float, half: float, n: int, digits: int) -> str:
    """``3.2100 ± 0.0123``; without an interval (one seed) the mean alone, which the table's note explains."""
    if n == 0 or math.isnan(mean):
        return "— (no finished run)"
    if math.isnan(half):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def fmt_delta(diff: float, half: float, digits: int) -> str:
    if math.isnan(diff):
        return "—"
    if math.isnan(half):
        return f"{diff:+.{digits}f}"
    return f"{diff:+.{digits}f} ± {half:.{digits}f}"


def one_seed_note(data: pd.DataFrame, column: str = "seeds") -> list[str]:
    """The note that replaces "no CI" in every cell: which rows have a single seed, said once."""
    if column not in data or not (data[column] == 1).any():
        return []
    return [
        f"{NO_CI[0].upper()}{NO_CI[1:]}: rows with a single finished seed show the mean alone, without an interval."
    ]


def fmt_count(value: float) -> str:
    """Parameter and FLOP counts in K/M/G."""
    if value is None or math.isnan(value):
        return "—"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def fmt_bytes(value: float) -> str:
    if value is None or math.isnan(value):
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def fmt_ratio(value: float) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.2f}×"


def setting_axes(sweep: Sweep) -> dict[str, dict]:
    """Setting label -> its typed axis values (``{"n_blocks": 4, "lr": 0.001}``)."""
    return {run.setting: dict(run.axes) for run in sweep.runs}


def _with_axes(data: list[dict], display: list[dict], sweep: Sweep) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both frames with one column per grid axis in place of the setting label (typed in ``data``)."""
    axes = setting_axes(sweep)
    names = list(sweep.axis_keys)
    data_rows, shown_rows = [], []
    for row, shown in zip(data, display):
        values = axes.get(row.get("setting", ""), {})
        data_rows.append({**row, **{n: values.get(n) for n in names}})
        head = {n: _axis_text(values.get(n)) for n in names}
        shown_rows.append({**head, **{k: v for k, v in shown.items() if k != "Setting"}})
    frame = pd.DataFrame(data_rows)

    return typed_columns(frame, sweep), pd.DataFrame(shown_rows)


def _axis_text(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:g}"

    return format_value(value)


# -- the tables --------------------------------------------------------------------------------------------


def _comparison_rows(
    groups: dict[tuple[str, str], list[Run]], keys: list[tuple[str, str]], reference: str, *, with_ppl: bool
) -> tuple[list[dict], list[dict], dict]:
    """Rows of a comparison with ``reference``, and what the notes must say: the interval methods used, the
    budgets that kept a row from being compared, the rows paired on part of their seeds and the Holm family."""
    data, display = [], []
    used = {"methods": set(), "refused": [], "tokens": set(), "partial": [], "tests": 0, "failures": False}
    for setting, variant in keys:
        runs = [r for r in groups[(setting, variant)] if r.final_loss is not None]
        ref_runs = [r for r in groups.get((setting, reference), []) if r.final_loss is not None]
        losses = [r.final_loss for r in runs]
        loss, loss_half, n = mean_ci(losses)
        ppl, ppl_half, _ = mean_ci(_ppl(r) for r in runs)
        tokens, ref_tokens = {train_tokens(r) for r in runs}, {train_tokens(r) for r in ref_runs}
        used["tokens"] |= tokens
        same_budget = not runs or not ref_runs or (len(tokens | ref_tokens) == 1 and None not in tokens)
        diff = half = p = math.nan
        method, pairs, partial = "", 0, False
        if variant == reference:
            diff, half = 0.0, 0.0
        elif runs and ref_runs and same_budget:
            c = compare({r.seed: r.final_loss for r in ref_runs}, {r.seed: r.final_loss for r in runs})
            diff, half, method, p, pairs, partial = c.delta, c.half_width, c.method, c.p, c.pairs, c.partial
            used["methods"].add(method)
            if partial:
                used["partial"].append(variant if not setting else f"{variant} ({setting})")
        failed = failures(groups[(setting, variant)])
        used["failures"] = used["failures"] or bool(failed)
        row = {
            "setting": setting,
            "variant": variant,
            "base": runs[0].base if runs else "",
            "knobs": knobs_text(groups[(setting, variant)][0].knobs),
            "seeds": n,
            "diverged": failed.get("diverged", 0),
            "failed": failed.get("failed", 0),
            "val_loss": loss,
            "val_loss_ci95": loss_half,
        }
        if with_ppl:
            row.update(val_ppl=ppl, val_ppl_ci95=ppl_half)
        row.update(
            delta=diff,
            delta_ci95=half,
            delta_method=method,
            delta_pairs=pairs,
            delta_partial_seeds=partial,
            delta_p=p,
            train_tokens=next(iter(tokens)) if len(tokens) == 1 else None,
        )
        data.append(row)
        if variant == reference:
            delta_text = "reference"
        elif not ref_runs:
            delta_text = f"— (no finished {reference} run)"
        elif not same_budget:
            delta_text = f"— (trained on {budget_text(tokens)}, {reference} on {budget_text(ref_tokens)})"
            used["refused"].append(variant)
        elif not runs:
            delta_text = "—"
        elif math.isnan(half):
            delta_text = fmt_delta(diff, half, 4)  # one seed on a side: the table's note says so
        else:
            what = (
                f"{pairs} pairs" + ("; seeds differ" if partial else "")
                if method == "paired t"
                else f"{n} vs {len(ref_runs)} runs"
            )
            delta_text = fmt_delta(diff, half, 4) + f" ({method}, {what})"
        shown = {
            "Setting": setting,
            "Variant": variant,
            "Seeds": str(n),
            "Val loss (95% CI)": fmt_ci(loss, loss_half, n, 4),
        }
        if with_ppl:
            shown["Val ppl (95% CI)"] = fmt_ci(ppl, ppl_half, n, 2)
        else:
            shown = {
                "Setting": setting,
                "Variant": variant,
                "Knobs": row["knobs"],
                "Seeds": str(n),
                "Val loss (95% CI)": shown["Val loss (95% CI)"],
            }
        shown["Failed runs"] = failures_text(failed)
        shown[f"Δ loss vs {reference} (95% CI, method, pairs)"] = delta_text
        display.append(shown)
    # One family per table: every Δ of the table is a test of "no difference", corrected together.
    adjusted = holm(row["delta_p"] for row in data)
    used["tests"] = sum(not math.isnan(row["delta_p"]) for row in data)
    for row, shown, p_holm in zip(data, display, adjusted):
        row["delta_p_holm"] = p_holm
        shown["p (Holm)"] = "" if row["variant"] == reference else fmt_p(p_holm)
    if not used["failures"]:
        for shown in display:
            del shown["Failed runs"]
    return data, display, used


def _comparison_notes(used: dict, reference: str, display: list[dict], rows: list[dict]) -> list[str]:
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
    if used["tests"]:
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
    over the table, and the runs of each variant that diverged or failed."""
    sweep, baseline = ctx.sweep, split_variant(ctx.baseline)[0]
    groups = group_runs(sweep.runs)
    if not groups:
        raise NoData("no run directories")
    data, display, used = _comparison_rows(groups, _ordered_keys(groups, baseline), baseline, with_ppl=True)
    notes = [
        "Mean over seeds ± half-width of the two-sided 95% Student-t interval. Only finished runs are counted.",
        *_comparison_notes(used, baseline, display, data),
    ]
    data, display = _with_axes(data, display, sweep)
    notes += one_seed_note(data)
    return Table("main", "Main comparison: final validation loss and perplexity", data, display, notes)


def choose_metric(metrics: set[str]) -> str | None:
    """``acc_norm`` where a task reports it, else ``acc``, else None."""
    return "acc_norm" if "acc_norm" in metrics else "acc" if "acc" in metrics else None


def downstream_scores(sweep: Sweep) -> tuple[pd.DataFrame, dict[str, str]]:
    """One row per finished run × task with the chosen metric's value and lm-eval's stderr, and the metric chosen."""
    finished = [r for r in sweep.finished() if r.eval is not None and {"task", "metric", "value"} <= set(r.eval)]
    reported: dict[str, set[str]] = defaultdict(set)
    for run in finished:
        for task, metric in zip(run.eval["task"].astype(str), run.eval["metric"].astype(str)):
            reported[task].add(metric)
    chosen = {t: choose_metric(m) for t, m in sorted(reported.items())}
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


def score_interval(values: list[float], stderrs: list[float]) -> tuple[float, float, str]:
    """Mean accuracy and the half-width of its 95% interval: seed spread and item error combined
    (``harness.reporting.stats.score_ci``)."""
    return score_ci(values, stderrs)


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
    for setting, variant in _ordered_keys(groups, baseline):
        mine = scores[(scores["setting"] == setting) & (scores["variant"] == variant)]
        if mine.empty:
            continue
        row = {"setting": setting, "variant": variant, "seeds": int(mine["seed"].nunique())}
        shown = {"Setting": setting, "Variant": variant, "Seeds": str(row["seeds"])}
        for task in tasks:
            cell = mine[mine["task"] == task]
            mean, half, kind = score_interval(list(cell["value"]), list(cell["stderr"]))
            kinds.add(kind)
            row[task], row[f"{task}_ci95"] = mean, half
            shown[task] = _pct(mean, half)
        per_seed = mine.pivot_table(index="seed", columns="task", values="value").reindex(columns=tasks)
        errors = mine.pivot_table(index="seed", columns="task", values="stderr", dropna=False).reindex(
            index=per_seed.index, columns=tasks
        )
        complete = per_seed.dropna()
        # Tasks draw independent items: the average's item error is the root sum of squares over T tasks, / T.
        item_error = np.sqrt((errors.loc[complete.index] ** 2).sum(axis=1, min_count=len(tasks))) / len(tasks)
        avg, avg_half, kind = (
            score_interval(list(complete.mean(axis=1)), list(item_error)) if len(complete) else (math.nan, math.nan, "")
        )
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
    data, display = _with_axes(data, display, sweep)
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


@table("ablations", needs="runs of `ldm` or `ldm-rls`")
def ablation_table(ctx: Context) -> Table:
    """One row per knob setting of the variants whose base is `ldm` or `ldm-rls`, against the report's
    `ablation_reference` (default `ldm-rls`): mean ± t-interval, Δ with its paired interval and number of pairs,
    its p-value Holm-adjusted over the table, and the runs that diverged or failed."""
    sweep, reference = ctx.sweep, split_variant(ctx.ablation_reference)[0]
    runs = [r for r in sweep.runs if r.base in LDM_BASES]
    if not runs:
        raise NoData("no run of ldm or ldm-rls")
    groups = group_runs(runs)
    data, display, used = _comparison_rows(groups, _ordered_keys(groups, reference), reference, with_ppl=False)
    notes = [
        f"Variants whose base is {' or '.join(LDM_BASES)}, against {reference}.",
        *_comparison_notes(used, reference, display, data),
    ]
    data, display = _with_axes(data, display, sweep)
    notes += one_seed_note(data)
    return Table("ablations", f"LDM ablations against {reference}", data, display, notes)


COST_FIELDS = (
    "params",
    "extra_params",
    "stream_floats_per_token",
    "extra_flops_per_token",
    "tokens_per_s",
    "peak_mem_bytes",
)
MEMORY_METHODS = {
    "cuda": "torch.cuda.max_memory_allocated over training",
    "cpu": "the CPU allocator's live-byte peak of one profiled training step plus the parameters, "
    "gradients and optimizer state (as `depthmem bench` measures it)",
}


def cores_shared(run: Run) -> bool | None:
    """Whether a run trained on CPU cores that other work also used (load average above its cores), or None
    when its summary does not say."""
    s = run.summary or {}
    if "cores_shared" in s:
        return bool(s["cores_shared"])
    return None


def memory_method(run: Run) -> str | None:
    """``cuda`` or ``cpu`` for an allocator peak; None for older summaries whose peak is the process RSS."""
    method = (run.summary or {}).get("peak_mem_method")
    return method if method in MEMORY_METHODS else None


@table("cost", needs="`summary.json`")
def cost_table(ctx: Context) -> Table:
    """Parameters, extra parameters, stream floats and extra FLOPs per token, tokens/s and the training step's
    allocator peak memory, averaged over seeds, with ratios to the baseline. Throughput from runs that shared
    CPU cores is marked and gets no ratio."""
    sweep, baseline = ctx.sweep, split_variant(ctx.baseline)[0]
    finished = [r for r in sweep.finished() if r.summary]
    if not finished:
        raise NoData("no finished run has a summary.json")
    groups = group_runs(finished)

    def field_mean(runs: list[Run], name: str) -> float:
        if name == "peak_mem_bytes":
            runs = [r for r in runs if memory_method(r)]
        values = [float(r.summary[name]) for r in runs if isinstance(r.summary.get(name), (int, float))]
        return float(np.mean(values)) if values else math.nan

    data, display, methods, rss, shared_rows = [], [], set(), False, False
    for setting, variant in _ordered_keys(groups, baseline):
        runs, ref = groups[(setting, variant)], groups.get((setting, baseline), [])
        row = {"setting": setting, "variant": variant, "seeds": len(runs)}
        row.update({name: field_mean(runs, name) for name in COST_FIELDS})
        row["peak_mem_method"] = ",".join(sorted({m for r in runs if (m := memory_method(r))}))
        methods.update(m for r in runs if (m := memory_method(r)))
        rss = rss or any(memory_method(r) is None for r in runs)
        shared = any(cores_shared(r) for r in runs + ref)
        row["cores_shared"] = shared
        for name in ("params", "tokens_per_s", "peak_mem_bytes"):
            ref_value = field_mean(ref, name) if ref else math.nan
            row[f"{name}_rel"] = row[name] / ref_value if ref_value and not math.isnan(ref_value) else math.nan
        if shared:
            row["tokens_per_s_rel"] = math.nan
            shared_rows = True
        data.append(row)
        speed = (
            f"{fmt_count(row['tokens_per_s'])} (shared cores)"
            if shared
            else f"{fmt_count(row['tokens_per_s'])} ({fmt_ratio(row['tokens_per_s_rel'])})"
        )
        display.append(
            {
                "Setting": setting,
                "Variant": variant,
                "Params": f"{fmt_count(row['params'])} ({fmt_ratio(row['params_rel'])})",
                "Extra params": fmt_count(row["extra_params"]),
                "Stream floats/token": fmt_count(row["stream_floats_per_token"]),
                "Extra FLOPs/token": fmt_count(row["extra_flops_per_token"]),
                "Tokens/s": speed,
                "Peak memory (allocator)": (
                    f"{fmt_bytes(row['peak_mem_bytes'])} ({fmt_ratio(row['peak_mem_bytes_rel'])})"
                ),
            }
        )
    data, display = _with_axes(data, display, sweep)
    notes = [
        f"From each finished run's summary.json, mean over seeds; ratios in parentheses are relative to "
        f"{baseline} in the same setting."
    ]
    if methods:
        notes.append(
            "Peak memory is the training step's allocator peak: "
            + "; ".join(f"{m.upper()} runs: {MEMORY_METHODS[m]}" for m in sorted(methods))
            + "."
        )
    if rss:
        notes.append(
            "Runs whose summary.json does not say how peak memory was measured (older runs recorded the "
            "process's peak RSS, which counts tokenizer training and the Python heap) are left out of the "
            "memory column."
        )
    if shared_rows:
        notes.append(
            "Tokens/s marked (shared cores) comes from runs that trained while other work used the same "
            "CPU cores (the run's threads and the other runnable tasks, sampled at every logged step, "
            "outnumbered the cores), so it is no measure of the variant's cost and gets no ratio."
        )
    return Table("cost", "Cost relative to the baseline", data, display, notes)


BENCH_COLUMNS = ("variant", "depth", "width", "seq_len", "step_time_ms", "ratio_time", "peak_mem_bytes", "ratio_mem")


def read_bench(path: Path) -> pd.DataFrame:
    """The benchmark CSV with canonical variant names, sorted; raises ValueError when it lacks a column."""
    frame = pd.read_csv(path)
    missing = [c for c in BENCH_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"it lacks the columns {', '.join(missing)}")
    frame["variant"] = [split_variant(str(v))[0] for v in frame["variant"]]
    return frame.sort_values(["variant", "depth", "width", "seq_len"], kind="stable").reset_index(drop=True)


@table(
    "compute_multiplier",
    needs="finished runs of at least three model sizes at one tokens-per-parameter budget, baseline included",
)
def compute_multiplier_table(ctx: Context) -> Table:
    """The compute multiplier of every variant: the factor of the baseline's training compute that the baseline's
    fitted power law needs to reach the variant's loss, per model size and as the geometric mean over sizes, with
    a 95% interval: a bootstrap over seeds where every cell has at least five, else from the fit's uncertainty."""

    result = ctx.cached("frontier", lambda: frontier.from_sweep(ctx.sweep, ctx.baseline))
    rows = result.multipliers
    if rows.empty:
        raise NoData(result.reason or "no variant besides the baseline has frontier points")
    display = pd.DataFrame(
        {
            "Variant": rows["variant"],
            "Size": ["all (geometric mean)" if math.isnan(p) else f"{fmt_count(p)} params" for p in rows["params"]],
            "Seeds": rows["seeds"].astype(str),
            "Train FLOPs": [fmt_count(c) if not math.isnan(c) else "—" for c in rows["flops"]],
            "Loss": ["—" if math.isnan(v) else f"{v:.4f}" for v in rows["loss"]],
            "Compute multiplier (95% CI)": [
                fmt_ratio(m) if math.isnan(lo) else f"{m:.2f}× [{lo:.2f}, {hi:.2f}]"
                for m, lo, hi in zip(rows["multiplier"], rows["low"], rows["high"])
            ],
            "Interval": [how or "none" for how in rows["interval"]],
        }
    )
    fits = "; ".join(f"{r.variant}: L = {r.a:.3g} · C^(−{r.b:.4f})" for r in result.fits.itertuples())
    notes = [
        f"Each point is a model size trained at {result.budget_text}; C is training compute, 3 × forward FLOPs "
        f"per token × training tokens. The power law L = a · C^(−b) is fitted by least squares in log–log "
        f"space per variant ({fits}). The multiplier is C_{result.baseline}(L) / C, where C_{result.baseline}(L) "
        f"inverts the {result.baseline} fit: above 1 means the variant reaches its loss with less compute than "
        f"{result.baseline} would need."
    ]
    kinds = set(rows["interval"])
    if "bootstrap" in kinds:
        notes.append(
            f"Interval bootstrap: percentile bootstrap over seeds ({frontier.BOOTSTRAP} resamples, seeds "
            f"resampled jointly across sizes and variants, {result.baseline}'s law refitted in every resample), "
            f"for rows whose cells and {result.baseline}'s all have at least {frontier.MIN_BOOTSTRAP_SEEDS} seeds."
        )
    if kinds & {"fit", "fit, one seed"}:
        notes.append(
            f"Interval fit: with fewer than {frontier.MIN_BOOTSTRAP_SEEDS} seeds a bootstrap has too few distinct "
            f"resamples, so the interval is the delta method on the log multiplier with the covariance of "
            f"{result.baseline}'s least-squares fit (Student t with sizes − 2 degrees of freedom) and the variance "
            "of the row's mean log loss over its seeds"
            + (
                "; fit, one seed: the row has a single seed, so only the fit's uncertainty is in it."
                if "fit, one seed" in kinds
                else "."
            )
        )
    if "" in kinds:
        notes.append("Interval none: the fit gives no finite interval for these rows.")
    return Table("compute_multiplier", f"Compute multiplier against {result.baseline}", rows, display, notes)


@table("bench", needs="a benchmark CSV (`--bench`, `report.bench`, or `bench.csv` in the sweep folder)")
def bench_table(ctx: Context) -> Table:
    """The benchmark's step time and peak memory per variant and size, with ratios to the baseline."""
    bench, baseline = ctx.bench, split_variant(ctx.baseline)[0]
    if bench is None or bench.empty:
        raise NoData("no benchmark CSV (results/<sweep>/bench.csv or --bench)")
    order = {v: i for i, v in enumerate(variant_order(bench["variant"], baseline))}
    data = (
        bench.assign(_o=bench["variant"].map(order))
        .sort_values(["_o", "depth", "width", "seq_len"], kind="stable")
        .drop(columns="_o")
        .reset_index(drop=True)
    )
    display = pd.DataFrame(
        {
            "Variant": data["variant"],
            "Depth": data["depth"].astype(str),
            "Width": data["width"].astype(str),
            "Seq len": data["seq_len"].astype(str),
            "Step time (ms)": [f"{v:.2f}" for v in data["step_time_ms"]],
            "Time ×": [fmt_ratio(v) for v in data["ratio_time"]],
            "Peak memory": [fmt_bytes(v) for v in data["peak_mem_bytes"]],
            "Memory ×": [fmt_ratio(v) for v in data["ratio_mem"]],
        }
    )
    notes = [f"From the benchmark CSV (depthmem bench); ratios are relative to {baseline} at the same size."]
    return Table("bench", "Measured overhead (benchmark)", data[list(BENCH_COLUMNS)], display, notes)


@table("excluded_runs", needs="always built when some run is left out", always=True)
def runs_table(ctx: Context) -> Table:
    """Every run kept out of the averages (failed, diverged, unfinished, or without a final loss) and why."""
    data, display = [], []
    if not ctx.sweep.excluded():
        raise NoData("every run finished and counts")
    for run in ctx.sweep.excluded():
        reason = run.message
        if run.state == "done" and failures([run]):
            reason = reason or "finished with a non-finite final validation loss (diverged)"
        elif run.state == "done":
            reason = reason or "finished without a readable final validation loss in summary.json"
        data.append(
            {
                "run_id": run.run_id,
                "run_dir": run.rel,
                "variant": run.variant,
                "seed": run.seed,
                "state": run.state,
                "step": run.status.get("step"),
                "message": reason,
            }
        )
        step = run.status.get("step")
        display.append(
            {
                "Run": run.run_id,
                "Variant": run.variant,
                "Seed": str(run.seed),
                "State": run.state,
                "Step": "—" if step is None else str(step),
                "Message": reason or "—",
            }
        )
    columns = ["Run", "Variant", "Seed", "State", "Step", "Message"]
    return Table(
        "excluded_runs",
        "Runs not counted in any average",
        pd.DataFrame(data, columns=["run_id", "run_dir", "variant", "seed", "state", "step", "message"]),
        pd.DataFrame(display, columns=columns),
    )


# -- rendering ---------------------------------------------------------------------------------------------


def _md_cell(text: str) -> str:
    # A pipe or a newline inside a cell would break the Markdown table.
    return str(text).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def to_markdown(table: Table) -> str:
    """The table as GitHub-flavoured Markdown (pipes escaped inside cells)."""
    frame = table.display.map(_md_cell)
    frame.columns = [_md_cell(c) for c in frame.columns]
    return frame.to_markdown(index=False, disable_numparse=True)


_LATEX_SYMBOLS = {"±": r"$\pm$", "×": r"$\times$", "Δ": r"$\Delta$", "−": "$-$", "—": "--", "–": "--"}
_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(ch, ch) for ch in text)


_NUMERIC_CELL = re.compile(r"^[-+−]?(\d[\d.,]*|—)")


def column_alignment(display: pd.DataFrame) -> str:
    """``r`` for a column of numbers (at least half its cells begin with one; the rest are dashes or words such
    as ``reference``), ``l`` for text."""
    spec = ""
    for col in display.columns:
        cells = [str(v) for v in display[col]]
        numbers = sum(bool(_NUMERIC_CELL.match(c)) and any(ch.isdigit() for ch in c[:2]) for c in cells)
        spec += "r" if cells and 2 * numbers >= len(cells) else "l"
    return spec


def to_latex(table: Table) -> str:
    """The table as a LaTeX ``table`` float with booktabs rules (``\\usepackage{booktabs}``), numbers on the right."""
    styler = table.display.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    caption = table.title + (". " + " ".join(table.notes) if table.notes else "")
    text = styler.to_latex(
        hrules=True,
        caption=_latex_escape(caption),
        label=f"tab:{table.name}",
        position="t",
        position_float="centering",
        column_format=column_alignment(table.display),
    )
    for symbol, latex in _LATEX_SYMBOLS.items():
        text = text.replace(symbol, latex)
    return text


def write_table(table: Table, folder: Path) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.tex`` and ``<name>.csv`` into ``folder`` atomically."""
    folder = Path(folder)
    return {
        "md": atomic_write_text(folder / f"{table.name}.md", to_markdown(table) + "\n"),
        "tex": atomic_write_text(folder / f"{table.name}.tex", to_latex(table)),
        "csv": atomic_write_text(folder / f"{table.name}.csv", table.data.to_csv(index=False)),
    }
