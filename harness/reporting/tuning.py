"""The report's learning-rate table: each cell's value chosen by the sweep's tuning stage (``tuning.json``).

It is built for every report. A sweep whose grid had no ``tune`` section has no table; the report says so in the
one line ``protocol_line`` gives, under its title.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from harness.reporting.archive import open_source
from harness.reporting.items import Context, NoData, table
from harness.reporting.tables import Table

TUNING_FILE = "tuning.json"


def read_tuning(sweep_dir: str | Path) -> dict[str, Any] | None:
    """The ``tuning.json`` of the sweep at ``sweep_dir`` (a folder or a sweep archive), or of the sweeps under it (a
    results folder holding several: their cells together), or None when no sweep there had a tuning stage or no file
    parses."""
    source = open_source(sweep_dir)
    found = []
    for rel in source.find(TUNING_FILE):
        try:
            data = json.loads(source.read_bytes(rel))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("cells"), list):
            found.append(data)
    if not found:
        return None
    merged = dict(found[0])
    merged["cells"] = [cell for data in found for cell in data["cells"]]
    return merged


def lrs(sweep) -> list[float]:
    """The distinct learning rates the sweep's runs trained at."""
    return sorted({float(r.config.get("train", {}).get("lr", math.nan)) for r in sweep.runs})


def protocol_line(sweep_dir: str | Path, lrs: list[float]) -> str:
    """One sentence on how the runs' learning rates were set."""
    tuning = read_tuning(sweep_dir)
    if tuning is None:
        shown = ", ".join(f"{v:g}" for v in lrs if math.isfinite(v)) or "its config's"
        return (
            f"This sweep had no tuning stage: every run trained at the learning rate in its config ({shown}), "
            "one rate for every variant."
        )
    return (
        f"Each variant's {tuning.get('axis', 'train.lr')} was chosen by a tuning stage on a held-out tuning split, "
        "not on the validation split these tables report (see the learning-rate table)."
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "diverged"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "—"
    return f"{value:.3f}" if math.isfinite(value) else "diverged"


@table("tuning", needs="tuning.json in the sweep folder (a grid with a tune section)", always=True)
def tuning_table(ctx: Context) -> Table:
    """The learning rate each variant trained at, chosen on the tuning split, with every value's tuning loss and a
    flag on a choice at the edge of the values tried."""
    tuning = read_tuning(ctx.sweep.root)
    if tuning is None:
        raise NoData(protocol_line(ctx.sweep.root, lrs(ctx.sweep)))
    axis, values = tuning.get("axis", "train.lr"), [float(v) for v in tuning.get("values", [])]
    data, display = [], []
    for cell in tuning["cells"]:
        chosen = cell.get("chosen")
        edge = cell.get("edge")
        row = {
            "cell": cell.get("cell"),
            "variant": cell.get("variant"),
            "tuned": bool(cell.get("tuned")),
            "from": cell.get("from"),
            "state": cell.get("state"),
            "chosen": chosen,
            "at_edge": bool(cell.get("at_edge")),
            "edge": edge,
        }
        shown = {
            "Variant": str(cell.get("cell", "")).removeprefix("variant="),
            f"Chosen {axis.rsplit('.', 1)[-1]}": "—" if chosen is None else f"{float(chosen):g}",
        }
        metrics = cell.get("metric") or {}
        for v in values:
            key = f"{v:g}"
            column = f"{axis.rsplit('.', 1)[-1]}={key}"
            row[f"loss@{key}"] = metrics.get(key)
            if cell.get("tuned"):
                shown[column] = _fmt(metrics.get(key)) if cell.get("state") in ("chosen", "diverged") else "—"
            else:
                shown[column] = ""
        if not cell.get("tuned"):
            source = cell.get("from")
            note = f"from {str(source).removeprefix('variant=')}" if source else "not tuned: the base value"
        elif cell.get("state") == "chosen":
            note = f"⚠ {edge} value tried" if cell.get("at_edge") else ""
        else:
            note = f"no choice ({cell.get('state')})"
        if not cell.get("tuned") and cell.get("at_edge"):
            note += f"; ⚠ {edge} value tried"
        shown["Note"] = note
        data.append(row)
        display.append(shown)
    seeds = tuning.get("seeds")
    notes = [
        f"Chosen per variant as the lowest mean final {tuning.get('metric', 'val_loss')} over the tuning seeds "
        f"({', '.join(map(str, seeds)) if seeds else 'each variant’s first seed'}) on the tuning split, which is "
        "carved from the training stream and distinct from the validation split of the other tables; a value "
        "that diverged on any seed is never chosen, and a tie goes to the smaller value.",
    ]
    edges = [str(c.get("cell", "")).removeprefix("variant=") for c in tuning["cells"] if c.get("at_edge")]
    if edges:
        notes.append(
            f"⚠ {len(edges)} choice(s) at the edge of the values tried ({', '.join(edges)}): the best learning rate "
            "may lie outside them; widen tune.values."
        )
    return Table(
        "tuning",
        f"Learning rates chosen on the tuning split ({axis})",
        pd.DataFrame(data),
        pd.DataFrame(display),
        notes,
    )
