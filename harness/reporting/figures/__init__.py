"""The paper's figures, drawn with seaborn on matplotlib's Agg canvas from a loaded sweep.

Each figure is one function registered with ``@figure`` (``harness.reporting.items``): it takes the report's
``Context`` and returns ``(figure, caption)``, or raises ``NoData`` with the reason it cannot be drawn, which
the report prints instead of failing. Figures are built without pyplot (``Figure`` with an Agg canvas), so no
global backend or state changes and nothing needs closing. Every variant keeps one colour in every figure and
every report: ``palette`` gives each registered variant (at its default knobs) the colour of its place in the
variant registry, so PreLN is always the first tab10 colour; knob settings get colours of their own, 20 names
in tab20's distinct hues and lightness. Heatmaps share one colour scale when their ranges are alike, else each has
its own. Panels wrap at four per row, legends sit below the panels, axes that count take whole-number ticks, and
error bars of variants at one x are set side by side. ``save_figure`` writes PNG and PDF with fixed metadata (no
timestamps, no software version in the PNG), atomically, so the same inputs give the same bytes.

The figures live in one module per topic; importing this package registers them all, in the order of the
report and of ``docs/report.md``.
"""

from __future__ import annotations

# ruff: noqa: I001  (the import order is the registration order, which the report and docs/report.md follow)
from harness.reporting.figures.common import (
    DPI,
    MAX_COLUMNS,
    QUALITATIVE,
    colour_limits,
    dodged,
    finish,
    integer_ticks,
    panel_title,
    interval_text,
    main_setting,
    palette,
    figure_grid,
    save_figure,
    setting_note,
    shared_legend,
    sort_key,
    wrapped,
)
from harness.reporting.figures.curves import final_loss, loss_curves
from harness.reporting.figures.knobs import KNOB_LABELS, ablation_comparisons, ablation_grid, ablations, knob_label
from harness.reporting.figures.scaling import BUDGET_KEYS, axis_slice, depth, frontier, hyperparameters, numeric_axes
from harness.reporting.figures.learned import lambda_seeds, layer_profiles, learned_lambda, omega_profile
from harness.reporting.figures.mixing import MAX_GROUP_PANELS, mixing_groups, mixing_matrices
from harness.reporting.figures.accuracy import downstream
from harness.reporting.figures.costs import overhead
from harness.reporting.items import names

FIGURES = names("figure")

__all__ = [
    "DPI",
    "MAX_COLUMNS",
    "QUALITATIVE",
    "colour_limits",
    "dodged",
    "finish",
    "integer_ticks",
    "panel_title",
    "interval_text",
    "main_setting",
    "palette",
    "figure_grid",
    "save_figure",
    "setting_note",
    "shared_legend",
    "sort_key",
    "wrapped",
    "final_loss",
    "loss_curves",
    "KNOB_LABELS",
    "ablation_comparisons",
    "ablation_grid",
    "ablations",
    "knob_label",
    "BUDGET_KEYS",
    "axis_slice",
    "depth",
    "frontier",
    "hyperparameters",
    "numeric_axes",
    "lambda_seeds",
    "layer_profiles",
    "learned_lambda",
    "omega_profile",
    "MAX_GROUP_PANELS",
    "mixing_groups",
    "mixing_matrices",
    "downstream",
    "overhead",
    "FIGURES",
]
