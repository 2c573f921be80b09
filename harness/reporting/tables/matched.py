"""Each variant against its own parameter-matched PreLN (``matched``): the reference that separates a mixer from
the parameters it adds."""

from __future__ import annotations

from harness.reporting.claims import matched_preln
from harness.reporting.items import Context, NoData, table
from harness.reporting.render import Table
from harness.reporting.tables.common import group_runs, one_seed_note, with_axes
from harness.reporting.tables.comparisons import comparison_notes, comparison_rows
from harness.reporting.tables.families import declared


def matched_keys(groups: dict) -> list[tuple[str, str]]:
    """(setting, variant) of every variant, not a PreLN itself, whose matched PreLN ran in the same setting."""
    keys = []
    for setting, variant in sorted(groups):
        if groups[(setting, variant)][0].base == "preln":
            continue
        try:
            reference = matched_preln(variant)
        except Exception:  # a name this checkout's registry does not know has no matched PreLN here
            continue
        if (setting, reference) in groups:
            keys.append((setting, variant))
    return keys


@table("matched", needs="runs of a variant and of its `preln(match=<variant>)`")
def matched_table(ctx: Context) -> Table:
    """Each variant minus its own parameter-matched PreLN (`preln(match=<variant>)`, run in the same setting):
    mean ± t-interval, Δ paired on seeds with the number of pairs and its interval, and its p-value Holm-adjusted
    over the table (within its declared family, where the grid declares families)."""
    groups = group_runs(ctx.sweep.runs)
    keys = matched_keys(groups)
    if not keys:
        raise NoData("no variant ran beside its matched PreLN, preln(match=<variant>)")
    data, display, used = comparison_rows(groups, keys, matched_preln, with_ppl=False, tests=declared(ctx))
    display = [
        {"Setting": shown["Setting"], "Variant": shown["Variant"], "Matched PreLN": row["reference"]}
        | {k: v for k, v in shown.items() if k not in ("Setting", "Variant", "Knobs")}
        for row, shown in zip(data, display)
    ]
    notes = [
        "Each variant against the PreLN whose MLPs are widened to its parameter count (column Matched PreLN), "
        "trained on the same seeds: what the variant gains beyond its extra parameters.",
        *comparison_notes(used, "the matched PreLN", display, data),
    ]
    data, display = with_axes(data, display, ctx.sweep)
    notes += one_seed_note(data)
    return Table("matched", "Each variant against its parameter-matched PreLN", data, display, notes)
