"""What a sweep tells its user: the dry-run text, and the lines a submission logs before and between stages."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from harness import tracking, units
from harness.rundir import write_config
from harness.sweeps.jobstate import axis_columns, format_rows
from harness.sweeps.planning import Plan
from harness.training.budget import tokens_per_step, train_steps


def write_tuning(p: Plan, log) -> None:
    """Write tuning.json and say which cells still wait for their tuning runs, and why."""
    from harness.sweeps import tuning

    tuning.write(p.sweep_dir, p.grid, p.selection)
    for entry in p.selection.values():
        if entry["tuned"] and entry["state"] == "chosen":
            edge = f" (at the {entry['edge']} value tried)" if entry["at_edge"] else ""
            log(f"tuning stage: {entry['cell']}: {p.grid.tune.axis}={entry['chosen']:g}{edge}")
    blocked = [e for e in p.selection.values() if e["tuned"] and e["state"] != "chosen"]
    for entry in blocked:
        log(f"tuning stage: {entry['cell']} has no {p.grid.tune.axis} yet: {entry['reason']}")
    if p.waiting:
        log(
            f"{len(p.waiting)} run(s) wait for their tuning runs to end; `depthmem sweep {p.grid.source}` "
            "submits them then, redoing nothing that has finished"
        )


def backfill_trackers(p: Plan, log) -> None:
    """Send finished runs' metrics to a logger switched on after they trained, from their metrics.csv."""
    if not p.backfill:
        return
    logger = {r.run_id: r.cfg.train.logger for r in p.runs}
    for r in p.runs:
        if r.run_id in p.backfill:
            run_dir = p.sweep_dir / r.run_id
            tracking.backfill(run_dir, r.cfg)
            write_config(run_dir, r.cfg)  # the run's config now names the logger that holds its curves
    names = sorted({logger[rid] for rid in p.backfill})
    where = {"tensorboard": "TensorBoard (each run's tensorboard/ folder)", "wandb": "W&B"}
    log(
        f"sent the metrics of {len(p.backfill)} finished run(s) to {' and '.join(where[n] for n in names)} "
        "from their metrics.csv; nothing was trained again"
    )


def announce_plan(p: Plan, log) -> None:
    groups: dict[str, list[str]] = {}
    for rid, decision in p.decisions.items():
        groups.setdefault(decision, []).append(rid)
    if groups.get("done"):
        log(f"skipping {len(groups['done'])} finished run(s): {', '.join(groups['done'])}")
    if groups.get("queued"):
        log(f"skipping {len(groups['queued'])} run(s) still queued or running: {', '.join(groups['queued'])}")
    if groups.get("failed"):
        log(
            f"skipping {len(groups['failed'])} failed run(s) (rerun them with --retry-failed): "
            f"{', '.join(groups['failed'])}"
        )
    for what, label in (
        ("resume", "resuming from their last checkpoint"),
        ("retry", "retrying"),
        ("evaluate", "evaluating on the tasks they have no result of"),
        ("submit", "starting"),
    ):
        if groups.get(what):
            log(f"{label}: {len(groups[what])} run(s)")
    if not p.to_submit():
        log("nothing to submit.")


def describe_plan(p: Plan, memory: bool | None = None, log=None) -> str:
    """The dry-run text: every run with its grid values and decision, then the resources each job asks for, what it
    costs and, where the profile asks for GPUs (or ``memory`` is true), the memory plan per card; ``log`` hears
    that the plan's simulations start."""

    lines = _describe_tuning(p) if p.tuning is not None else []
    tuned = p.grid.tune is not None
    lr_column = [p.grid.tune.axis] if tuned else []
    rows = [
        {
            "run_id": r.run_id,
            **{k: r.overrides.get(k, "") for k in p.axes},
            **({lr_column[0]: f"{r.cfg.train.lr:g}"} if tuned else {}),
            "action": p.decisions.get(r.run_id),
            "steps": train_steps(r.cfg),
            "tokens": train_steps(r.cfg) * tokens_per_step(r.cfg),
        }
        for r in p.runs
    ]
    for row in rows:
        if row["action"] == "waiting":
            row.update(action="after tuning", **({lr_column[0]: "(tuned)"} if tuned else {}))
    # The columns in the order ``depthmem status`` shows them: id, grid values, what happens, then the budget.
    shown = [{**row, "tokens": units.tokens(row["tokens"])} for row in rows]
    stage = "main stage: " if tuned else ""
    lines += [
        f"{stage}sweep {p.grid.name}: {len(p.runs)} run(s) in {p.sweep_dir}",
        format_rows(shown, ["run_id", *p.axes, *lr_column, "action", "steps", "tokens"]),
    ]
    budgets = sorted({(row["steps"], row["tokens"]) for row in rows})
    if len(budgets) == 1:
        lines.append(f"budget: every run trains {budgets[0][0]:,} steps on {budgets[0][1]:,} tokens")
    else:
        lines.append(
            f"budget: the runs train on {len(budgets)} different budgets, from {budgets[0][1]:,} to "
            f"{budgets[-1][1]:,} tokens (the grid varies the budget or the model size)"
        )
    pr = p.profile
    res = (
        f"resources ({p.executor}, profile {pr.name}): partition={pr.partition or '(default)'} "
        f"account={pr.account or '-'} qos={pr.qos or '-'} time={pr.time_min}min nodes={pr.nodes} "
        f"tasks_per_node={pr.tasks_per_node} gpus_per_node={pr.gpus_per_node} cpus_per_task={pr.cpus_per_task} "
        f"mem={pr.mem_gb:g}GB; {len(p.to_submit())} job(s) as an array, at most {p.parallelism} at a time"
    )
    lines.append(res)
    if pr.setup:
        lines.append("setup: " + "; ".join(pr.setup))
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.sweeps.estimate import describe_costs

    lines.append(describe_costs(p.runs, pr, measured_steps(p)))
    if memory or (memory is None and pr.gpus_per_node > 0):
        from harness.sweeps.estimate import describe_memory

        lines.append(describe_memory([*(p.tuning.runs if p.tuning else []), *p.runs], pr.gpu_mem_gb, log))
    if p.tuning is not None:
        lines.append(_both_stages(p))
    if p.backfill:
        loggers = sorted({r.cfg.train.logger for r in p.runs if r.run_id in p.backfill})
        lines.append(
            f"{len(p.backfill)} finished run(s) never sent their metrics to {' or '.join(loggers)}: "
            "a submission sends them from each run's metrics.csv and config, training nothing again"
        )
    lines += [f"note: {n}" for n in p.notes]
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def measured_steps(p: Plan) -> Path:
    """The ``make gpu-bench`` steps of the results folder the sweep is planned in, which price its GPU time where
    they cover its card and variants (``harness.benchmarks.measured``)."""
    return p.sweep_dir.parent / "gpu-bench" / "steps.csv"


def _describe_tuning(p: Plan) -> list[str]:
    """The dry run's tuning block: the protocol, each tuning run with its decision, their cost and the choices."""
    from harness.sweeps.estimate import describe_costs

    t, tp = p.grid.tune, p.tuning
    assert t is not None and tp is not None
    tuned = [e for e in p.selection.values() if e["tuned"]]
    seeds = f"seeds {', '.join(map(str, t.seeds))}" if t.seeds else "1 seed (each cell's first)"
    rows = [
        {
            "run_id": r.run_id,
            **{k: r.overrides.get(k, "") for k in tp.axes},
            "action": tp.decisions.get(r.run_id),
            "steps": train_steps(r.cfg),
            "tokens": units.tokens(train_steps(r.cfg) * tokens_per_step(r.cfg)),
        }
        for r in tp.runs
    ]
    lines = [
        f"tuning stage: {len(tp.runs)} run(s) in {tp.sweep_dir}: {len(tuned)} cell(s) x {len(t.values)} value(s) "
        f"of {t.axis} ({', '.join(f'{v:g}' for v in t.values)}) x {seeds}, each validated on the tuning split "
        f"(data.eval_split=tune) and judged on its final {t.metric}; a cell's runs start once its tuning has ended",
        format_rows(rows, ["run_id", *tp.axes, "action", "steps", "tokens"]),
        describe_costs(tp.runs, p.profile, measured_steps(p)),
    ]
    inherit = [e for e in p.selection.values() if not e["tuned"]]
    for entry in tuned:
        chosen = "not chosen yet" if entry["chosen"] is None else f"{entry['chosen']:g}"
        edge = f" (at the {entry['edge']} value tried)" if entry["at_edge"] else ""
        lines.append(f"tuning: {entry['cell']}: {t.axis} {chosen}{edge}")
    for entry in inherit:
        where = f"the choice of {entry['from']}" if entry.get("from") else "the base value (not tuned)"
        lines.append(f"tuning: {entry['cell']}: {t.axis} from {where}")
    return lines


def _both_stages(p: Plan) -> str:
    """One line that adds the tuning stage's cost to the main runs'."""
    from harness.sweeps.estimate import sweep_cost

    assert p.tuning is not None
    pr = p.profile
    rates = dict(peak_tflops=pr.gpu_peak_tflops, utilisation=pr.utilisation, steps_csv=measured_steps(p))
    tune = sweep_cost([r.cfg for r in p.tuning.runs], **rates)
    main = sweep_cost([r.cfg for r in p.runs], **rates)

    def total(costs, key):
        return sum(c[key] for c in costs)

    return (
        f"with tuning: {len(tune)} tuning run(s) ({units.tokens(total(tune, 'tokens'))} tokens, "
        f"{units.gpu_time(total(tune, 'gpu_hours'))}) + {len(main)} main run(s) "
        f"({units.tokens(total(main, 'tokens'))} tokens, {units.gpu_time(total(main, 'gpu_hours'))}) = "
        f"{units.tokens(total(tune, 'tokens') + total(main, 'tokens'))} tokens, "
        f"{units.gpu_time(total(tune, 'gpu_hours') + total(main, 'gpu_hours'))}"
    )


CLOSING_COLUMNS = ["state", "val_loss", "val_bpb", "params", "tokens_per_s"]


def closing_table(rows: list[dict[str, Any]], sweep_dir: Path) -> str:
    """The table a sweep that was waited for ends with: each run of the grid with its grid values, state and final
    numbers, its downstream score per task (in percent, on the metric the report uses), then how many runs ended in
    each state."""
    from harness.reporting.tables.comparisons import choose_metric

    rows = [dict(r) for r in rows if not r.get("superseded")]
    scores = {r["run_id"]: _eval_table(sweep_dir / r["run_id"]) for r in rows if r["state"] == "done"}
    reported: dict[str, set[str]] = {}
    for table in scores.values():
        for task, metric in table:
            reported.setdefault(task, set()).add(metric)
    chosen = {task: choose_metric(metrics) for task, metrics in sorted(reported.items())}
    tasks = [task for task, metric in chosen.items() if metric]
    for row in rows:
        table = scores.get(row["run_id"], {})
        for task in tasks:
            value = table.get((task, chosen[task]))
            row[task] = f"{100 * value:.1f}" if value is not None else ""
    columns = ["run_id", *axis_columns(rows), *CLOSING_COLUMNS, *tasks, "reason"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    summary = f"{len(rows)} run(s): " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    if tasks:
        summary += "; downstream in percent: " + ", ".join(f"{t} {chosen[t]}" for t in tasks)
    return format_rows(rows, columns) + "\n" + summary


def _eval_table(run_dir: Path) -> dict[tuple[str, str], float]:
    """(task, metric) -> value from a run's eval/table.csv; empty where it has none or it cannot be read."""
    path = run_dir / "eval" / "table.csv"
    out: dict[tuple[str, str], float] = {}
    try:
        with path.open(newline="") as f:
            for rec in csv.DictReader(f):
                try:
                    out[(rec["task"], rec["metric"])] = float(rec["value"])
                except (KeyError, TypeError, ValueError):
                    continue
    except OSError:
        return {}
    return out


def progress_line(finished: int, pending: int, running: int, parallelism: int, elapsed_s: float) -> str:
    """``[3/10 finished, about 4:20 left]``: how many of a local sweep's runs have ended and, once one has, the time
    the rest should take at the pace so far (``elapsed_s`` since the first started, so the time between one run's
    end and the next one's start counts too). The first runs end together, ``parallelism`` at a time, so the pace
    counts at least that many."""
    total = finished + pending + running
    text = f"[{finished}/{total} finished"
    if finished and (pending or running):
        per_run = elapsed_s / max(finished, min(parallelism, total))
        text += f", about {units.duration(per_run * (pending + running))} left"
    return text + "]"
