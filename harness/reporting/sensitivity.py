"""How the verdicts move with the learning rate, from the tuning runs (``tuning.json``) alone.

``lr_sensitivity`` (table and figure) gives every tuned variant's tuning loss at every rate tried, the mean and
the spread over the tuning seeds, and marks a choice that a neighbouring rate matches within the standard error
of their difference. ``lr_neighbours`` takes each headline comparison (the declared claims, else every tuned
variant against the baseline) and recomputes its Δ on the tuning split when both sides move one step down or up
the grid of rates, saying when the sign changes. All numbers are tuning-split losses at the tuning seeds: the
evaluation runs exist only at the chosen rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from harness.reporting.figures.common import dodged, dodged_errorbar, figure_grid, shared_legend
from harness.reporting.items import Context, NoData, figure, table
from harness.reporting.results import split_variant
from harness.reporting.tables import Table, variant_order
from harness.reporting.tuning import read_tuning

NO_TUNING = "no tuning.json with tuning runs (a grid with a tune section)"


@dataclass
class Curve:
    """One tuned cell: its tuning losses by rate (None where a run diverged or has not ended)."""

    setting: str
    variant: str
    values: list[float]
    losses: dict[float, list[float | None]]
    chosen: float | None

    def stats(self, value: float) -> tuple[float, float, float, int]:
        """Mean, seed standard deviation, standard error and number of tuning runs at ``value`` (NaN mean when a
        run diverged or none ended)."""
        runs = self.losses.get(value, [])
        if not runs or any(x is None for x in runs):
            return math.nan, math.nan, math.nan, len(runs)
        x = np.asarray(runs, dtype=np.float64)
        sd = float(x.std(ddof=1)) if len(x) > 1 else math.nan
        return float(x.mean()), sd, sd / math.sqrt(len(x)), len(x)

    def mean(self, value: float) -> float:
        return self.stats(value)[0]

    def step(self, value: float | None, by: int) -> float | None:
        """The rate ``by`` steps from ``value`` on the grid of rates tried; None off its ends."""
        if value is None or value not in self.values:
            return None
        i = self.values.index(value) + by
        return self.values[i] if 0 <= i < len(self.values) else None


def _setting(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in (overrides or {}).items() if k != "variant")


def curves(sweep_root) -> tuple[list[Curve], dict[tuple[str, str], str]]:
    """The tuned cells' curves, and for every cell that took another's rate, the variant it took it from."""
    tuning = read_tuning(sweep_root)
    if tuning is None:
        raise NoData(NO_TUNING)
    values = sorted(float(v) for v in tuning.get("values", []))
    out, borrowed = [], {}
    for cell in tuning["cells"]:
        setting, variant = _setting(cell.get("overrides")), split_variant(str(cell.get("variant", "")))[0]
        if not cell.get("tuned"):
            borrowed[(setting, variant)] = str(cell.get("from") or "the base value").removeprefix("variant=")
            continue
        runs = cell.get("runs") or {}
        losses = {v: [_finite(x) for x in (runs.get(f"{v:g}") or {}).values()] for v in values}
        chosen = cell.get("chosen")
        out.append(Curve(setting, variant, values, losses, None if chosen is None else float(chosen)))
    if not any(any(c.losses.values()) for c in out):
        raise NoData("tuning.json records no tuning run's loss")
    return out, borrowed


def tuning_curves(ctx: Context) -> tuple[list[Curve], dict[tuple[str, str], str]]:
    """``curves`` of the report's sweep, read once per report (three items and the claims use them)."""
    return ctx.cached("tuning_curves", lambda: curves(ctx.sweep.root))


def _finite(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def near_ties(curve: Curve) -> list[str]:
    """The neighbours of the choice whose mean loss is within the standard error of the difference."""
    best, _, se_best, _ = curve.stats(curve.chosen) if curve.chosen is not None else (math.nan,) * 4
    ties = []
    for by in (-1, 1):
        other = curve.step(curve.chosen, by)
        if other is None:
            continue
        mean, _, se, _ = curve.stats(other)
        se_diff = math.hypot(se_best, se)
        if math.isfinite(mean) and math.isfinite(se_diff) and abs(mean - best) <= se_diff:
            ties.append(f"{other:g} (Δ {mean - best:+.4f}, SE {se_diff:.4f})")
    return ties


def _cell(curve: Curve, value: float) -> str:
    mean, sd, _, n = curve.stats(value)
    if n == 0:
        return "—"
    if math.isnan(mean):
        return "diverged"
    text = f"{mean:.4f}" + ("" if math.isnan(sd) else f" ± {sd:.4f}")
    return text + (" ◀" if value == curve.chosen else "")


@table("lr_sensitivity", needs="tuning.json with each tuning run's loss (a grid with a tune section)")
def lr_sensitivity_table(ctx: Context) -> Table:
    """Tuning loss against learning rate per tuned variant: the mean ± the standard deviation over the tuning
    seeds at every rate tried, the chosen rate marked, and a flag where a neighbouring rate is within the standard
    error of the difference of the choice (the choice is then a near tie)."""
    found, _ = tuning_curves(ctx)
    data, display, flagged, one_seed = [], [], [], False
    for curve in found:
        row = {"setting": curve.setting, "variant": curve.variant, "chosen": curve.chosen}
        shown = {"Setting": curve.setting, "Variant": curve.variant}
        for v in curve.values:
            mean, sd, se, n = curve.stats(v)
            row |= {f"loss@{v:g}": mean, f"sd@{v:g}": sd, f"se@{v:g}": se, f"runs@{v:g}": n}
            shown[f"lr={v:g}"] = _cell(curve, v)
            one_seed = one_seed or n == 1
        ties = near_ties(curve)
        row["near_tie"] = bool(ties)
        shown["Chosen"] = "—" if curve.chosen is None else f"{curve.chosen:g}"
        shown["Near tie"] = "⚠ " + "; ".join(ties) if ties else ""
        flagged += [curve.variant] * bool(ties)
        data.append(row)
        display.append(shown)
    if not any(r["setting"] for r in data):
        for shown in display:
            del shown["Setting"]
    notes = [
        "Final loss on the tuning split at each learning rate tried: mean ± standard deviation over the tuning "
        "seeds (no spread with one seed); ◀ marks the chosen rate; diverged: a run at that rate did not end with a "
        "finite loss.",
        "Near tie: a neighbouring rate whose mean differs from the choice's by no more than the standard error of "
        "the difference (the two rates' standard errors over the tuning seeds, in quadrature): the tuning cannot "
        "tell the two apart, and a verdict should hold at both (see the neighbouring-rate Δ table).",
    ]
    if flagged:
        notes.append(f"⚠ Near-tie choices: {', '.join(flagged)}.")
    if one_seed:
        notes.append("With one tuning seed there is no standard error, so no choice can be marked a near tie.")
    return Table(
        "lr_sensitivity",
        "Learning-rate sensitivity: tuning loss at every rate tried",
        pd.DataFrame(data),
        pd.DataFrame(display),
        notes,
    )


def headline(ctx: Context, found: list[Curve]) -> list[tuple[str, str]]:
    """The comparisons to re-take at the neighbouring rates: the declared claims, else each variant − baseline."""
    if ctx.claims is not None:
        return list(dict.fromkeys((c.variant, c.against) for c in ctx.claims))
    baseline = split_variant(ctx.baseline)[0]
    names = variant_order({c.variant for c in found}, baseline)
    return [(v, baseline) for v in names if v != baseline]


def _delta(a: Curve, b: Curve, by: int) -> tuple[float, str]:
    """``a − b`` in mean tuning loss with both moved ``by`` steps from their chosen rates, and its cell."""
    va, vb = a.step(a.chosen, by), b.step(b.chosen, by)
    if va is None or vb is None:
        return math.nan, "— (edge of the rates)"
    ma, mb = a.mean(va), b.mean(vb)
    if math.isnan(ma) or math.isnan(mb):
        return math.nan, f"— (diverged at {va:g} or {vb:g})"
    return ma - mb, f"{ma - mb:+.4f} ({va:g} vs {vb:g})"


def _sign_changes(at: dict[int, float]) -> list[str]:
    """The neighbours (``one step down``, ``one step up``) where the Δ has the other sign than at the chosen rates."""
    return [word for by, word in ((-1, "one step down"), (1, "one step up")) if at[by] * at[0] < 0]


def _sign_text(at: dict[int, float]) -> str:
    if math.isnan(at[0]):
        return "—"
    changed = _sign_changes(at)
    return "⚠ changes " + " and ".join(changed) if changed else "kept"


@table("lr_neighbours", needs="tuning.json with each tuning run's loss, both sides of a comparison tuned")
def lr_neighbours_table(ctx: Context) -> Table:
    """Each headline Δ (the declared claims, else every tuned variant − the baseline) on the tuning split at the
    chosen rates and with both sides moved one step down or up the grid of rates, with a flag where its sign
    changes."""
    found, borrowed = tuning_curves(ctx)
    by_key = {(c.setting, c.variant): c for c in found}
    data, display = [], []
    for setting in sorted({c.setting for c in found} | {s for s, _ in borrowed}):
        for variant, against in headline(ctx, found):
            a, b = by_key.get((setting, variant)), by_key.get((setting, against))
            if a is None and b is None:
                continue
            row = {"setting": setting, "variant": variant, "against": against}
            shown = {"Setting": setting, "Variant": variant, "Against": against}
            if a is None or b is None:
                name = variant if a is None else against
                source = borrowed.get((setting, name))
                why = f"{name} not tuned" + (f"; it takes the rate of {source}" if source else "")
                row |= {"delta_down": math.nan, "delta": math.nan, "delta_up": math.nan, "sign_changes": False}
                shown |= {"Δ, one step down": "—", "Δ at the chosen rates": f"— ({why})", "Δ, one step up": "—"}
                shown["Sign"] = "—"
            else:
                at, cells = {}, {}
                for by in (-1, 0, 1):
                    at[by], cells[by] = _delta(a, b, by)
                row |= {"delta_down": at[-1], "delta": at[0], "delta_up": at[1]}
                row["sign_changes"] = bool(_sign_changes(at))
                shown |= {"Δ, one step down": cells[-1], "Δ at the chosen rates": cells[0], "Δ, one step up": cells[1]}
                shown["Sign"] = _sign_text(at)
            data.append(row)
            display.append(shown)
    if not data:
        raise NoData("no headline comparison has a tuned side")
    if not any(r["setting"] for r in data):
        for shown in display:
            del shown["Setting"]
    changed = [f"{r['variant']} − {r['against']}" for r in data if r["sign_changes"]]
    notes = [
        "Δ is the row − Against in mean final loss on the tuning split over the tuning seeds (the rates in "
        "parentheses), at the rates each side chose and with both sides moved one step down or up the rates "
        "tried; the evaluation runs exist only at the chosen rates, so these are the tuning runs' numbers.",
        "Sign: kept where the Δ has the sign of the chosen rates' Δ at both neighbours that could be taken; "
        "⚠ where it changes.",
    ]
    if changed:
        notes.append(f"⚠ The sign changes at a neighbouring rate for: {', '.join(changed)}.")
    title = "Headline Δ at the neighbouring learning rates"
    return Table("lr_neighbours", title, pd.DataFrame(data), pd.DataFrame(display), notes)


@figure("lr_sensitivity", needs="tuning.json with each tuning run's loss (a grid with a tune section)")
def lr_sensitivity_figure(ctx: Context) -> tuple[Figure, str]:
    """Tuning loss against learning rate per tuned variant on a log axis: the mean over the tuning seeds with their
    range, the chosen rate circled, one panel per setting."""
    found, _ = tuning_curves(ctx)
    settings = sorted({c.setting for c in found})
    with sns.axes_style("whitegrid"):
        fig, axes = figure_grid(len(settings), ncols=min(len(settings), 3), panel_size=(4.6, 3.4))
        for ax, setting in zip(axes, settings):
            mine = {c.variant: c for c in found if c.setting == setting}
            ax.set_xscale("log")  # before the dodge, whose shifts ride on the axis's own transform
            order = variant_order(mine, split_variant(ctx.baseline)[0])
            for variant, transform in zip(order, dodged(ax, len(order))):
                curve = mine[variant]
                points = [(v, curve.mean(v), _seed_range(curve.losses[v])) for v in curve.values]
                points = [(v, m, r) for v, m, r in points if math.isfinite(m)]
                if not points:
                    continue
                x, y, spans = zip(*points)
                below = [m - lo for m, (lo, _) in zip(y, spans)]
                above = [hi - m for m, (_, hi) in zip(y, spans)]
                colour = ctx.colours.get(variant)
                dodged_errorbar(
                    ax, transform, x, y, [below, above], marker="o", ms=4, capsize=3, color=colour, label=variant
                )
                if curve.chosen is not None and math.isfinite(curve.mean(curve.chosen)):
                    chosen = [curve.chosen], [curve.mean(curve.chosen)]
                    ax.plot(*chosen, "o", ms=11, mfc="none", color=colour, transform=transform)
            ax.autoscale_view()
            rates = sorted({v for c in mine.values() for v in c.values})
            ax.set_xticks(rates, labels=[f"{v:g}" for v in rates])
            ax.minorticks_off()  # the rates tried are the ticks: log-scale minor labels would crowd them
            ax.set(xlabel="learning rate", ylabel="tuning loss", title=setting or "tuning loss")
        shared_legend(fig, axes)
    return fig, (
        "Final loss on the tuning split against the learning rate (log axis) per tuned variant: the mean over the "
        "tuning seeds, the bar from the smallest to the largest seed's loss (no bar with one seed; with a handful "
        "of seeds a 95% t-interval is several times wider than the spread and would hide the curves: the "
        "sensitivity table gives the standard deviations); the circle marks the chosen rate; a rate where a run "
        "diverged has no point."
    )


def _seed_range(losses: list[float | None]) -> tuple[float, float]:
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    return (min(finite), max(finite)) if finite else (math.nan, math.nan)


def untuned_claims(ctx: Context) -> list[str]:
    """The variants a declared claim rests on that took another cell's rate instead of a tuning of their own."""
    try:
        _, borrowed = tuning_curves(ctx)
    except NoData:
        return []
    named = {name for c in ctx.claims or [] for name in (c.variant, c.against)}
    return sorted({f"{v} (rate of {source})" for (_, v), source in borrowed.items() if v in named})
