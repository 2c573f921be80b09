"""The paper's tables, computed from a loaded sweep and rendered as Markdown and LaTeX (booktabs).

Every table keeps two frames: ``data`` with the numbers at full precision (written as CSV, what tests and
plots read) and ``display`` with the formatted cells. Means over seeds carry a two-sided 95% Student-t
interval; a difference to a reference variant is paired where the two share seeds (a t-interval of the per-seed
differences, ``harness.stats.compare``) and a Welch interval only where they do not; the column says which. One
seed gives no interval, and the cell says so. Only finished runs (state ``done`` with a finite final validation
loss) enter any average; the rest are listed. A difference is only taken between runs that trained on the same
number of tokens: a row whose runs trained on another budget than the reference's gets no Δ, and says why.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
from scipy import stats

from harness.results import Run, Sweep, knobs_text, split_variant
from harness.io import atomic_write_text

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

from harness.stats import compare, mean_ci, welch_ci  # noqa: E402,F401  (re-exported: figures and tests read them)


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
    """``3.2100 ± 0.0123``; one seed says that it has no interval."""
    if n == 0 or math.isnan(mean):
        return "— (no finished run)"
    if math.isnan(half):
        return f"{mean:.{digits}f} ({NO_CI})"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def fmt_delta(diff: float, half: float, digits: int) -> str:
    if math.isnan(diff):
        return "—"
    if math.isnan(half):
        return f"{diff:+.{digits}f} ({NO_CI})"
    return f"{diff:+.{digits}f} ± {half:.{digits}f}"


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
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def fmt_ratio(value: float) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.2f}×"


def _with_setting(rows: list[dict], show_setting: bool) -> list[dict]:
    if show_setting:
        return rows
    return [{k: v for k, v in r.items() if k != "Setting"} for r in rows]


# -- the tables --------------------------------------------------------------------------------------------

def _comparison_rows(groups: dict[tuple[str, str], list[Run]], keys: list[tuple[str, str]], reference: str,
                     *, with_ppl: bool) -> tuple[list[dict], list[dict], dict]:
    """Rows of a comparison with ``reference``, and what the notes must say: the interval methods used, and the
    budgets that kept a row from being compared."""
    data, display = [], []
    used = {"methods": set(), "refused": [], "tokens": set()}
    for setting, variant in keys:
        runs = [r for r in groups[(setting, variant)] if r.final_loss is not None]
        ref_runs = [r for r in groups.get((setting, reference), []) if r.final_loss is not None]
        losses = [r.final_loss for r in runs]
        loss, loss_half, n = mean_ci(losses)
        ppl, ppl_half, _ = mean_ci(_ppl(r) for r in runs)
        tokens, ref_tokens = {train_tokens(r) for r in runs}, {train_tokens(r) for r in ref_runs}
        used["tokens"] |= tokens
        same_budget = not runs or not ref_runs or (len(tokens | ref_tokens) == 1 and None not in tokens)
        diff = half = math.nan
        method = ""
        if variant == reference:
            diff, half = 0.0, 0.0
        elif runs and ref_runs and same_budget:
            c = compare({r.seed: r.final_loss for r in ref_runs}, {r.seed: r.final_loss for r in runs})
            diff, half, method = c.delta, c.half_width, c.method
            used["methods"].add(method)
        row = {"setting": setting, "variant": variant, "base": runs[0].base if runs else "",
               "knobs": knobs_text(groups[(setting, variant)][0].knobs), "seeds": n,
               "val_loss": loss, "val_loss_ci95": loss_half}
        if with_ppl:
            row.update(val_ppl=ppl, val_ppl_ci95=ppl_half)
        row.update(delta=diff, delta_ci95=half, delta_method=method,
                   train_tokens=next(iter(tokens)) if len(tokens) == 1 else None)
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
        else:
            # One seed on a side already reads "no CI: one seed"; the others name their interval.
            delta_text = fmt_delta(diff, half, 4) + ("" if math.isnan(half) else f" ({method})")
        shown = {"Setting": setting, "Variant": variant, "Seeds": str(n),
                 "Val loss (95% CI)": fmt_ci(loss, loss_half, n, 4)}
        if with_ppl:
            shown["Val ppl (95% CI)"] = fmt_ci(ppl, ppl_half, n, 2)
        else:
            shown = {"Setting": setting, "Variant": variant, "Knobs": row["knobs"], "Seeds": str(n),
                     "Val loss (95% CI)": shown["Val loss (95% CI)"]}
        shown[f"Δ loss vs {reference} (95% CI, method)"] = delta_text
        display.append(shown)
    return data, display, used


def _comparison_notes(used: dict, reference: str, display: list[dict],
                      rows: list[dict]) -> list[str]:
    """How the Δ column was computed, and the training budget of the compared runs."""
    methods = used["methods"]
    notes = []
    if methods:
        words = {"paired t": "paired t-interval of the per-seed differences where the runs share seeds",
                 "Welch": "Welch interval (unequal variances) where they share none",
                 "one seed": "no interval where a side has one seed"}
        notes.append(f"Δ is the row − {reference} in final validation loss with a 95% interval: "
                     + "; ".join(words[m] for m in ("paired t", "Welch", "one seed") if m in methods)
                     + ". Negative Δ is better.")
    tokens = {t for t in used["tokens"] if t is not None}
    if used["refused"]:
        notes.append(f"No Δ for {', '.join(used['refused'])}: their runs trained on another number of tokens "
                     f"than {reference}'s, so a difference would mix the method with the budget.")
    if len(tokens) == 1:
        notes.append(f"Every run trained on {fmt_count(next(iter(tokens)))} tokens.")
    elif len(tokens) > 1:
        # The budget varies between settings on purpose (an axis of the grid): say so in every row.
        for shown, row in zip(display, rows):
            value = row.get("train_tokens")
            shown["Train tokens"] = "—" if value is None or (isinstance(value, float) and math.isnan(value)) \
                else fmt_count(value)
        notes.append("The training budget differs between rows (column Train tokens); Δ is only taken between "
                     "runs of one budget.")
    return notes


def main_table(sweep: Sweep, baseline: str = "preln") -> Table:
    """Final validation loss and perplexity per variant, mean ± 95% CI over seeds, and the Welch difference."""
    baseline = split_variant(baseline)[0]
    groups = group_runs(sweep.runs)
    show_setting = any(s for s, _ in groups)
    data, display, used = _comparison_rows(groups, _ordered_keys(groups, baseline), baseline, with_ppl=True)
    notes = ["Mean over seeds ± half-width of the two-sided 95% Student-t interval. Only finished runs are "
             "counted; a cell with one seed has no interval.",
             *_comparison_notes(used, baseline, display, data)]
    return Table("main", "Main comparison: final validation loss and perplexity", pd.DataFrame(data),
                 pd.DataFrame(_with_setting(display, show_setting)), notes)


def ablation_table(sweep: Sweep, reference: str = "ldm-rls") -> Table | None:
    """One row per knob setting of the LDM family against the default ``ldm-rls``; None without LDM runs."""
    reference = split_variant(reference)[0]
    runs = [r for r in sweep.runs if r.base in LDM_BASES]
    if not runs:
        return None
    groups = group_runs(runs)
    show_setting = any(s for s, _ in groups)
    data, display, used = _comparison_rows(groups, _ordered_keys(groups, reference), reference, with_ppl=False)
    notes = [f"Variants whose base is {' or '.join(LDM_BASES)}, against {reference} at its defaults.",
             *_comparison_notes(used, reference, display, data)]
    return Table("ablations", f"LDM ablations against the default {reference}", pd.DataFrame(data),
                 pd.DataFrame(_with_setting(display, show_setting)), notes)


def choose_metric(metrics: set[str]) -> str | None:
    """``acc_norm`` where a task reports it, else ``acc``, else None."""
    return "acc_norm" if "acc_norm" in metrics else "acc" if "acc" in metrics else None


def downstream_table(sweep: Sweep, baseline: str = "preln") -> Table | None:
    """Accuracy per task (acc_norm where reported, else acc) and the task average, per variant."""
    baseline = split_variant(baseline)[0]
    finished = [r for r in sweep.finished() if r.eval is not None and {"task", "metric", "value"} <= set(r.eval)]
    if not finished:
        return None
    reported: dict[str, set[str]] = defaultdict(set)
    for run in finished:
        for task, metric in zip(run.eval["task"].astype(str), run.eval["metric"].astype(str)):
            reported[task].add(metric)
    chosen = {t: choose_metric(m) for t, m in sorted(reported.items())}
    tasks = [t for t, m in chosen.items() if m]
    if not tasks:
        return None
    groups = group_runs(finished)
    show_setting = any(s for s, _ in groups)
    data, display = [], []
    for setting, variant in _ordered_keys(groups, baseline):
        runs = groups[(setting, variant)]
        row = {"setting": setting, "variant": variant, "seeds": len(runs)}
        for task in tasks:
            values = [float(v) for run in runs for t, m, v in zip(run.eval["task"].astype(str),
                                                                    run.eval["metric"].astype(str),
                                                                    run.eval["value"])
                      if t == task and m == chosen[task] and not math.isnan(float(v))]
            row[task] = float(np.mean(values)) if values else math.nan
        present = [row[t] for t in tasks if not math.isnan(row[t])]
        row["average"] = float(np.mean(present)) if len(present) == len(tasks) else math.nan
        data.append(row)
        shown = {"Setting": setting, "Variant": variant, "Seeds": str(len(runs))}
        shown.update({t: "—" if math.isnan(row[t]) else f"{100 * row[t]:.1f}" for t in tasks})
        shown["Average"] = "—" if math.isnan(row["average"]) else f"{100 * row['average']:.1f}"
        display.append(shown)
    metric_list = ", ".join(f"{t}: {m}" for t, m in chosen.items() if m)
    notes = [f"Accuracy in percent, mean over the finished runs with downstream results. Metric per task: "
             f"{metric_list}. The average is over all tasks and is left blank where a task is missing."]
    skipped = [t for t, m in chosen.items() if not m]
    if skipped:
        notes.append(f"Tasks without acc or acc_norm, not shown: {', '.join(skipped)}.")
    return Table("downstream", "Downstream accuracy", pd.DataFrame(data),
                 pd.DataFrame(_with_setting(display, show_setting)), notes)


COST_FIELDS = ("params", "extra_params", "stream_floats_per_token", "extra_flops_per_token", "tokens_per_s",
               "peak_mem_bytes")


def cost_table(sweep: Sweep, baseline: str = "preln") -> Table | None:
    """Parameters, stream floats per token, throughput and peak memory per variant, relative to the baseline."""
    baseline = split_variant(baseline)[0]
    finished = [r for r in sweep.finished() if r.summary]
    if not finished:
        return None
    groups = group_runs(finished)
    show_setting = any(s for s, _ in groups)

    def field_mean(runs: list[Run], name: str) -> float:
        values = [float(r.summary[name]) for r in runs if isinstance(r.summary.get(name), (int, float))]
        return float(np.mean(values)) if values else math.nan

    data, display = [], []
    for setting, variant in _ordered_keys(groups, baseline):
        runs, ref = groups[(setting, variant)], groups.get((setting, baseline), [])
        row = {"setting": setting, "variant": variant, "seeds": len(runs)}
        row.update({name: field_mean(runs, name) for name in COST_FIELDS})
        for name in ("params", "tokens_per_s", "peak_mem_bytes"):
            ref_value = field_mean(ref, name) if ref else math.nan
            row[f"{name}_rel"] = row[name] / ref_value if ref_value and not math.isnan(ref_value) else math.nan
        data.append(row)
        display.append({
            "Setting": setting, "Variant": variant,
            "Params": f"{fmt_count(row['params'])} ({fmt_ratio(row['params_rel'])})",
            "Extra params": fmt_count(row["extra_params"]),
            "Stream floats/token": fmt_count(row["stream_floats_per_token"]),
            "Extra FLOPs/token": fmt_count(row["extra_flops_per_token"]),
            "Tokens/s": f"{fmt_count(row['tokens_per_s'])} ({fmt_ratio(row['tokens_per_s_rel'])})",
            "Peak memory": f"{fmt_bytes(row['peak_mem_bytes'])} ({fmt_ratio(row['peak_mem_bytes_rel'])})",
        })
    notes = [f"From each finished run's summary.json, mean over seeds; ratios in parentheses are relative to "
             f"{baseline} in the same setting. Throughput and memory depend on the hardware the runs used."]
    return Table("cost", "Cost relative to the baseline", pd.DataFrame(data),
                 pd.DataFrame(_with_setting(display, show_setting)), notes)


BENCH_COLUMNS = ("variant", "depth", "width", "seq_len", "step_time_ms", "ratio_time", "peak_mem_bytes", "ratio_mem")


def read_bench(path: Path) -> pd.DataFrame:
    """The benchmark CSV with canonical variant names, sorted; raises ValueError when it lacks a column."""
    frame = pd.read_csv(path)
    missing = [c for c in BENCH_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"it lacks the columns {', '.join(missing)}")
    frame["variant"] = [split_variant(str(v))[0] for v in frame["variant"]]
    return frame.sort_values(["variant", "depth", "width", "seq_len"], kind="stable").reset_index(drop=True)


def bench_table(bench: pd.DataFrame, baseline: str = "preln") -> Table:
    """The benchmark's step time and peak memory per variant and size, with ratios to the baseline."""
    baseline = split_variant(baseline)[0]
    order = {v: i for i, v in enumerate(variant_order(bench["variant"], baseline))}
    data = bench.assign(_o=bench["variant"].map(order)).sort_values(
        ["_o", "depth", "width", "seq_len"], kind="stable").drop(columns="_o").reset_index(drop=True)
    display = pd.DataFrame({
        "Variant": data["variant"], "Depth": data["depth"].astype(str), "Width": data["width"].astype(str),
        "Seq len": data["seq_len"].astype(str), "Step time (ms)": [f"{v:.2f}" for v in data["step_time_ms"]],
        "Time ×": [fmt_ratio(v) for v in data["ratio_time"]], "Peak memory": [fmt_bytes(v) for v in
                                                                              data["peak_mem_bytes"]],
        "Memory ×": [fmt_ratio(v) for v in data["ratio_mem"]]})
    notes = [f"From the benchmark CSV (depthmem bench); ratios are relative to {baseline} at the same size."]
    return Table("bench", "Measured overhead (benchmark)", data[list(BENCH_COLUMNS)], display, notes)


def runs_table(sweep: Sweep) -> Table:
    """Every run kept out of the averages (failed, diverged, unfinished, or without a final loss) and why."""
    data, display = [], []
    for run in sweep.excluded():
        reason = run.message
        if run.state == "done":
            reason = reason or "finished without a readable final validation loss in summary.json"
        data.append({"run_id": run.run_id, "run_dir": run.rel, "variant": run.variant, "seed": run.seed,
                     "state": run.state, "step": run.status.get("step"), "message": reason})
        step = run.status.get("step")
        display.append({"Run": run.run_id, "Variant": run.variant, "Seed": str(run.seed), "State": run.state,
                        "Step": "—" if step is None else str(step), "Message": reason or "—"})
    columns = ["Run", "Variant", "Seed", "State", "Step", "Message"]
    return Table("excluded_runs", "Runs not counted in any average",
                 pd.DataFrame(data, columns=["run_id", "run_dir", "variant", "seed", "state", "step", "message"]),
                 pd.DataFrame(display, columns=columns))


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
_LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                   "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(ch, ch) for ch in text)


def to_latex(table: Table) -> str:
    """The table as a LaTeX ``table`` float with booktabs rules (needs ``\\usepackage{booktabs}``)."""
    styler = table.display.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    caption = table.title + (". " + " ".join(table.notes) if table.notes else "")
    text = styler.to_latex(hrules=True, caption=_latex_escape(caption), label=f"tab:{table.name}",
                           position="t", position_float="centering",
                           column_format="l" * len(table.display.columns))
    for symbol, latex in _LATEX_SYMBOLS.items():
        text = text.replace(symbol, latex)
    return text


def write_table(table: Table, folder: Path) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.tex`` and ``<name>.csv`` into ``folder`` atomically."""
    folder = Path(folder)
    return {"md": atomic_write_text(folder / f"{table.name}.md", to_markdown(table) + "\n"),
            "tex": atomic_write_text(folder / f"{table.name}.tex", to_latex(table)),
            "csv": atomic_write_text(folder / f"{table.name}.csv", table.data.to_csv(index=False))}
