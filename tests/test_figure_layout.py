"""Every registered figure reads at the size it is saved: no two texts overlap, no legend covers data, no strip
figures, integer ticks on integer axes, and 13 variants in 13 distinguishable colours."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import test_figures as tf
import test_lr_sensitivity as tl
from matplotlib.colors import to_rgb
from matplotlib.text import Text

from harness.cli import main as cli_main
from harness.reporting import figures as figs
from harness.reporting import items as report_items
from harness.reporting.items import Context, NoData
from harness.reporting.report import FIGURES
from harness.reporting.results import load_sweep

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("report")]

# Beside the study's preln, ldm-rls and nine ablations: two hyper-connection variants, whose mixing weights reach 4.
EXTRA = ("mhc", "hc")
TOLERANCE_PX2 = 4.0  # overlap area below this is antialiasing of touching boxes, not text drawn on text
MAX_ASPECT = 4.0


@pytest.fixture(scope="module")
def wide_study(tmp_path_factory, module_seed):
    """The paper study of test_figures with 13 variants, several settings and three seeds."""
    rng = np.random.default_rng(module_seed)
    root = tmp_path_factory.mktemp(f"layout-seed{module_seed}") / "study"
    with pytest.MonkeyPatch.context() as mp:
        for name in EXTRA:
            mp.setitem(tf.EXTRA_FLOPS, name, 3000)
        runs = [(v, tf._model(d, 2), s) for v in ("preln", "ldm-rls") for d in tf.WIDTHS for s in tf.SEEDS]
        runs += [(v, tf._model(64, n), s) for v in ("preln", "ldm-rls") for n in (1, 4) for s in tf.SEEDS]
        runs += [(v, tf._model(64, 2), s) for v in (*tf.ABLATIONS, *EXTRA) for s in tf.SEEDS]
        for variant, model, s in runs:
            folder = root / tf._dirname(variant, model, s)
            tf.write_run(folder, variant, s, model, rng, noise=rng.normal(0.0, 0.002))
            if variant in EXTRA:
                n = 2 * model["n_blocks"]
                matrix = np.tril(rng.uniform(0.0, 4.0, (n + 1, n + 1)))
                mixing = {
                    "readers": [f"layer {i}" for i in range(n)] + ["head"],
                    "sources": ["embedding"] + [f"v{i}" for i in range(n)],
                    "matrix": matrix.tolist(),
                }
                (folder / "mixing.json").write_text(json.dumps(mixing))
    variants = sorted({r.variant for r in load_sweep(root).runs})  # as the sweep names them
    # A learning-rate tuning of every variant, for the lr_sensitivity figure.
    cells = [
        tl._cell(v, {rate: list(4.0 + rng.normal(0, 0.05, len(tl.SEEDS))) for rate in tl.RATES}, tl.RATES[1])
        for v in variants
    ]
    (root / "tuning.json").write_text(json.dumps({"axis": "train.lr", "values": tl.RATES, "cells": cells}))
    sweep = load_sweep(root)
    bench = pd.DataFrame(
        [
            {
                "variant": v,
                "depth": d,
                "width": 256,
                "seq_len": 256,
                "ratio_time": 1 + 0.02 * i,
                "ratio_mem": 1 + 0.01 * i,
            }
            for i, v in enumerate(variants)
            for d in (4, 8, 16)
        ]
    )
    return {"root": root, "sweep": sweep, "variants": variants, "bench": bench}


def _ctx(study) -> Context:
    sweep = study["sweep"]
    return Context(sweep, bench=study["bench"], colours=figs.palette(r.variant for r in sweep.runs))


def _visible_ticks(axis) -> list[Text]:
    # Only the ticks inside the view limits are drawn; get_ticklabels also lists those outside.
    return [t.label1 for t in axis._update_ticks() if t.label1.get_visible() and t.label1.get_text()]


def _legend_texts(legend) -> list[Text]:
    return [*legend.get_texts(), legend.get_title()]


def _texts(fig) -> list[Text]:
    """Titles, axis labels, tick labels, legend texts and the suptitle: the texts a reader reads."""
    out: list[Text] = []
    for ax in fig.axes:
        out += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        out += _visible_ticks(ax.xaxis) + _visible_ticks(ax.yaxis)
        if ax.get_legend() is not None:
            out += _legend_texts(ax.get_legend())
    for legend in fig.legends:
        out += _legend_texts(legend)
    if fig._suptitle is not None:
        out.append(fig._suptitle)
    return [t for t in out if t.get_visible() and t.get_text().strip()]


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def layout_problems(fig) -> list[str]:
    """What keeps the figure from reading at a glance, one sentence per problem."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems = []
    texts = _texts(fig)
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            if _overlap(boxes[i], boxes[j]) > TOLERANCE_PX2:
                problems.append(f"text {texts[i].get_text()!r} overlaps {texts[j].get_text()!r}")
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in panels:
            if _overlap(box, ax.get_window_extent(renderer)) > TOLERANCE_PX2:
                problems.append(f"a legend covers the panel {ax.get_title()!r}")
    whole = fig.get_tightbbox(renderer)
    ratio = max(whole.width / whole.height, whole.height / whole.width)
    if ratio > MAX_ASPECT:
        problems.append(f"aspect ratio {whole.width:.1f}:{whole.height:.1f} in is more extreme than 1:{MAX_ASPECT:g}")
    columns = {round(ax.get_position().x0, 3) for ax in panels}
    if len(columns) > 4:
        problems.append(f"{len(columns)} panels in one row, more than 4")
    return problems


INTEGER_AXIS = re.compile(r"\b(layer|layers|depth|group|groups|reader|source)\b")


def non_integer_ticks(fig) -> list[str]:
    """Tick labels on axes that count (layers, depth, groups) that are not whole numbers or short layer names."""
    fig.canvas.draw()
    bad = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if not INTEGER_AXIS.search(axis.label.get_text()) or axis.get_scale() != "linear":
                continue
            for label in _visible_ticks(axis):
                text = label.get_text().replace("\u2212", "-")
                if not re.fullmatch(r"-?\d+|[eh]", text):
                    bad.append(f"{ax.get_title()!r} {axis.label.get_text()!r}: tick {text!r}")
    return bad


@pytest.fixture(scope="module")
def drawn(wide_study):
    ctx = _ctx(wide_study)
    out = {}
    for item in report_items.items("figure"):
        try:
            out[item.name] = item.fn(ctx)[0]
        except NoData as e:
            out[item.name] = e
    return out


@pytest.mark.parametrize("name", FIGURES)
def test_figure_reads_at_its_saved_size(drawn, name):
    fig = drawn[name]
    assert not isinstance(fig, NoData), f"{name} drew nothing on the wide study: {fig}"
    assert layout_problems(fig) == []
    assert non_integer_ticks(fig) == []


def test_every_figure_is_drawn(drawn):
    # The ablation grid needs two cells of the groups × λ × ω grid; the study's knob settings give it those.
    assert [n for n, f in drawn.items() if isinstance(f, NoData)] == []


def test_thirteen_variants_get_thirteen_distinguishable_colours(wide_study):
    colours = figs.palette(wide_study["variants"])
    assert len(wide_study["variants"]) >= 13
    rgb = np.array([to_rgb(colours[v]) for v in wide_study["variants"]])
    gaps = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1) + np.eye(len(rgb)) * 9
    assert gaps.min() > 0.12, f"two variants' colours are {gaps.min():.3f} apart in RGB"
    assert figs.palette(["preln", "mhc"]) == {v: colours[v] for v in ("preln", "mhc")}


def test_heatmaps_of_different_ranges_get_their_own_scale(drawn):
    # mhc's mixing weights reach 4, ldm-rls's stay in [0, 1]: one shared scale would wash ldm-rls out.
    fig = drawn["mixing"]
    limits = {
        ax.get_title(): coll.get_clim()[1] for ax in fig.axes for coll in ax.collections if coll.get_array() is not None
    }
    assert limits["mhc"] > 2.0 and limits["ldm-rls"] <= 1.0


def test_error_bars_of_variants_at_one_x_are_dodged(drawn):
    for ax in [*drawn["hyperparameters"].axes, *drawn["depth"].axes]:
        ax.get_figure().canvas.draw()
        lines = [c.lines[0] for c in ax.containers]  # each variant's error bar container, its data line first
        assert len(lines) >= 2
        on_screen = []
        low, high = ax.get_ylim()
        for line in lines:
            # Shifted artists must still set the view: every point inside it.
            assert low <= np.min(line.get_ydata()) and np.max(line.get_ydata()) <= high, ax.get_title()
            xy = np.column_stack([np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)])
            on_screen.append(line.get_transform().transform(xy)[:, 0])
        for i in range(len(lines)):
            for j in range(i + 1, len(lines)):
                # Same data x (the sweep runs both variants at every value), at least 3 px apart on screen.
                assert np.abs(on_screen[i][:, None] - on_screen[j][None]).min() > 3, ax.get_title()


def test_report_figure_option_redraws_one_figure(wide_study, tmp_path, capsys):
    code = cli_main(["report", str(wide_study["root"]), "--out", str(tmp_path), "--figure", "omega"])
    assert code == 0
    written = sorted(p.name for p in (tmp_path / "figures").iterdir())
    assert written == ["omega.pdf", "omega.png"]
    assert not (tmp_path / "REPORT.md").exists()
    assert cli_main(["report", str(wide_study["root"]), "--out", str(tmp_path), "--figure", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "omega" in err
