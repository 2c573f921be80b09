"""The LDM ablations (``ablations``): every knob setting of ``ldm`` and ``ldm-rls`` against its own base variant at
its defaults (``ldm(...)`` rows against ``ldm``, ``ldm-rls(...)`` rows against ``ldm-rls``), in the rows of the main
comparison."""

from __future__ import annotations

from harness.reporting.items import Context, NoData, table
from harness.reporting.render import Table
from harness.reporting.results import split_variant
from harness.reporting.tables.common import LDM_BASES, group_runs, one_seed_note, variant_order, with_axes
from harness.reporting.tables.comparisons import comparison_notes, comparison_rows
from harness.reporting.tables.families import declared


def ablation_keys(groups: dict, first: str) -> list[tuple[str, str]]:
    """Per setting and base (``first`` first), the base at its defaults and then its knob settings by name; a base
    without a knob setting in the setting is left out."""
    keys = []
    for setting in sorted({s for s, _ in groups}):
        names = [v for s, v in groups if s == setting]
        for base in variant_order(LDM_BASES, first):
            ablated = sorted(v for v in names if v != base and split_variant(v)[1] == base)
            if ablated:
                keys += [(setting, base)] * (base in names) + [(setting, v) for v in ablated]
    return keys


@table("ablations", needs="runs of `ldm` or `ldm-rls` and of their knob settings")
def ablation_table(ctx: Context) -> Table:
    """One row per knob setting of the variants whose base is `ldm` or `ldm-rls`, against that base at its defaults
    (the row's registry name without knobs): mean ± t-interval, Δ with its paired interval and number of pairs, its
    p-value Holm-adjusted over the table (within its declared family, where the grid declares families), and the
    runs that diverged or failed."""
    runs = [r for r in ctx.sweep.runs if r.base in LDM_BASES]
    if not runs:
        raise NoData("no run of ldm or ldm-rls")
    groups = group_runs(runs)
    keys = ablation_keys(groups, split_variant(ctx.ablation_reference)[1])
    if not keys:
        raise NoData("no knob setting of ldm or ldm-rls: every run is a base variant at its defaults")
    data, display, used = comparison_rows(
        groups, keys, lambda v: split_variant(v)[1], with_ppl=False, tests=declared(ctx)
    )
    for row, shown in zip(data, display):
        shown["Against"] = row["reference"]
    display = [
        {k: shown[k] for k in ("Setting", "Variant", "Against")} | {k: v for k, v in shown.items() if k != "Against"}
        for shown in display
    ]
    notes = [
        "Every knob setting against its own base variant at its defaults (column Against): "
        f"{', '.join(f'{b}(...) against {b}' for b in LDM_BASES)}.",
        *comparison_notes(used, "the row's base", display, data),
    ]
    data, display = with_axes(data, display, ctx.sweep)
    notes += one_seed_note(data)
    return Table("ablations", "LDM ablations, each against its own base variant", data, display, notes)
