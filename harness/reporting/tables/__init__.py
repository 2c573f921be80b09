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

The tables live in one module per topic, their rendering in ``harness.reporting.render``; importing this
package registers them all, in the order of the report and of ``docs/report.md``.
"""

from __future__ import annotations

# ruff: noqa: I001  (the import order is the registration order, which the report and docs/report.md follow)
from harness.reporting.render import (
    SIGNIFICANCE,
    Table,
    column_alignment,
    fmt_bytes,
    fmt_ci,
    fmt_count,
    fmt_delta,
    fmt_p,
    fmt_ratio,
    to_latex,
    to_markdown,
    write_table,
)
from harness.reporting.tables.common import (
    LDM_BASES,
    NO_CI,
    axis_text,
    budget_text,
    failures,
    failures_text,
    group_runs,
    one_seed_note,
    ordered_keys,
    perplexity,
    setting_axes,
    train_tokens,
    variant_order,
    with_axes,
)
from harness.reporting.tables.comparisons import (
    CHANCE,
    chance_level,
    choose_metric,
    downstream_scores,
    downstream_table,
    main_table,
)
from harness.reporting.tables.families import Family, declared, family_lines, family_tests
from harness.reporting.tables.paired_items import downstream_paired_table
from harness.reporting.tables.matched import matched_table
from harness.reporting.tables.ablations import ablation_table
from harness.reporting.tables.accounting import (
    BENCH_COLUMNS,
    COST_FIELDS,
    MEMORY_METHODS,
    bench_table,
    compute_multiplier_table,
    cores_shared,
    cost_table,
    memory_method,
    read_bench,
    runs_table,
)

__all__ = [
    "SIGNIFICANCE",
    "Table",
    "column_alignment",
    "fmt_bytes",
    "fmt_ci",
    "fmt_count",
    "fmt_delta",
    "fmt_p",
    "fmt_ratio",
    "to_latex",
    "to_markdown",
    "write_table",
    "LDM_BASES",
    "NO_CI",
    "axis_text",
    "budget_text",
    "failures",
    "failures_text",
    "group_runs",
    "one_seed_note",
    "ordered_keys",
    "perplexity",
    "setting_axes",
    "train_tokens",
    "variant_order",
    "with_axes",
    "CHANCE",
    "ablation_table",
    "chance_level",
    "choose_metric",
    "downstream_scores",
    "downstream_table",
    "downstream_paired_table",
    "Family",
    "declared",
    "family_lines",
    "family_tests",
    "matched_table",
    "main_table",
    "BENCH_COLUMNS",
    "COST_FIELDS",
    "MEMORY_METHODS",
    "bench_table",
    "compute_multiplier_table",
    "cores_shared",
    "cost_table",
    "memory_method",
    "read_bench",
    "runs_table",
]
