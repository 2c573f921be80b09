"""What the tables share: row order, runs grouped by setting and variant, failures, token budgets and the
grid's axes as columns.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import pandas as pd

from harness.reporting.render import fmt_count
from harness.reporting.results import Run, Sweep, typed_columns
from harness.reporting.stats import Comparison, compare
from variants.registry import format_value

LDM_BASES = ("ldm", "ldm-rls")


NO_CI = "no CI: one seed"


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


def train_tokens(run: Run) -> int | None:
    """Tokens a finished run trained on: ``train_tokens`` of its summary, else the tokens of its last step."""
    summary = run.summary or {}
    for key in ("train_tokens", "tokens"):
        value = summary.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return int(value)
    return None


def finished_runs(groups: dict[tuple[str, str], list[Run]], setting: str, variant: str) -> list[Run]:
    """The runs of ``variant`` in ``setting`` that count: finished, with a final validation loss."""
    return [r for r in groups.get((setting, variant), []) if r.final_loss is not None]


def one_budget(runs: Iterable[Run], ref_runs: Iterable[Run]) -> bool:
    """Whether both sides trained on one token budget, and a known one: no Δ is computed across budgets."""
    tokens = {train_tokens(r) for r in [*runs, *ref_runs]}
    return len(tokens) == 1 and None not in tokens


def delta(runs: list[Run], ref_runs: list[Run]) -> Comparison | None:
    """``runs`` minus ``ref_runs`` in final loss, paired by seed where seeds are shared; None without runs on both
    sides on one known budget. The one rule every table and every declared family computes a Δ by."""
    if not runs or not ref_runs or not one_budget(runs, ref_runs):
        return None
    return compare({r.seed: r.final_loss for r in ref_runs}, {r.seed: r.final_loss for r in runs})


def budget_text(tokens: set[int | None]) -> str:
    known = sorted(t for t in tokens if t is not None)
    words = [fmt_count(t) for t in known] + (["unknown"] if None in tokens else [])
    return " and ".join(words) + " tokens"


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


def ordered_keys(groups: dict[tuple[str, str], list[Run]], reference: str) -> list[tuple[str, str]]:
    keys = []
    for setting in sorted({s for s, _ in groups}):
        keys += [(setting, v) for v in variant_order([v for s, v in groups if s == setting], reference)]
    return keys


def perplexity(run: Run) -> float:
    value = run.summary.get("val_ppl") if run.summary else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.exp(run.final_loss)


def one_seed_note(data: pd.DataFrame, column: str = "seeds") -> list[str]:
    """The note that replaces "no CI" in every cell: which rows have a single seed, said once."""
    if column not in data or not (data[column] == 1).any():
        return []
    return [
        f"{NO_CI[0].upper()}{NO_CI[1:]}: rows with a single finished seed show the mean alone, without an interval."
    ]


def setting_axes(sweep: Sweep) -> dict[str, dict]:
    """Setting label -> its typed axis values (``{"n_blocks": 4, "lr": 0.001}``)."""
    return {run.setting: dict(run.axes) for run in sweep.runs}


def with_axes(data: list[dict], display: list[dict], sweep: Sweep) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both frames with one column per grid axis in place of the setting label (typed in ``data``)."""
    axes = setting_axes(sweep)
    names = list(sweep.axis_keys)
    data_rows, shown_rows = [], []
    for row, shown in zip(data, display):
        values = axes.get(row.get("setting", ""), {})
        data_rows.append({**row, **{n: values.get(n) for n in names}})
        head = {n: axis_text(values.get(n)) for n in names}
        shown_rows.append({**head, **{k: v for k, v in shown.items() if k != "Setting"}})
    frame = pd.DataFrame(data_rows)

    return typed_columns(frame, sweep), pd.DataFrame(shown_rows)


def axis_text(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:g}"

    return format_value(value)
