"""Grid files: expansion (product, zip, include, exclude), stable run ids, and every validation error."""

from __future__ import annotations

import json
import os
import random
import re
import textwrap
from pathlib import Path

import pytest

import variants
from harness.cli import main
from harness.errors import UsageError
from harness.rundir import run_id, short_value
from harness.sweeps.grid import combinations, expand, load_grid, nest, parse_grid
from harness.sweeps.planning import check_executor, plan
from harness.sweeps.profiles import load_profile

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str, name: str = "grid.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def grid_of(data: dict, name: str = "g"):
    return parse_grid(data, source=f"{name}.yaml", default_name=name)


BASE = {"model": {"preset": "tiny"}, "train.max_steps": 5}


def test_product_crosses_every_axis_in_order(rng_seed):
    rnd = random.Random(rng_seed)
    seeds = rnd.sample(range(1000), 3)
    lrs = [round(rnd.uniform(1e-4, 1e-2), 6) for _ in range(2)]
    runs = expand(grid_of({"base": BASE, "axes": {"train.lr": lrs, "train.seed": seeds}}))
    got = [(r.cfg.train.lr, r.cfg.train.seed) for r in runs]
    assert got == [(lr, s) for lr in lrs for s in seeds]
    assert all(r.cfg.train.max_steps == 5 and r.cfg.model.d_model == 64 for r in runs)


def test_zip_varies_keys_together_and_crosses_with_axes():
    runs = expand(
        grid_of(
            {
                "base": BASE,
                "axes": {"train.seed": [0, 1]},
                "zip": [{"train.lr": [1e-3, 3e-3, 1e-2], "train.warmup_steps": [1, 2, 3]}],
            }
        )
    )
    pairs = {(r.cfg.train.seed, r.cfg.train.lr, r.cfg.train.warmup_steps) for r in runs}
    assert len(runs) == 6
    assert pairs == {(s, lr, w) for s in (0, 1) for lr, w in ((1e-3, 1), (3e-3, 2), (1e-2, 3))}


def test_exclude_drops_partial_matches_and_include_adds_runs():
    grid = grid_of(
        {
            "base": BASE,
            "axes": {"variant": ["preln", "ldm-rls(groups=4)"], "train.seed": [0, 1]},
            # the canonical form of a variant matches however its knobs are spelled
            "exclude": [{"variant": "ldm-rls(groups=4,omega=on)", "train.seed": 1}],
            "include": [{"variant": "ldm", "train.seed": 5}],
        }
    )
    combos = combinations(grid)
    assert {"variant": "ldm-rls(groups=4)", "train.seed": 1} not in combos
    assert combos[-1] == {"variant": "ldm", "train.seed": 5}
    runs = expand(grid)
    assert [(r.cfg.variant, r.cfg.train.seed) for r in runs] == [
        ("preln", 0),
        ("preln", 1),
        ("ldm-rls(groups=4)", 0),
        ("ldm", 5),
    ]


def test_a_base_without_axes_is_one_run():
    assert len(expand(grid_of({"base": BASE}))) == 1


def test_nest_accepts_dotted_and_nested_keys():
    assert nest({"train.lr": 1.0, "train": {"seed": 3}, "model": {"preset": "cpu"}}) == {
        "train": {"lr": 1.0, "seed": 3},
        "model": {"preset": "cpu"},
    }


def test_ids_are_stable_readable_and_distinct(tmp_path, rng_seed):
    lr = random.Random(rng_seed).choice([1e-3, 2e-3, 5e-3])
    path = write(
        tmp_path,
        f"""
        name: ids
        base: {{model: {{preset: tiny}}, train: {{lr: {lr}}}}}
        axes:
          variant: [preln, "ldm-rls(groups=4)"]
          train.seed: [0, 1]
        """,
    )
    first = expand(load_grid(path))
    again = expand(load_grid(path))
    assert [r.run_id for r in first] == [r.run_id for r in again]
    assert all(r.run_id == run_id(r.cfg, r.overrides) for r in first)
    assert len({r.run_id for r in first}) == 4
    assert re.fullmatch(r"preln-s0-[0-9a-f]{8}", first[0].run_id)
    assert first[2].run_id.startswith("ldm-rls-groups-4-s0-")
    # a different learning rate is a different run, the seed alone changes only its part of the id
    other = expand(grid_of({"base": {"model": {"preset": "tiny"}, "train.lr": lr * 2}, "axes": {"train.seed": [0]}}))
    assert other[0].run_id != first[0].run_id
    assert first[0].run_id.replace("-s0-", "-s1-") == first[1].run_id
    assert all(r.cfg.name == "ids" for r in first)


def test_ids_carry_the_axis_values(rng_seed):
    rnd = random.Random(rng_seed)
    lrs = [3e-3, round(rnd.uniform(1.1, 9.9), 1) * 1e-4]
    runs = expand(
        grid_of({"base": BASE, "axes": {"variant": ["ldm-rls", "preln"], "train.lr": lrs, "train.seed": [0]}})
    )
    ids = [r.run_id for r in runs]
    assert ids[0].startswith("ldm-rls-lr3e-3-s0-")
    assert ids[1].startswith(f"ldm-rls-lr{lrs[1] * 1e4:g}e-4-s0-")
    # two runs of one variant with different lr never read alike
    assert ids[0].split("-s0-")[0] != ids[1].split("-s0-")[0]
    assert short_value(0.5) == "0.5" and short_value(1e-3) == "1e-3" and short_value("/data/fine/") == "fine"


def test_identity_ignores_what_does_not_change_the_trained_model(rng_seed):
    """Evaluation, loggers, intervals, process layout and profile leave the id alone; what trains a different
    model changes it."""
    rnd = random.Random(rng_seed)
    base = {"model": {"preset": "tiny"}, "train": {"lr": 1e-3, "max_steps": 5}}
    ref = expand(grid_of({"base": base}))[0].run_id
    same = [
        {"eval": {"tasks": ["offline_arc_easy"], "limit": rnd.randint(1, 50)}},
        {"train": {"logger": "wandb"}},
        {"train": {"logger": "tensorboard", "log_every_steps": 3}},
        {"train": {"val_every_steps": rnd.randint(2, 9), "ckpt_every_steps": rnd.randint(2, 9)}},
        {"train": {"devices": 2, "num_nodes": 2, "strategy": "ddp"}},
        {"train": {"activation_checkpointing": True}},
        {"slurm": {"partition": "gpu", "time_min": 5}},
        {"data": {"cache_dir": "/tmp/elsewhere"}},
    ]
    for extra in same:
        got = expand(grid_of({"base": {**base, **{k: {**base.get(k, {}), **v} for k, v in extra.items()}}}))[0]
        assert got.run_id == ref, extra
    changed = [
        {"train": {"lr": 2e-3}},
        {"train": {"max_steps": 6}},
        {"train": {"precision": "bf16-mixed"}},
        {"train": {"batch_size": 4}},
        {"model": {"d_model": 32}},
        {"data": {"val_fraction": 0.1}},
        {"variant": "ldm"},
    ]
    for extra in changed:
        layer = {k: ({**base.get(k, {}), **v} if isinstance(v, dict) else v) for k, v in extra.items()}
        assert expand(grid_of({"base": {**base, **layer}}))[0].run_id != ref, extra
    # profiles differ only in resources and layout: the same ids
    assert expand(grid_of({"base": base}), defaults=load_profile("local").config_layer())[0].run_id == ref


def test_profile_sets_resources_and_ddp_layout(tmp_path):
    prof = write(tmp_path, "tasks_per_node: 2\nnodes: 1\ncpus_per_task: 1\ntime_min: 7\n", "two.yaml")
    path = write(tmp_path, "base: {model: {preset: tiny}}\n")
    p = plan(path, profile=str(prof), root=tmp_path / "results")
    cfg = p.runs[0].cfg
    assert (cfg.train.devices, cfg.train.num_nodes, cfg.slurm.tasks_per_node, cfg.slurm.time_min) == (2, 1, 2, 7)
    assert p.decisions == {p.runs[0].run_id: "submit"}


def test_experiment_files_expand():
    quick = plan(ROOT / "experiments" / "quickstart.yaml", root="/nonexistent-results")
    assert [r.cfg.variant for r in quick.runs] == ["preln", "ldm", "ldm-rls", "attnres-block", "mhc"]
    assert {r.cfg.model.preset for r in quick.runs} == {"tiny"} and not quick.warnings
    paper = plan(ROOT / "experiments" / "paper.yaml", root="/nonexistent-results")
    variants_run = {r.cfg.variant for r in paper.runs}
    for name in (
        "preln",
        "ldm",
        "ldm-rls",
        "attnres",
        "attnres-block",
        "hc",
        "mhc",
        "denseformer",
        "ldm-rls(omega=off)",
        "ldm-rls(read=memory)",
        "ldm-rls(residual_write=off)",
        "ldm-rls(lambda=1.0)",
        "ldm(read=memory)",
        "ldm(residual_write=off)",
        "ldm-rls(lambda=0.9)",
        "ldm-rls(lambda=0.99)",
        "ldm-rls(groups=1,key_dim=48)",
        "ldm-rls(groups=64,key_dim=48)",
        "preln(match=ldm-rls)",
        # the controls that take residual_write=off's two changes apart
        "ldm-rls(residual_write=off,qk_source=residual)",
        "ldm-rls(qk_source=read)",
    ):
        assert variants.canonical(name) in variants_run  # a run carries the canonical name
    assert {r.cfg.model.preset for r in paper.runs} == {"gpt2-small"}


def test_paper_headline_rows_have_five_seeds_and_ablations_three():
    import variants

    paper = plan(ROOT / "experiments" / "paper.yaml", root="/nonexistent-results")
    seeds: dict[str, set[int]] = {}
    for r in paper.runs:
        seeds.setdefault(variants.canonical(r.cfg.variant), set()).add(r.cfg.train.seed)
    headline = [*variants.names(), "preln(match=ldm-rls)", "preln(match=ldm)", "preln(match=mhc)"]
    for name in headline:
        assert seeds[variants.canonical(name)] == {0, 1, 2, 3, 4}, name
    assert all(s == {0, 1, 2} for v, s in seeds.items() if v not in {variants.canonical(h) for h in headline})
    # Downstream scores on whole validation splits: a limit would leave COPA or PIQA at chance by sample size alone.
    assert {r.cfg.eval.limit for r in paper.runs} == {None} and {tuple(r.cfg.eval.tasks) for r in paper.runs} == {
        ("offline",)
    }


@pytest.mark.slow
def test_paper_matches_every_variant_with_more_than_one_percent_extra_parameters():
    """Each variant of the paper grid that adds over 1% of PreLN's parameters has a parameter-matched PreLN in
    the grid within 0.5% of its own count."""
    import torch

    from harness.config import model_preset
    from harness.model.factory import build_model

    paper = plan(ROOT / "experiments" / "paper.yaml", root="/nonexistent-results")
    size = model_preset("gpt2-small")
    with torch.device("meta"):
        count = {v: build_model(size, v).num_params() for v in {r.cfg.variant for r in paper.runs}}
    preln = count["preln"]
    matched = [n for v, n in count.items() if v.startswith("preln(match=")]
    heavy = [v for v, n in count.items() if not v.startswith("preln") and n > 1.01 * preln]
    assert len(heavy) > 20
    for v in heavy:
        assert min(abs(m - count[v]) for m in matched) <= 0.005 * count[v], v


def test_exclude_lists_match_any_value_and_refuse_values_no_run_has():
    grid = grid_of(
        {
            "base": BASE,
            "axes": {"variant": ["preln", "ldm", "ldm-rls(groups=4)"], "train.seed": [0, 1, 2]},
            "exclude": [{"variant": ["ldm", "ldm-rls(groups=4,omega=on)"], "train.seed": [1, 2]}],
        }
    )
    got = {(r.cfg.variant, r.cfg.train.seed) for r in expand(grid)}
    assert got == {("preln", 0), ("preln", 1), ("preln", 2), ("ldm", 0), ("ldm-rls(groups=4)", 0)}
    msg = expect_error(
        "not one of its values",
        grid_of,
        {"base": BASE, "axes": {"variant": ["preln", "ldm"]}, "exclude": [{"variant": ["ldm", "ldm-rsl"]}]},
    )
    assert "'ldm-rsl'" in msg and "allowed: preln, ldm" in msg
    # An axis whose values are lists themselves: an exclude of one such value is that value, not a choice.
    tasks = grid_of(
        {
            "base": BASE,
            "axes": {"eval.tasks": [["offline_copa"], ["offline_piqa"]]},
            "exclude": [{"eval.tasks": ["offline_copa"]}],
        }
    )
    assert combinations(tasks) == [{"eval.tasks": ["offline_piqa"]}]


@pytest.mark.slow
def test_paper_dry_run_warns_about_the_missing_corpus_and_submission_refuses(capsys):
    import math

    from harness.config import model_preset
    from harness.model.factory import build_model

    grid = str(ROOT / "experiments" / "paper.yaml")
    assert main(["sweep", grid, "--dry-run", "--no-memory-plan", "--results", "/nonexistent-results"]) == 0
    out = capsys.readouterr().out
    assert "warning: the corpus /path/to/fineweb-edu-shards does not exist" in out
    assert "gpus_per_node=4" in out and "at most 8 at a time" in out
    # One budget for all: 20 tokens per parameter of PreLN at GPT-2 small, in whole steps of 256 x 1024 tokens.
    n = build_model(model_preset("gpt2-small"), "preln").num_params()
    steps = math.ceil(math.ceil(20.0 * n) / (256 * 1024))
    assert f"budget: every run trains {steps:,} steps on {steps * 256 * 1024:,} tokens" in out
    n_runs = int(out.split(" run(s)")[0].split()[-1])
    # on every run's line, after its action: the steps, then the tokens in millions
    shown = f"{steps * 256 * 1024 / 1e6:,.0f}M"
    assert len(re.findall(rf" submit +{steps} +{re.escape(shown)}$", out, re.M)) == n_runs > 70
    assert main(["sweep", grid, "--results", "/nonexistent-results"]) == 2
    err = capsys.readouterr().err
    assert "does not exist yet" in err and "Traceback" not in err
    assert not Path("/nonexistent-results").exists()


def test_budget_counts_against_the_report_baseline_or_takes_explicit_tokens(tmp_path):
    import math

    from harness.model.factory import build_model
    from harness.training.budget import train_steps

    grid = {
        "base": {"model": {"preset": "tiny"}, "train": {"batch_size": 4, "seq_len": 16, "tokens_per_param": 2.5}},
        "axes": {"variant": ["preln", "ldm-rls", "hc"]},
        "report": {"baseline": "ldm-rls(groups=4)"},
    }
    runs = expand(grid_of(grid))
    n = build_model(runs[0].cfg.model, "ldm-rls(groups=4)").num_params()
    assert {r.cfg.train.tokens for r in runs} == {math.ceil(2.5 * n)}
    assert {train_steps(r.cfg) for r in runs} == {math.ceil(math.ceil(2.5 * n) / 64)}
    # The default baseline: PreLN. An explicit token count or step count is kept as given.
    assert {r.cfg.train.tokens for r in expand(grid_of({**grid, "report": {}}))} == {
        math.ceil(2.5 * build_model(runs[0].cfg.model, "preln").num_params())
    }
    explicit = expand(grid_of({**grid, "base": {**grid["base"], "train.tokens": 1000}}))
    assert {(r.cfg.train.tokens, train_steps(r.cfg)) for r in explicit} == {(1000, 16)}
    steps = expand(grid_of({**grid, "base": {**grid["base"], "train.max_steps": 7}}))
    assert {(r.cfg.train.tokens, train_steps(r.cfg)) for r in steps} == {(0, 7)}
    # A budget axis gives each model size and budget its own count, the same for every variant within it.
    varied = expand(
        grid_of({**grid, "axes": {**grid["axes"], "train.tokens_per_param": [1.0, 2.0], "model.n_blocks": [2, 3]}})
    )
    by_budget = {}
    for r in varied:
        by_budget.setdefault((r.cfg.train.tokens_per_param, r.cfg.model.n_blocks), set()).add(r.cfg.train.tokens)
    assert len(by_budget) == 4 and all(len(v) == 1 for v in by_budget.values())
    assert len({next(iter(v)) for v in by_budget.values()}) == 4
    expect_error(
        "both fix the budget",
        expand,
        grid_of({**grid, "base": {**grid["base"], "train.tokens": 1000, "train.max_steps": 3}}),
    )
    expect_error("report.baseline", grid_of, {**grid, "report": {"baseline": 3}})


# -- validation errors: one sentence each, before anything is submitted --------------------------------------
def expect_error(match: str, fn, *args, **kwargs):
    with pytest.raises(UsageError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "base:\n  model: {preset: tiny}\naxes:\n  variant: [preln, ldm\n  train.seed: [0]\n")
    msg = expect_error("Malformed YAML", load_grid, path)
    assert str(path) in msg and "line 5" in msg


def test_unknown_grid_key_suggests(tmp_path):
    msg = expect_error("Unknown key 'axis'", load_grid, write(tmp_path, "axis: {train.seed: [0]}\n"))
    assert "Did you mean 'axes'?" in msg


def test_unknown_config_key_suggests(tmp_path):
    path = write(tmp_path, "base: {model: {preset: tiny}}\naxes: {train.lrr: [0.001]}\n")
    msg = expect_error("Unknown config key 'train.lrr'", expand, load_grid(path))
    assert "Did you mean 'lr'?" in msg and str(path) in msg


def test_bad_variant_name_and_knob_fail_before_submission(tmp_path):
    msg = expect_error("Unknown variant 'ldm-rsl'", expand, grid_of({"base": BASE, "axes": {"variant": ["ldm-rsl"]}}))
    assert "Did you mean 'ldm-rls'?" in msg
    expect_error("no knob 'gruops'", expand, grid_of({"base": BASE, "axes": {"variant": ["ldm-rls(gruops=4)"]}}))
    # 5 memory groups do not divide the tiny width of 64: only checkable against the model size
    expect_error("groups", expand, grid_of({"base": BASE, "axes": {"variant": ["ldm-rls(groups=5)"]}}))


def test_empty_grid(tmp_path):
    grid = grid_of({"base": BASE, "axes": {"train.seed": [0, 1]}, "exclude": [{"train.seed": 0}, {"train.seed": 1}]})
    expect_error("expands to no runs", expand, grid)
    expect_error("which no axis", grid_of, {"base": BASE, "axes": {"train.seed": [0]}, "exclude": [{"variant": "x"}]})
    expect_error("non-empty list", grid_of, {"base": BASE, "axes": {"train.seed": []}})


def test_colliding_runs(tmp_path):
    grid = grid_of({"base": BASE, "axes": {"train.seed": [0, 1]}, "include": [{"train.seed": 1}]})
    msg = expect_error("collide", expand, grid)
    assert "train.seed=1" in msg


def test_zip_lengths_must_agree():
    expect_error("one length", grid_of, {"zip": [{"train.lr": [1e-3, 2e-3], "train.seed": [0]}]})


def test_unknown_profile_lists_the_known_ones():
    msg = expect_error("Unknown profile 'gpu-clustr'", load_profile, "gpu-clustr")
    assert "Did you mean 'gpu-cluster'?" in msg and "local" in msg


def test_unknown_profile_key_suggests(tmp_path):
    path = write(tmp_path, "partition: debug\ncpus_per_tsk: 2\n", "p.yaml")
    msg = expect_error("Unknown key 'cpus_per_tsk'", load_profile, str(path))
    assert "Did you mean 'cpus_per_task'?" in msg


def test_slurm_without_sbatch_suggests_the_local_executor(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without sbatch, as on a laptop
    msg = expect_error("needs sbatch", check_executor, "slurm", load_profile("local"))
    assert "--executor local" in msg


def test_cli_reports_a_bad_grid_in_one_line(tmp_path, capsys):
    path = write(tmp_path, "base: {model: {preset: tiny}}\naxes: {variant: [preln, hcc]}\n")
    assert main(["sweep", str(path), "--dry-run", "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("depthmem: Unknown variant 'hcc'") and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_dry_run_lists_runs_and_resources_and_writes_nothing(tmp_path, capsys):
    path = write(
        tmp_path, "name: dry\nbase: {model: {preset: tiny}}\naxes: {variant: [preln, ldm], train.seed: [0, 1]}\n"
    )
    assert main(["sweep", str(path), "--dry-run", "--profile", "local", "--results", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out.count("submit") == 4 and "partition=debug" in out and "at most 2 at a time" in out
    assert not (tmp_path / "r").exists()
    assert os.listdir(tmp_path) == ["grid.yaml"]


def test_a_cluster_profile_submits_to_slurm_by_default_and_a_big_local_run_asks(tmp_path, monkeypatch):
    from harness.sweeps.submit import sweep

    paper_profile = load_grid(ROOT / "experiments" / "paper.yaml").profile
    assert paper_profile == "gpu-40gb" and load_profile(paper_profile).executor == "slurm"
    assert all(load_profile(name).executor == "slurm" for name in ("gpu-cluster", "gpu-40gb", "gpu-80gb"))
    on_cluster = write(tmp_path, "name: c\nprofile: gpu-cluster\nbase: {model: {preset: tiny}}\n", "c.yaml")
    assert plan(on_cluster, root=tmp_path).executor == "slurm"
    assert plan(on_cluster, root=tmp_path, executor="local").executor == "local"
    assert plan(ROOT / "experiments" / "quickstart.yaml", root=tmp_path).executor == "local"
    prof = write(tmp_path, "executor: slurm\npartition: debug\n", "cluster.yaml")
    path = write(
        tmp_path,
        f"name: big\nprofile: {prof}\nbase: {{model: {{preset: tiny}}}}\naxes: {{train.seed: [0, 1, 2, 3, 4]}}\n",
    )
    msg = expect_error(
        "add --yes to run them here", sweep, path, executor="local", root=tmp_path / "r", log=lambda _: None
    )
    assert "5 runs would train on this machine" in msg
    assert not (tmp_path / "r" / "big").exists()


def test_dry_run_for_slurm_checks_sbatch(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "name: dry\nbase: {model: {preset: tiny}}\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["sweep", str(path), "--dry-run", "--executor", "slurm", "--results", str(tmp_path / "r")]) == 2
    assert "needs sbatch on PATH" in capsys.readouterr().err


def test_key_value_overrides_change_the_base_and_narrow_an_axis(tmp_path, capsys):
    path = write(tmp_path, "name: kv\nbase: {model: {preset: tiny}}\naxes: {train.seed: [0, 1]}\n")
    p = plan(path, root=tmp_path / "r", overrides=["train.max_steps=7", "train.lr=0.002"])
    assert {(r.cfg.train.max_steps, r.cfg.train.lr) for r in p.runs} == {(7, 0.002)} and len(p.runs) == 2
    full = {r.cfg.train.seed: r.run_id for r in p.runs}
    narrowed = plan(path, root=tmp_path / "r", overrides=["train.max_steps=7", "train.lr=0.002", "train.seed=1"])
    assert [(r.cfg.train.seed, r.run_id) for r in narrowed.runs] == [(1, full[1])]  # the same run, the same id
    assert (
        main(
            [
                "sweep",
                str(path),
                "train.max_steps=9",
                "--set",
                "train.warmup_steps=2",
                "--dry-run",
                "--results",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    assert main(["sweep", str(path), "train.max_steps", "--dry-run", "--results", str(tmp_path / "r")]) == 2
    assert "needs the form KEY=VALUE" in capsys.readouterr().err


def test_version_and_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("depthmem ")
    with pytest.raises(SystemExit) as e:
        main(["status", "x", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: depthmem status") and "--bogus" in err


def test_no_controller_is_one_sentence(tmp_path, monkeypatch):
    # The shared cluster cannot be stopped for a test: stand-ins answer as sbatch and sinfo do when no
    # slurmctld runs (the message is sinfo's own).
    for name, body in (
        ("sbatch", "exit 0"),
        ("sinfo", "echo 'slurm_load_partitions: Unable to contact slurm controller (connect failure)' >&2; exit 1"),
    ):
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    from harness.errors import DepthmemError

    with pytest.raises(DepthmemError) as info:
        check_executor("slurm", load_profile("local"))
    text = str(info.value)
    assert text.startswith("No SLURM controller answers") and "Unable to contact" in text and "\n" not in text


def test_overrides_anywhere_after_the_command(tmp_path, capsys):
    path = write(tmp_path, "name: kv\nbase: {model: {preset: tiny}, train: {max_steps: 3}}\naxes: {variant: [preln]}\n")
    results = str(tmp_path / "r")
    for argv in (
        ["sweep", str(path), "--results", results, "eval.tasks=[offline_copa]", "--dry-run", "train.lr=2e-3"],
        ["sweep", "eval.tasks=[offline_copa]", str(path), "--dry-run", "--results", results, "train.lr=2e-3"],
        ["sweep", "--dry-run", str(path), "--set", "train.lr=2e-3", "--results", results, "eval.tasks=[offline_copa]"],
    ):
        assert main(argv) == 0, argv
        assert "sweep kv: 1 run(s)" in capsys.readouterr().out
    p = plan(path, root=results, overrides=["eval.tasks=[offline_copa]", "train.lr=2e-3"])
    assert p.runs[0].cfg.eval.tasks == ["offline_copa"] and p.runs[0].cfg.train.lr == 0.002
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--preset", "tiny", "--dry-run", "train.lr=4e-3", "--max-steps", "2"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["train"]["lr"] == 0.004 and resolved["train"]["max_steps"] == 2
    with pytest.raises(SystemExit) as e:
        main(["status", "kv", "--results", results, "train.lr=1e-3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "depthmem status takes no KEY=VALUE overrides, got 'train.lr=1e-3'" in err
    with pytest.raises(SystemExit):
        main(["sweep", str(path), "--results", results, "--dry-run", "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err


def test_comma_separated_values_add_or_replace_an_axis(tmp_path, capsys):
    path = write(
        tmp_path,
        "name: mr\nbase: {model: {preset: tiny}, train: {max_steps: 3}}\naxes: {variant: [preln, hc]}\n"
        "zip: {train.lr: [1.0e-3, 2.0e-3], train.warmup_steps: [1, 2]}\n",
    )
    seeds = plan(path, root=tmp_path / "r", overrides=["train.seed=0,1,2", "eval.tasks=[offline_copa,offline_piqa]"])
    assert seeds.axes == ["variant", "train.seed", "train.lr", "train.warmup_steps"]
    assert len(seeds.runs) == 2 * 3 * 2 and {r.cfg.train.seed for r in seeds.runs} == {0, 1, 2}
    assert all(r.cfg.eval.tasks == ["offline_copa", "offline_piqa"] for r in seeds.runs)  # a list is one value
    replaced = plan(path, root=tmp_path / "r", overrides=["variant=preln,ldm,mhc"])
    assert [r.cfg.variant for r in replaced.runs][::2] == ["preln", "ldm", "mhc"] and len(replaced.runs) == 6
    assert main(["sweep", str(path), "train.seed=3,4", "--dry-run", "--results", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[1].split()
    assert header[:4] == ["run_id", "variant", "seed", "lr"] and "sweep mr: 8 run(s)" in out
    assert len(re.findall(r"^\S+-s[34]-\S+ +(preln|hc) +[34] ", out, re.M)) == 8
    expect_error("zip group", plan, path, root=tmp_path / "r", overrides=["train.lr=1e-3,5e-3"])
    expect_error("names a value twice", plan, path, root=tmp_path / "r", overrides=["train.seed=1,1"])


def test_floats_without_a_dot_are_numbers_in_grid_and_config_files(tmp_path):
    from harness.config import load_config

    path = write(
        tmp_path,
        "name: f\nbase: {model: {preset: tiny}, train: {weight_decay: 1e-2}}\naxes: {train.lr: [1e-3, 3E-3]}\n",
    )
    grid = load_grid(path)
    assert grid.axes["train.lr"] == [0.001, 0.003] and grid.base["train"]["weight_decay"] == 0.01
    runs = expand(grid)
    assert [r.cfg.train.lr for r in runs] == [0.001, 0.003] and [r.overrides["train.lr"] for r in runs] == [
        0.001,
        0.003,
    ]
    config = write(tmp_path, "train: {lr: 5e-4}\n", "c.yaml")
    assert load_config(config).train.lr == 0.0005
    assert load_grid(write(tmp_path, 'axes: {data.corpus: ["1e-3"]}\n', "q.yaml")).axes["data.corpus"] == ["1e-3"]
