"""The learning-rate tuning stage: grid validation, the choice per cell (edges, ties, diverged values), the dry
run's tuning block, and a tiny tuned grid trained for real by the local executor."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from cli_checks import fails

from harness.cli import main
from harness.config import build_config
from harness.io import read_json
from harness.rundir import read_config
from harness.sweeps.grid import parse_grid
from harness.sweeps.planning import apply_overrides, plan
from harness.sweeps.submit import sweep
from harness.sweeps.tuning import select

ROOT = Path(__file__).resolve().parent.parent
TINY = {
    "model": {"preset": "tiny"},
    "train": {
        "max_steps": 4,
        "batch_size": 4,
        "warmup_steps": 1,
        "log_every_steps": 2,
        "val_every_steps": 2,
        "val_batches": 1,
        "ckpt_every_steps": 4,
    },
}
TUNE = {"axis": "train.lr", "values": [1e-3, 3e-3], "select_on": "tune_split"}


def grid(**extra):
    return parse_grid({"base": TINY, "axes": {"variant": ["preln"]}, **extra}, source="g.yaml", default_name="g")


# -- the choice -------------------------------------------------------------------------------------------------


def test_select_takes_the_lowest_finite_metric_and_flags_the_edges():
    values = [5e-4, 1e-3, 2e-3, 4e-3]
    middle = select(values, {5e-4: 3.2, 1e-3: 3.0, 2e-3: 3.1, 4e-3: 3.5})
    assert middle == {"chosen": 1e-3, "at_edge": False, "edge": None}
    low = select(values, {5e-4: 2.9, 1e-3: 3.0, 2e-3: 3.1, 4e-3: 3.5})
    assert low == {"chosen": 5e-4, "at_edge": True, "edge": "smallest"}
    high = select(values, {5e-4: 3.9, 1e-3: 3.5, 2e-3: 3.1, 4e-3: 3.0})
    assert high == {"chosen": 4e-3, "at_edge": True, "edge": "largest"}


def test_a_tie_goes_to_the_smaller_value():
    assert select([1e-3, 2e-3, 4e-3], {1e-3: 3.5, 2e-3: 3.0, 4e-3: 3.0})["chosen"] == 2e-3
    assert select([1e-3, 2e-3], {1e-3: 3.0, 2e-3: 3.0 * (1 + 1e-12)})["chosen"] == 1e-3


def test_a_diverged_value_is_never_chosen():
    values = [1e-3, 2e-3, 4e-3]
    # the largest value diverged (no finite loss, or NaN/inf): the best finite one wins, and it is not at an edge
    for bad in (None, math.nan, math.inf, -math.inf):
        got = select(values, {1e-3: 3.4, 2e-3: 3.1, 4e-3: bad})
        assert got["chosen"] == 2e-3
    assert select(values, {1e-3: 3.1, 2e-3: 3.2, 4e-3: None})["edge"] == "smallest"
    assert select(values, dict.fromkeys(values))["chosen"] is None
    assert select(values, {1e-3: math.nan, 2e-3: math.inf, 4e-3: None}) == {
        "chosen": None,
        "at_edge": False,
        "edge": None,
    }


# -- grid validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tune, message",
    [
        ({**TUNE, "axis": "train.weight_decay"}, "tune.axis in g.yaml is 'train.weight_decay'; allowed: train.lr."),
        ({**TUNE, "values": []}, "tune.values in g.yaml must be a non-empty list of positive numbers"),
        ({**TUNE, "values": [1e-3]}, "tuning chooses among at least two"),
        ({**TUNE, "values": [1e-3, -1e-3]}, "must be positive finite numbers"),
        ({**TUNE, "values": [1e-3, "fast"]}, "must hold only positive numbers; 'fast' is not one"),
        ({**TUNE, "values": [1e-3, 1e-3]}, "names a value twice"),
        ({**TUNE, "select_on": "val"}, "tune.select_on in g.yaml is 'val'; allowed: tune_split."),
        ({**TUNE, "metric": "accuracy"}, "tune.metric in g.yaml is 'accuracy'; allowed: val_loss."),
        ({**TUNE, "seeds": []}, "tune.seeds in g.yaml must be a non-empty list of integer seeds"),
        ({**TUNE, "sedes": [0]}, "Unknown key 'sedes' under tune in g.yaml. Did you mean 'seeds'?"),
        ({"axis": "train.lr", "values": [1e-3, 2e-3]}, "tune in g.yaml needs 'select_on'"),
        ({**TUNE, "variants": ["hc"]}, "names 'hc', which the grid does not run; allowed: preln."),
        ([1e-3], "tune in g.yaml must be a mapping"),
    ],
)
def test_bad_tune_sections_fail_in_one_sentence(tune, message):
    with pytest.raises(Exception) as e:
        grid(tune=tune)
    assert message in str(e.value) and str(e.value).count("\n") == 0


def test_the_tuned_key_may_not_be_an_axis_too():
    with pytest.raises(Exception, match="train.lr is tuned in g.yaml and also varied by an axis"):
        parse_grid(
            {"base": TINY, "axes": {"variant": ["preln"], "train.lr": [1e-3, 2e-3]}, "tune": TUNE},
            source="g.yaml",
            default_name="g",
        )
    g = grid(tune=TUNE)
    apply_overrides(g, ["train.lr=1e-3,2e-3"])
    from harness.sweeps.grid import check_tune

    with pytest.raises(Exception, match="also varied by an axis"):
        check_tune(g)


def test_yaml_numbers_without_a_dot_read_as_numbers():
    assert grid(tune={**TUNE, "values": ["4e-3", "5e-4"]}).tune.values == [5e-4, 4e-3]


def test_a_bad_tune_section_ends_the_command_in_one_sentence(tmp_path, capsys):
    path = tmp_path / "g.yaml"
    path.write_text(
        textwrap.dedent("""
        base: {model: {preset: tiny}}
        axes: {variant: [preln]}
        tune: {axis: train.lr, values: [1e-3, 2e-3], select_on: val}
        """)
    )
    line = fails(capsys, ["sweep", str(path), "--dry-run", "--results", str(tmp_path / "r")])
    assert "tune.select_on" in line and line.endswith("allowed: tune_split.")
    path.write_text(path.read_text().replace("select_on: val", "select_on: tune_split"))
    line = fails(capsys, ["sweep", str(path), "--dry-run", "--results", str(tmp_path / "r"), "train.lr=1e-3,2e-3"])
    assert "train.lr is tuned in" in line and "also varied" in line


# -- the stages ------------------------------------------------------------------------------------------------


def test_tuning_runs_validate_on_the_tune_split_without_downstream_evaluation(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(
        textwrap.dedent("""
        base: {model: {preset: tiny}, eval: {tasks: [offline_shakespeare]}}
        axes: {variant: [preln, ldm-rls, "ldm-rls(groups=1)"], train.seed: [3, 4]}
        tune: {axis: train.lr, values: [1e-3, 2e-3], select_on: tune_split, variants: [preln, ldm-rls]}
        """)
    )
    p = plan(path, root=tmp_path / "r")
    assert len(p.tuning.runs) == 2 * 2  # two tuned variants x two values x the first seed
    for r in p.tuning.runs:
        assert r.cfg.data.eval_split == "tune" and r.cfg.train.seed == 3 and list(r.cfg.eval.tasks) == []
    assert len(p.runs) == len(p.waiting) == 6  # no value is chosen before the tuning runs end
    assert set(p.decisions.values()) == {"waiting"} and not p.to_submit()
    ablation = p.selection["variant=ldm-rls(groups=1)"]
    assert ablation["tuned"] is False and ablation["from"] == "variant=ldm-rls"
    assert all(r.cfg.data.eval_split == "val" for r in p.waiting)


def test_a_grid_without_tune_plans_as_before(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("base: {model: {preset: tiny}}\naxes: {variant: [preln]}\n")
    p = plan(path, root=tmp_path / "r")
    assert p.tuning is None and not p.waiting and len(p.runs) == 1


@pytest.mark.slow
def test_paper_dry_run_shows_the_tuning_stage_and_its_cost(capsys):
    assert main(["sweep", str(ROOT / "experiments" / "paper.yaml"), "--dry-run", "--no-memory-plan"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    # every claimed row (eight variants at their defaults, three matched PreLNs, ten ablations) x 4 rates x 2 seeds
    assert head.startswith("tuning stage: 168 run(s)") and "21 cell(s) x 4 value(s) of train.lr" in head
    assert "(0.0005, 0.001, 0.002, 0.004) x seeds 100, 101" in head
    tuned = {tuple(line.split()[1:3]) for line in out.splitlines() if "-tune-" in line}
    assert {("preln(match=ldm-rls)", "100"), ("ldm(qk_source=read)", "101")} <= tuned
    assert not {seed for _, seed in tuned} & {str(s) for s in range(5)}  # no evaluation seed tunes
    assert "with tuning: 168 tuning run(s) (" in out and "main run(s)" in out and "GPU-h" in out
    assert "tuning: variant=ldm-rls(groups=1): train.lr from the choice of variant=ldm-rls" in out
    assert "after tuning" in out


@pytest.mark.slow
def test_a_tuned_grid_chooses_trains_with_the_choice_and_redoes_nothing(tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text(
        textwrap.dedent("""
        name: tuned
        parallelism: 2
        base:
          model: {preset: tiny}
          train: {max_steps: 4, batch_size: 4, warmup_steps: 1, log_every_steps: 2, val_every_steps: 2,
                  val_batches: 1, ckpt_every_steps: 4}
        axes:
          variant: [preln]
        tune: {axis: train.lr, values: [1.0e-3, 3.0e-3], select_on: tune_split}
        """)
    )
    lines: list[str] = []
    sub = sweep(path, executor="local", root=tmp_path / "r", log=lines.append, poll_s=0.5)
    sweep_dir = tmp_path / "r" / "tuned"
    tuning = read_json(sweep_dir / "tuning.json")
    (cell,) = tuning["cells"]
    assert cell["state"] == "chosen" and cell["values"] == [1e-3, 3e-3]
    metrics = {float(k): v for k, v in cell["metric"].items()}
    assert all(math.isfinite(m) for m in metrics.values())
    assert cell["chosen"] == min(metrics, key=metrics.get)
    assert cell["at_edge"] is True  # with two values every choice is an end of the range
    for runs in cell["runs"].values():
        (rid,) = runs
        assert read_config(sweep_dir / "tune" / rid).data.eval_split == "tune"
    (main_run,) = sub.rows
    assert main_run["state"] == "done"
    cfg = read_config(sweep_dir / main_run["run_id"])
    assert cfg.train.lr == cell["chosen"] and cfg.data.eval_split == "val"
    assert cfg == build_config(cfg.to_dict())
    assert [r["run_id"] for r in read_json(sweep_dir / "sweep.json")["runs"]] == [main_run["run_id"]]

    again: list[str] = []
    second = sweep(path, executor="local", root=tmp_path / "r", log=again.append)
    assert second.jobs == {} and set(second.plan.decisions.values()) == {"done"}
    assert set(second.plan.tuning.decisions.values()) == {"done"}
    assert "tuning stage: nothing to submit." in again and "nothing to submit." in again
    assert read_json(sweep_dir / "tuning.json")["cells"][0]["chosen"] == cell["chosen"]


# -- the report -------------------------------------------------------------------------------------------------


def _sweep(root):
    from harness.reporting.results import Sweep

    return Sweep(root=root, runs=[])


def test_the_report_table_states_each_choice_and_flags_the_edges(tmp_path):
    from harness.io import atomic_write_json
    from harness.reporting.items import Context
    from harness.reporting.tuning import protocol_line, tuning_table

    cells = [
        {"cell": "variant=preln", "variant": "preln", "tuned": True, "state": "chosen", "chosen": 1e-3,
         "at_edge": False, "edge": None, "metric": {"0.0005": 3.2, "0.001": 3.1, "0.002": 3.15}},
        {"cell": "variant=ldm-rls", "variant": "ldm-rls", "tuned": True, "state": "chosen", "chosen": 2e-3,
         "at_edge": True, "edge": "largest", "metric": {"0.0005": 3.3, "0.001": None, "0.002": 3.0}},
        {"cell": "variant=ldm-rls(groups=1)", "variant": "ldm-rls(groups=1)", "tuned": False,
         "from": "variant=ldm-rls", "state": "chosen", "chosen": 2e-3, "at_edge": True, "edge": "largest"},
    ]  # fmt: skip
    atomic_write_json(
        tmp_path / "tuning.json",
        {"axis": "train.lr", "values": [5e-4, 1e-3, 2e-3], "metric": "val_loss", "seeds": [0, 1], "cells": cells},
    )
    t = tuning_table(Context(_sweep(tmp_path)))
    rows = t.display.to_dict("records")
    assert [r["Variant"] for r in rows] == ["preln", "ldm-rls", "ldm-rls(groups=1)"]
    assert [r["Chosen lr"] for r in rows] == ["0.001", "0.002", "0.002"]
    assert rows[0]["Note"] == "" and rows[1]["Note"] == "⚠ largest value tried"
    assert rows[1]["lr=0.001"] == "diverged" and rows[0]["lr=0.0005"] == "3.200"
    assert rows[2]["Note"].startswith("from ldm-rls")
    assert any("2 choice(s) at the edge" in n for n in t.notes)
    assert list(t.data["at_edge"]) == [False, True, True]
    assert "chosen by a tuning stage" in protocol_line(tmp_path, [1e-3])


def test_a_sweep_without_tuning_says_so_in_one_line(tmp_path):
    from harness.reporting.items import Context, NoData
    from harness.reporting.tuning import protocol_line, tuning_table

    line = protocol_line(tmp_path, [1.5e-3])
    assert line == (
        "This sweep had no tuning stage: every run trained at the learning rate in its config (0.0015), "
        "one rate for every variant."
    )
    with pytest.raises(NoData, match="no tuning stage"):
        tuning_table(Context(_sweep(tmp_path)))


@pytest.mark.slow
def test_without_waiting_a_second_submission_starts_the_runs_once_tuning_has_ended(tmp_path):
    """The cluster route: the first submission sends only the tuning runs, the next one the grid's runs."""
    path = tmp_path / "staged.yaml"
    path.write_text(
        textwrap.dedent("""
        name: staged
        parallelism: 2
        base:
          model: {preset: tiny}
          train: {max_steps: 3, batch_size: 4, warmup_steps: 1, log_every_steps: 3, val_every_steps: 3,
                  val_batches: 1, ckpt_every_steps: 3}
        axes:
          variant: [preln]
        tune: {axis: train.lr, values: [1.0e-3, 3.0e-3], select_on: tune_split}
        """)
    )
    lines: list[str] = []
    first = sweep(path, executor="local", root=tmp_path / "r", wait=False, log=lines.append)
    sweep_dir = tmp_path / "r" / "staged"
    assert len(first.jobs) == 2 and all("-tune-" in rid for rid in first.jobs)
    assert [r.run_id for r in first.plan.waiting] == ["preln-s0-(after tuning)"]
    assert read_json(sweep_dir / "tuning.json")["cells"][0]["state"] == "tuning"
    assert read_json(sweep_dir / "sweep.json")["runs"] == []
    assert any("wait for their tuning runs" in ln for ln in lines)
    for job in first.jobs.values():
        job.wait()
    second = sweep(path, executor="local", root=tmp_path / "r", log=lines.append, poll_s=0.5)
    assert set(second.plan.tuning.decisions.values()) == {"done"} and not second.plan.waiting
    (row,) = second.rows
    chosen = read_json(sweep_dir / "tuning.json")["cells"][0]["chosen"]
    assert row["state"] == "done" and read_config(sweep_dir / row["run_id"]).train.lr == chosen


def test_a_tuned_rate_is_no_setting_and_a_results_folder_finds_its_sweeps_tuning(tmp_path):
    """Variants tuned to different rates are still compared row by row, and a report of a folder holding the
    tuned sweep (as a grid's ``report.sweep`` names it) finds that sweep's tuning.json."""
    from harness.reporting import tuning as tuning_report
    from harness.reporting.report import report_spec
    from harness.reporting.results import load_sweep

    sweep_dir = tmp_path / "results" / "tuned"
    for variant, lr in (("preln", 0.006), ("ldm-rls", 0.012)):
        for seed in (0, 1):
            run = sweep_dir / f"{variant}-s{seed}"
            run.mkdir(parents=True)
            config = {"variant": variant, "model": {"preset": "tiny"}, "train": {"lr": lr, "seed": seed}}
            (run / "config.json").write_text(json.dumps(config))
    cells = [{"cell": "variant=preln", "variant": "preln", "tuned": True, "state": "chosen", "chosen": 0.006}]
    (sweep_dir / "tuning.json").write_text(json.dumps({"axis": "train.lr", "values": [0.006, 0.012], "cells": cells}))
    sweep = load_sweep(tmp_path / "results")
    assert "lr" not in sweep.axis_keys and {r.setting for r in sweep.runs} == {""}
    assert tuning_report.read_tuning(tmp_path / "results")["cells"] == cells
    assert "chosen by a tuning stage" in tuning_report.protocol_line(tmp_path / "results", [])
    spec = report_spec({"summary": "What this is:\n  a test."})
    assert spec.summary == "What this is:\n  a test."
