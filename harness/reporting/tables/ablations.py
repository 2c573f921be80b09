"""The LDM ablations (``ablations``): every knob setting of ``ldm`` and ``ldm-rls`` against one reference setting,
in the rows of the main comparison."""

from __future__ import annotations

from harness.reporting.items import Context, NoData, table
from harness.reporting.render import Table
from harness.reporting.results import split_variant
from harness.reporting.tables.common import LDM_BASES, group_runs, one_seed_note, ordered_keys, with_axes
from harness.reporting.tables.comparisons import comparison_notes, comparison_rows


@table("ablations", needs="runs of `ldm` or `ldm-rls`")
def ablation_table(ctx: Context) -> Table:
    """One row per knob setting of the variants whose base is `ldm` or `ldm-rls`, against the report's
    `ablation_reference` (default `ldm-rls`): mean ± t-interval, Δ with its paired interval and number of pairs,
    its p-value Holm-adjusted over the table, and the runs that diverged or failed."""
    sweep, reference = ctx.sweep, split_variant(ctx.ablation_reference)[0]
    runs = [r for r in sweep.runs if r.base in LDM_BASES]
    if not runs:
        raise NoData("no run of ldm or ldm-rls")
    if all(r.variant == reference for r in runs):
        raise NoData(f"no ablation of {reference}: every ldm or ldm-rls run is the reference itself")
    groups = group_runs(runs)
    data, display, used = comparison_rows(groups, ordered_keys(groups, reference), reference, with_ppl=False)
    notes = [
        f"Variants whose base is {' or '.join(LDM_BASES)}, against {reference}.",
        *comparison_notes(used, reference, display, data),
    ]
    data, display = with_axes(data, display, sweep)
    notes += one_seed_note(data)
    return Table("ablations", f"LDM ablations against {reference}", data, display, notes)
