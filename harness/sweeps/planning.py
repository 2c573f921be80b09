"""Planning a sweep: expanding and validating its grid and deciding, run by run, what a submission would do.

Nothing here submits a run, so a dry run (``depthmem sweep --dry-run``) and a submission share one plan.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import preflight, tracking
from harness.errors import DepthmemError, UsageError
from harness.io import check_creatable
from harness.rundir import read_sweep_record
from harness.sweeps.grid import Grid, GridRun, axis_keys, check_tune, expand, load_grid
from harness.sweeps.job import pending_tasks
from harness.sweeps.jobstate import default_root, run_rows
from harness.sweeps.profiles import EXECUTORS, Profile, load_profile


@dataclass
class Plan:
    """What a submission would do: the grid, its runs, resources, and a decision per run."""

    grid: Grid
    runs: list[GridRun]
    profile: Profile
    executor: str
    sweep_dir: Path
    parallelism: int
    decisions: dict[str, str] = field(default_factory=dict)
    """run_id -> ``submit``, ``resume``, ``evaluate``, ``done``, ``queued``, ``failed`` (skipped), ``retry`` or
    ``waiting`` (for its cell's tuning runs)."""
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the dry run points out without refusing it: eval tasks that need the Hugging Face hub."""
    axes: list[str] = field(default_factory=list)
    backfill: list[str] = field(default_factory=list)
    """Finished runs whose ``train.logger`` has not seen their metrics; the submission sends them from metrics.csv."""
    tuning: Plan | None = None
    """The tuning stage of a grid with ``tune``: its runs live in ``<sweep>/tune/``."""
    selection: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The tuning stage's entry per cell, as ``tuning.json`` holds it."""

    @property
    def waiting(self) -> list[GridRun]:
        """Runs that wait for their cell's tuning to end: their learning rate, and so their id, is not known yet."""
        return [r for r in self.runs if self.decisions.get(r.run_id) == "waiting"]

    def to_submit(self) -> list[GridRun]:
        return [r for r in self.runs if self.decisions.get(r.run_id) in ("submit", "resume", "retry", "evaluate")]


def _check_corpus(runs: list[GridRun]) -> list[str]:
    missing = sorted(
        {r.cfg.data.corpus for r in runs if r.cfg.data.corpus != "shakespeare" and not Path(r.cfg.data.corpus).exists()}
    )
    return [f"the corpus {c} does not exist yet: build it with `depthmem prepare` before submitting." for c in missing]


def _slurm_partitions() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DepthmemError(f"No SLURM controller answers: sinfo failed ({e}).") from None
    if out.returncode != 0:
        first = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[0]
        raise DepthmemError(
            f"No SLURM controller answers (sinfo: {first}); start it, or run here with --executor local."
        )
    return [p.strip().rstrip("*") for p in out.stdout.split() if p.strip()]


def check_executor(executor: str, profile: Profile) -> None:
    """Fail before submitting when the executor cannot run here or the profile names an unknown partition."""
    if executor not in EXECUTORS:
        raise UsageError(f"Unknown executor {executor!r}; allowed: {', '.join(EXECUTORS)}.")
    if executor != "slurm":
        return
    if shutil.which("sbatch") is None:
        raise UsageError(
            "--executor slurm needs sbatch on PATH and there is none here; use --executor local to run on this machine."
        )
    if profile.partition:
        partitions = _slurm_partitions()
        if profile.partition not in partitions:
            raise UsageError(
                f"Unknown partition {profile.partition!r} in the profile {profile.name!r}; "
                f"this cluster has {', '.join(partitions) or 'no partitions'}."
            )


def plan(
    grid_file: str | Path,
    *,
    executor: str | None = None,
    profile: str | None = None,
    root: str | Path | None = None,
    retry_failed: bool = False,
    parallelism: int | None = None,
    overrides: list[str] | None = None,
) -> Plan:
    """Expand and validate a grid and decide, run by run, what a submission would do (submits nothing).

    ``overrides`` (``["train.max_steps=200"]``) change the grid's base. Reading the runs' states records, as
    failed or cancelled, runs whose jobs were stopped from outside.
    """
    if executor is not None and executor not in EXECUTORS:
        raise UsageError(f"Unknown executor {executor!r}; allowed: {', '.join(EXECUTORS)}.")
    grid = load_grid(grid_file)
    if overrides:
        apply_overrides(grid, overrides)
        check_tune(grid)
    prof = load_profile(profile or grid.profile)
    runs = expand(grid, defaults=prof.config_layer())
    sweep_dir = Path(root or default_root()) / grid.name
    keep_existing_ids(runs, sweep_dir)
    executor = executor or prof.executor
    parallelism = parallelism or grid.parallelism or prof.array_parallelism
    tuning_plan, waiting, entries = None, [], {}
    ready = runs
    if grid.tune is not None:
        from harness.sweeps import tuning

        cell_list = tuning.cells(grid, runs)
        by_cell = tuning.expand_tuning(grid, cell_list, defaults=prof.config_layer())
        tune_runs = [r for rs in by_cell.values() for r in rs]
        keep_existing_ids(tune_runs, sweep_dir / tuning.TUNE_DIR)
        tuning_plan = Plan(
            grid,
            tune_runs,
            prof,
            executor,
            sweep_dir / tuning.TUNE_DIR,
            parallelism=parallelism,
            axes=[*axis_keys(grid), grid.tune.axis, "data.eval_split"],
        )
        _decide(tuning_plan, retry_failed)
        entries = tuning.selection(grid, cell_list, by_cell, tuning_plan.sweep_dir)
        ready, waiting = tuning.apply(grid, runs, cell_list, entries)
        keep_existing_ids(ready, sweep_dir)
    p = Plan(grid, ready, prof, executor, sweep_dir, parallelism=parallelism, axes=axis_keys(grid))
    p.tuning, p.selection = tuning_plan, entries
    p.warnings = _check_corpus(p.runs) + preflight.for_executor([r.cfg for r in p.runs], p.executor)
    check_needs(p)
    _decide(p, retry_failed, [r for r in ready if not any(r is w for w in waiting)])
    p.decisions.update({r.run_id: "waiting" for r in waiting})
    return p


def _identity_suffix(rid: str) -> str:
    # ``...-s0-3f2a9c1e``: the seed and the hash of what the run trains; the readable part before them may be
    # written differently by another version of the harness.
    return "-".join(rid.rsplit("-", 2)[-2:])


def keep_existing_ids(runs: list[GridRun], folder: Path) -> None:
    """Give a run whose id has no folder in ``folder`` the folder of the same seed and config hash, when exactly
    one folder and one run have that ending: how the finished runs of a sweep whose ids were written under
    another form of their readable part (``lr0.01`` for ``lr1e-2``) are found again instead of trained anew."""
    try:
        names = [e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return
    folders: dict[str, list[str]] = {}
    for name in names:
        folders.setdefault(_identity_suffix(name), []).append(name)
    suffixes = [_identity_suffix(r.run_id) for r in runs]
    taken = set(names) & {r.run_id for r in runs}
    for r, suffix in zip(runs, suffixes):
        found = folders.get(suffix, [])
        if r.run_id in names or len(found) != 1 or suffixes.count(suffix) != 1 or found[0] in taken:
            continue
        r.run_id = found[0]


def check_needs(p: Plan) -> None:
    """Refuse, in a dry run as in a submission, what would stop every run wherever it runs: eval tasks that
    lm-eval does not know or whose data is missing, and a results folder that cannot be written.

    What depends on the machine the runs go to (a GPU, a partition, the corpus) is in ``p.warnings``: a dry run
    on a laptop shows it, a submission refuses it.
    """
    from harness.evaluation.evaluator import check_tasks
    from harness.evaluation.tasks import SUITE, is_offline_name

    tasks = list(dict.fromkeys(t for r in p.runs for t in r.cfg.eval.tasks))
    if tasks:
        try:
            check_tasks(tasks)
        except UsageError as e:
            raise UsageError(f"eval.tasks in {p.grid.source}: {e}") from None
    hub = [t for t in tasks if not is_offline_name(t)]
    if hub:
        twins = [f"{SUITE}_{t}" for t in hub if is_offline_name(f"{SUITE}_{t}")]
        p.notes.append(
            f"eval.tasks names {', '.join(hub)}, whose data lm-eval downloads from the Hugging Face hub: a node "
            f"without the network evaluates {'it' if len(hub) == 1 else 'them'} only from a cached copy"
            + (f" ({', '.join(twins)} read the same benchmark from disk)" if twins else "")
        )
    check_creatable(p.sweep_dir, "sweep folder")


def _decide(p: Plan, retry_failed: bool, runs: list[GridRun] | None = None) -> None:
    """Each run's decision (of ``runs``, default all of the plan's) from its state on disk and its job's."""
    sweep_dir, runs = p.sweep_dir, p.runs if runs is None else runs
    states = {row["run_id"]: row for row in run_rows(sweep_dir, read_sweep_record(sweep_dir))}
    for r in runs:
        run_dir = sweep_dir / r.run_id
        row = states.get(r.run_id, {})
        state = row.get("state", "pending")
        if row.get("job_active"):
            p.decisions[r.run_id] = "queued"
        elif state == "done":
            todo = pending_tasks(run_dir, list(r.cfg.eval.tasks), r.cfg.eval.limit) if r.cfg.eval.tasks else []
            p.decisions[r.run_id] = "evaluate" if todo else "done"
            if tracking.needs_backfill(run_dir, r.cfg):
                p.backfill.append(r.run_id)
        elif state in ("failed", "diverged"):
            p.decisions[r.run_id] = "retry" if retry_failed else "failed"
        elif (run_dir / "ckpt" / "last.ckpt").exists():
            p.decisions[r.run_id] = "resume"
        else:
            p.decisions[r.run_id] = "submit"


def split_choices(text: str) -> list[str]:
    """The parts of ``text`` between commas outside brackets and quotes: ``1e-3,3e-3`` has two, ``[a,b]`` one."""
    parts, depth, quote, current = [], 0, "", ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += c
    return parts + [current]


def apply_overrides(grid: Grid, overrides: list[str]) -> None:
    """Apply command-line ``KEY=VALUE`` overrides to a grid, Hydra multirun style.

    ``KEY=VALUE`` sets KEY in the base, except on a key the grid varies, whose axis it narrows to that one value;
    ``KEY=V1,V2`` makes KEY an axis over the values (a new axis goes last; a grid's own keeps its place). A value
    holding a list is written in brackets, ``eval.tasks=[a,b]``, and one comma-separated string in quotes.
    """
    import yaml

    from harness.yamltext import load

    zipped = {k for g in grid.zips for k in g}
    for item in overrides:
        key, _, text = item.partition("=")
        key = key.strip()
        choices = split_choices(text)
        try:
            values = [load(part) if part.strip() else "" for part in choices]
        except yaml.YAMLError:
            raise UsageError(
                f"The value of {item!r} is not valid YAML: put brackets around a list and quotes around text "
                "with commas or colons."
            ) from None
        if key in zipped:
            raise UsageError(
                f"{key} varies in a zip group of {grid.source}; change its values there, or drop it from the group "
                f"to sweep it with {item!r}."
            )
        if len(values) > 1 or key in grid.axes:
            if len(values) != len({repr(v) for v in values}):
                raise UsageError(f"{item!r} names a value twice; each value of an axis gives one run.")
            grid.axes[key] = values
        else:
            grid.base = {**grid.base, key: values[0]}
