"""What the runs cost and which were left out: parameters, FLOPs and memory (``cost``), the compute multiplier,
the benchmark, and the runs no average includes (``excluded_runs``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from harness.reporting import frontier
from harness.reporting.items import Context, NoData, table
from harness.reporting.render import Table, fmt_bytes, fmt_count, fmt_ratio
from harness.reporting.results import Run, split_variant
from harness.reporting.tables.common import failures, group_runs, ordered_keys, variant_order, with_axes

COST_FIELDS = (
    "params",
    "extra_params",
    "stream_floats_per_token",
    "extra_flops_per_token",
    "tokens_per_s",
    "peak_mem_bytes",
)


MEMORY_METHODS = {
    "cuda": "torch.cuda.max_memory_allocated over training",
    "cpu": "the CPU allocator's live-byte peak of one profiled training step plus the parameters, "
    "gradients and optimizer state (as `depthmem bench` measures it)",
}


def cores_shared(run: Run) -> bool | None:
    """Whether a run trained on CPU cores that other work also used (load average above its cores), or None
    when its summary does not say."""
    s = run.summary or {}
    if "cores_shared" in s:
        return bool(s["cores_shared"])
    return None


def memory_method(run: Run) -> str | None:
    """``cuda`` or ``cpu`` for an allocator peak; None for older summaries whose peak is the process RSS."""
    method = (run.summary or {}).get("peak_mem_method")
    return method if method in MEMORY_METHODS else None


@table("cost", needs="`summary.json`")
def cost_table(ctx: Context) -> Table:
    """Parameters, extra parameters, stream floats and extra FLOPs per token, tokens/s and the training step's
    allocator peak memory, averaged over seeds, with ratios to the baseline. Throughput from runs that shared
    CPU cores is marked and gets no ratio."""
    sweep, baseline = ctx.sweep, split_variant(ctx.baseline)[0]
    finished = [r for r in sweep.finished() if r.summary]
    if not finished:
        raise NoData("no finished run has a summary.json")
    groups = group_runs(finished)

    def field_mean(runs: list[Run], name: str) -> float:
        if name == "peak_mem_bytes":
            runs = [r for r in runs if memory_method(r)]
        values = [float(r.summary[name]) for r in runs if isinstance(r.summary.get(name), (int, float))]
        return float(np.mean(values)) if values else math.nan

    data, display, methods, rss, shared_rows = [], [], set(), False, False
    for setting, variant in ordered_keys(groups, baseline):
        runs, ref = groups[(setting, variant)], groups.get((setting, baseline), [])
        row = {"setting": setting, "variant": variant, "seeds": len(runs)}
        row.update({name: field_mean(runs, name) for name in COST_FIELDS})
        row["peak_mem_method"] = ",".join(sorted({m for r in runs if (m := memory_method(r))}))
        methods.update(m for r in runs if (m := memory_method(r)))
        rss = rss or any(memory_method(r) is None for r in runs)
        shared = any(cores_shared(r) for r in runs + ref)
        row["cores_shared"] = shared
        for name in ("params", "tokens_per_s", "peak_mem_bytes"):
            ref_value = field_mean(ref, name) if ref else math.nan
            row[f"{name}_rel"] = row[name] / ref_value if ref_value and not math.isnan(ref_value) else math.nan
        if shared:
            row["tokens_per_s_rel"] = math.nan
            shared_rows = True
        data.append(row)
        speed = (
            f"{fmt_count(row['tokens_per_s'])} (shared cores)"
            if shared
            else f"{fmt_count(row['tokens_per_s'])} ({fmt_ratio(row['tokens_per_s_rel'])})"
        )
        display.append(
            {
                "Setting": setting,
                "Variant": variant,
                "Params": f"{fmt_count(row['params'])} ({fmt_ratio(row['params_rel'])})",
                "Extra params": fmt_count(row["extra_params"]),
                "Stream floats/token": fmt_count(row["stream_floats_per_token"]),
                "Extra FLOPs/token": fmt_count(row["extra_flops_per_token"]),
                "Tokens/s": speed,
                "Peak memory (allocator)": (
                    f"{fmt_bytes(row['peak_mem_bytes'])} ({fmt_ratio(row['peak_mem_bytes_rel'])})"
                ),
            }
        )
    data, display = with_axes(data, display, sweep)
    notes = [
        f"From each finished run's summary.json, mean over seeds; ratios in parentheses are relative to "
        f"{baseline} in the same setting."
    ]
    if methods:
        notes.append(
            "Peak memory is the training step's allocator peak: "
            + "; ".join(f"{m.upper()} runs: {MEMORY_METHODS[m]}" for m in sorted(methods))
            + "."
        )
    if rss:
        notes.append(
            "Runs whose summary.json does not say how peak memory was measured (older runs recorded the "
            "process's peak RSS, which counts tokenizer training and the Python heap) are left out of the "
            "memory column."
        )
    if shared_rows:
        notes.append(
            "Tokens/s marked (shared cores) comes from runs that trained while other work used the same "
            "CPU cores (the run's threads and the other runnable tasks, sampled at every logged step, "
            "outnumbered the cores), so it is no measure of the variant's cost and gets no ratio."
        )
    return Table("cost", "Cost relative to the baseline", data, display, notes)


BENCH_COLUMNS = ("variant", "depth", "width", "seq_len", "step_time_ms", "ratio_time", "peak_mem_bytes", "ratio_mem")


def read_bench(path: Path) -> pd.DataFrame:
    """The benchmark CSV with canonical variant names, sorted; raises ValueError when it lacks a column."""
    frame = pd.read_csv(path)
    missing = [c for c in BENCH_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"it lacks the columns {', '.join(missing)}")
    frame["variant"] = [split_variant(str(v))[0] for v in frame["variant"]]
    return frame.sort_values(["variant", "depth", "width", "seq_len"], kind="stable").reset_index(drop=True)


@table(
    "compute_multiplier",
    needs="finished runs of at least three model sizes at one tokens-per-parameter budget, baseline included",
)
def compute_multiplier_table(ctx: Context) -> Table:
    """The compute multiplier of every variant: the factor of the baseline's training compute that the baseline's
    fitted power law needs to reach the variant's loss, per model size and as the geometric mean over sizes, with
    a 95% interval: a bootstrap over seeds where every cell has at least five, else from the fit's uncertainty."""

    result = ctx.cached("frontier", lambda: frontier.from_sweep(ctx.sweep, ctx.baseline))
    rows = result.multipliers
    if rows.empty:
        raise NoData(result.reason or "no variant besides the baseline has frontier points")
    display = pd.DataFrame(
        {
            "Variant": rows["variant"],
            "Size": ["all (geometric mean)" if math.isnan(p) else f"{fmt_count(p)} params" for p in rows["params"]],
            "Seeds": rows["seeds"].astype(str),
            "Train FLOPs": [fmt_count(c) if not math.isnan(c) else "—" for c in rows["flops"]],
            "Loss": ["—" if math.isnan(v) else f"{v:.4f}" for v in rows["loss"]],
            "Compute multiplier (95% CI)": [
                fmt_ratio(m) if math.isnan(lo) else f"{m:.2f}× [{lo:.2f}, {hi:.2f}]"
                for m, lo, hi in zip(rows["multiplier"], rows["low"], rows["high"])
            ],
            "Interval": [how or "none" for how in rows["interval"]],
        }
    )
    fits = "; ".join(f"{r.variant}: L = {r.a:.3g} · C^(−{r.b:.4f})" for r in result.fits.itertuples())
    notes = [
        f"Each point is a model size trained at {result.budget_text}; C is training compute, 3 × forward FLOPs "
        f"per token × training tokens. The power law L = a · C^(−b) is fitted by least squares in log–log "
        f"space per variant ({fits}). The multiplier is C_{result.baseline}(L) / C, where C_{result.baseline}(L) "
        f"inverts the {result.baseline} fit: above 1 means the variant reaches its loss with less compute than "
        f"{result.baseline} would need."
    ]
    kinds = set(rows["interval"])
    if "bootstrap" in kinds:
        notes.append(
            f"Interval bootstrap: percentile bootstrap over seeds ({frontier.BOOTSTRAP} resamples, seeds "
            f"resampled jointly across sizes and variants, {result.baseline}'s law refitted in every resample), "
            f"for rows whose cells and {result.baseline}'s all have at least {frontier.MIN_BOOTSTRAP_SEEDS} seeds."
        )
    if kinds & {"fit", "fit, one seed"}:
        notes.append(
            f"Interval fit: with fewer than {frontier.MIN_BOOTSTRAP_SEEDS} seeds a bootstrap has too few distinct "
            f"resamples, so the interval is the delta method on the log multiplier with the covariance of "
            f"{result.baseline}'s least-squares fit (Student t with sizes − 2 degrees of freedom) and the variance "
            "of the row's mean log loss over its seeds"
            + (
                "; fit, one seed: the row has a single seed, so only the fit's uncertainty is in it."
                if "fit, one seed" in kinds
                else "."
            )
        )
    if "" in kinds:
        notes.append("Interval none: the fit gives no finite interval for these rows.")
    return Table("compute_multiplier", f"Compute multiplier against {result.baseline}", rows, display, notes)


@table("bench", needs="a benchmark CSV (`--bench`, `report.bench`, or `bench.csv` in the sweep folder)")
def bench_table(ctx: Context) -> Table:
    """The benchmark's step time and peak memory per variant and size, with ratios to the baseline."""
    bench, baseline = ctx.bench, split_variant(ctx.baseline)[0]
    if bench is None or bench.empty:
        raise NoData("no benchmark CSV (results/<sweep>/bench.csv or --bench)")
    order = {v: i for i, v in enumerate(variant_order(bench["variant"], baseline))}
    data = (
        bench.assign(_o=bench["variant"].map(order))
        .sort_values(["_o", "depth", "width", "seq_len"], kind="stable")
        .drop(columns="_o")
        .reset_index(drop=True)
    )
    display = pd.DataFrame(
        {
            "Variant": data["variant"],
            "Depth": data["depth"].astype(str),
            "Width": data["width"].astype(str),
            "Seq len": data["seq_len"].astype(str),
            "Step time (ms)": [f"{v:.2f}" for v in data["step_time_ms"]],
            "Time ×": [fmt_ratio(v) for v in data["ratio_time"]],
            "Peak memory": [fmt_bytes(v) for v in data["peak_mem_bytes"]],
            "Memory ×": [fmt_ratio(v) for v in data["ratio_mem"]],
        }
    )
    notes = [f"From the benchmark CSV (depthmem bench); ratios are relative to {baseline} at the same size."]
    return Table("bench", "Measured overhead (benchmark)", data[list(BENCH_COLUMNS)], display, notes)


@table("excluded_runs", needs="always built when some run is left out", always=True)
def runs_table(ctx: Context) -> Table:
    """Every run kept out of the averages (failed, diverged, unfinished, or without a final loss) and why."""
    data, display = [], []
    if not ctx.sweep.excluded():
        raise NoData("every run finished and counts")
    for run in ctx.sweep.excluded():
        reason = run.message
        if run.state == "done" and failures([run]):
            reason = reason or "finished with a non-finite final validation loss (diverged)"
        elif run.state == "done":
            reason = reason or "finished without a readable final validation loss in summary.json"
        data.append(
            {
                "run_id": run.run_id,
                "run_dir": run.rel,
                "variant": run.variant,
                "seed": run.seed,
                "state": run.state,
                "step": run.status.get("step"),
                "message": reason,
            }
        )
        step = run.status.get("step")
        display.append(
            {
                "Run": run.run_id,
                "Variant": run.variant,
                "Seed": str(run.seed),
                "State": run.state,
                "Step": "—" if step is None else str(step),
                "Message": reason or "—",
            }
        )
    columns = ["Run", "Variant", "Seed", "State", "Step", "Message"]
    return Table(
        "excluded_runs",
        "Runs not counted in any average",
        pd.DataFrame(data, columns=["run_id", "run_dir", "variant", "seed", "state", "step", "message"]),
        pd.DataFrame(display, columns=columns),
    )
