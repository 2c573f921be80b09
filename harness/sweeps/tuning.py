"""A grid's learning-rate tuning stage: tuning runs per cell, the choice per cell, and ``tuning.json``.

A cell is the set of runs that differ only in their seed (for most grids: one variant). For every tuned cell each
value of ``tune.values`` trains once per tuning seed, with ``data.eval_split=tune``: validated on the tuning
split, carved from the training stream (``harness.data.corpus``), never on the validation split the report's
tables show. When every tuning run of a cell has ended, the value with the lowest mean final ``val_loss`` over
the tuning seeds is the cell's choice, and the cell's runs of the grid train with it. A value with a seed that
diverged (or ended without a finite loss) is never chosen; on a tie the smaller value wins, the step size less
likely to diverge over the longer runs; a choice at the smallest or largest value is flagged ``at_edge``, since
the best value may lie outside the range tried.

With ``tune.variants`` only those variants are tuned; a cell of another variant whose family (the name before
its knobs: ``ldm-rls`` for ``ldm-rls(groups=4)``) is tuned with the same other grid values takes that cell's
choice, so an ablation trains at its reference's rate; any other cell keeps the base learning rate.

Tuning runs live in ``<sweep>/tune/`` with their own ``sweep.json``, so ``depthmem report`` never mixes them
into the tables; the selection is written to ``<sweep>/tuning.json`` on every submission.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.io import atomic_write_json
from harness.rundir import now_iso, read_status, read_summary, run_id
from harness.sweeps.grid import Grid, GridRun, describe_overrides, expand, same_value

TUNE_DIR = "tune"
TUNING_FILE = "tuning.json"
SPLIT_KEY = "data.eval_split"
ENDED = ("done", "diverged")


@dataclass
class Cell:
    """Runs of the grid that differ only in their seed, and where their tuned value comes from."""

    label: str
    overrides: dict[str, Any]
    variant: str
    runs: list[GridRun]
    tuned: bool
    source: str | None = None
    """The label of the tuned cell whose choice this cell takes (its own when tuned); None keeps the base value."""


def _cell_overrides(r: GridRun, axis: str) -> dict[str, Any]:
    return {k: v for k, v in r.overrides.items() if k not in ("train.seed", axis)}


def _family(variant: str) -> str:
    return variant.split("(", 1)[0]


def cells(grid: Grid, runs: list[GridRun]) -> list[Cell]:
    """The grid's cells in grid order, each marked tuned or pointing at the tuned cell it takes its value from."""
    assert grid.tune is not None
    out: dict[str, Cell] = {}
    for r in runs:
        overrides = _cell_overrides(r, grid.tune.axis)
        label = describe_overrides(overrides)
        if label not in out:
            tuned = grid.tune.variants is None or any(same_value(v, r.cfg.variant) for v in grid.tune.variants)
            out[label] = Cell(label, overrides, r.cfg.variant, [], tuned, label if tuned else None)
        out[label].runs.append(r)
    for cell in out.values():
        if cell.tuned:
            continue
        rest = {k: v for k, v in cell.overrides.items() if k != "variant"}
        for other in out.values():
            if (
                other.tuned
                and same_value(other.variant, _family(cell.variant))
                and {k: v for k, v in other.overrides.items() if k != "variant"} == rest
            ):
                cell.source = other.label
                break
    return list(out.values())


def expand_tuning(grid: Grid, cell_list: list[Cell], *, defaults: dict | None = None) -> dict[str, list[GridRun]]:
    """The tuning runs of every tuned cell, validated like the grid's own, by cell label."""
    assert grid.tune is not None
    tune = grid.tune
    include, owners = [], []
    for cell in cell_list:
        if not cell.tuned:
            continue
        seeds = tune.seeds or [cell.runs[0].cfg.train.seed]
        for value in tune.values:
            for seed in seeds:
                include.append({**cell.overrides, tune.axis: value, "train.seed": seed, SPLIT_KEY: "tune"})
                owners.append(cell.label)
    if not include:
        return {}
    # Tuning runs are judged on their loss alone: no downstream evaluation.
    stage = Grid(
        name=grid.name,
        source=f"{grid.source} (tuning stage)",
        base={**grid.base, "eval.tasks": []},
        include=include,
        baseline=grid.baseline,
    )
    by_cell: dict[str, list[GridRun]] = {}
    for owner, r in zip(owners, expand(stage, defaults=defaults)):
        by_cell.setdefault(owner, []).append(r)
    return by_cell


def select(values: list[float], metrics: dict[float, float | None]) -> dict[str, Any]:
    """The chosen value: the lowest finite metric, the smaller value on a tie, never a value without a finite one.

    Returns ``chosen`` (None when no value has a finite metric), ``at_edge`` and ``edge`` (``smallest`` or
    ``largest`` when the choice is an end of the range tried)."""
    finite = {v: m for v, m in metrics.items() if m is not None and math.isfinite(m)}
    if not finite:
        return {"chosen": None, "at_edge": False, "edge": None}
    best = min(finite.values())
    chosen = min(v for v, m in finite.items() if math.isclose(m, best, rel_tol=1e-9, abs_tol=0.0))
    ordered = sorted(values)
    edge = "smallest" if chosen == ordered[0] else "largest" if chosen == ordered[-1] else None
    return {"chosen": chosen, "at_edge": edge is not None, "edge": edge}


def _final_metric(run_dir: Path, metric: str) -> tuple[str, float | None]:
    state = read_status(run_dir).get("state", "pending")
    value = read_summary(run_dir).get(metric) if state == "done" else None
    try:
        value = float(value) if value is not None else None
    except (TypeError, ValueError):
        value = None
    if value is not None and not math.isfinite(value):
        value = None
    return state, value


def selection(grid: Grid, cell_list: list[Cell], by_cell: dict[str, list[GridRun]], tune_dir: Path) -> dict:
    """Each cell's entry of ``tuning.json``: its tuning runs' metrics, its state and its chosen value."""
    assert grid.tune is not None
    tune = grid.tune
    entries: dict[str, dict[str, Any]] = {}
    for cell in cell_list:
        if not cell.tuned:
            continue
        per_value: dict[float, list[tuple[str, str, float | None]]] = {v: [] for v in tune.values}
        for r in by_cell.get(cell.label, []):
            state, value = _final_metric(tune_dir / r.run_id, tune.metric)
            per_value[getattr(r.cfg.train, tune.axis.split(".", 1)[1])].append((r.run_id, state, value))
        states = [s for runs in per_value.values() for _, s, _ in runs]
        metrics = {
            v: (
                sum(x for _, _, x in runs) / len(runs)
                if runs and all(s == "done" and x is not None for _, s, x in runs)
                else None
            )
            for v, runs in per_value.items()
        }
        entry: dict[str, Any] = {
            "cell": cell.label,
            "variant": cell.variant,
            "overrides": cell.overrides,
            "tuned": True,
            "values": list(tune.values),
            "seeds": sorted({r.cfg.train.seed for r in by_cell.get(cell.label, [])}),
            "metric": {_key(v): m for v, m in metrics.items()},
            "runs": {_key(v): {rid: x for rid, _, x in runs} for v, runs in per_value.items()},
            "chosen": None,
            "at_edge": False,
            "edge": None,
        }
        if any(s == "failed" for s in states):
            entry["state"] = "failed"
            entry["reason"] = "a tuning run failed with an error; rerun it with --retry-failed"
        elif not all(s in ENDED for s in states):
            entry["state"] = "tuning"
            done = sum(s in ENDED for s in states)
            entry["reason"] = f"{done} of {len(states)} tuning run(s) have ended"
        else:
            entry.update(select(tune.values, metrics))
            entry["state"] = "chosen" if entry["chosen"] is not None else "diverged"
            if entry["chosen"] is None:
                entry["reason"] = "no tuning value ended with a finite loss on every tuning seed"
        entries[cell.label] = entry
    for cell in cell_list:
        if cell.tuned:
            continue
        source = entries.get(cell.source or "")
        entries[cell.label] = {
            "cell": cell.label,
            "variant": cell.variant,
            "overrides": cell.overrides,
            "tuned": False,
            "from": cell.source,
            "state": source["state"] if source else "base",
            "chosen": source["chosen"] if source else None,
            "at_edge": source["at_edge"] if source else False,
            "edge": source["edge"] if source else None,
        }
    return entries


def _key(value: float) -> str:
    return f"{value:g}"


def apply(grid: Grid, runs: list[GridRun], cell_list: list[Cell], entries: dict) -> tuple[list[GridRun], list[GridRun]]:
    """(every run in grid order, those with their cell's value; the runs that wait for their cell's tuning)."""
    assert grid.tune is not None
    field_name = grid.tune.axis.split(".", 1)[1]
    cell_of = {id(r): cell for cell in cell_list for r in cell.runs}
    out, waiting = [], []
    for r in runs:
        entry = entries[cell_of[id(r)].label]
        if entry["state"] == "base":
            out.append(r)
        elif entry["chosen"] is None:
            # Its id depends on the value still to be chosen, so it is shown by its grid values alone.
            rid = run_id(r.cfg, r.overrides).rsplit("-", 1)[0] + "-(after tuning)"
            waiting.append(GridRun(rid, r.cfg, r.overrides))
            out.append(waiting[-1])
        else:
            train = dataclasses.replace(r.cfg.train, **{field_name: entry["chosen"]})
            cfg = dataclasses.replace(r.cfg, train=train)
            out.append(GridRun(run_id(cfg, r.overrides), cfg, r.overrides))
    return out, waiting


def write(sweep_dir: Path, grid: Grid, entries: dict) -> Path:
    """``tuning.json`` in the sweep folder: the protocol and every cell's entry."""
    assert grid.tune is not None
    tune = grid.tune
    path = Path(sweep_dir) / TUNING_FILE
    atomic_write_json(
        path,
        {
            "axis": tune.axis,
            "values": list(tune.values),
            "select_on": tune.select_on,
            "metric": tune.metric,
            "seeds": tune.seeds,
            "variants": tune.variants,
            "updated": now_iso(),
            "cells": list(entries.values()),
        },
    )
    return path


__all__ = ["Cell", "TUNE_DIR", "TUNING_FILE", "apply", "cells", "expand_tuning", "select", "selection", "write"]
