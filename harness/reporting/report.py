"""``REPORT.md`` for a sweep: every table inline, every figure linked, from the run directories alone.

``report(sweep_dir)`` reads the sweep (``harness.reporting.results``): a folder, or an archive ``depthmem pack``
wrote. It writes the tidy table (Parquet and CSV), the tables (Markdown, LaTeX, CSV) under ``tables/``, the figures
(PNG, PDF) under ``figures/`` and ``REPORT.md`` with relative links, so it reads on any Git host. Nothing is
retrained and nothing is timestamped: the same results give the same files. What to produce comes from a
``ReportSpec``, usually the ``report:`` section of a grid file; a missing section means everything. Failed,
diverged and unfinished runs are listed, never averaged.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from harness.errors import UsageError, did_you_mean
from harness.io import atomic_write_text, remove_stale_temps, writable_dir
from harness.reporting import figures as figs
from harness.reporting import items as report_items
from harness.reporting import sensitivity  # noqa: F401  (registers the learning-rate sensitivity items)
from harness.reporting import tables as tabs
from harness.reporting import tuning as tuning_report
from harness.reporting.archive import ARCHIVE_SUFFIXES, archive_stem, is_archive
from harness.reporting.claims import parse_claims
from harness.reporting.results import Sweep, aggregate, load_sweep, runs_frame, save_frame
from harness.yamltext import read_yaml

TABLES = report_items.names("table")
FIGURES = report_items.names("figure")


def results_root() -> Path:
    """Where sweeps live by name: ``$DEPTHMEM_RESULTS``, else ``results``."""
    return Path(os.environ.get("DEPTHMEM_RESULTS", "results"))


@dataclass
class ReportSpec:
    """What a report holds: the ``report:`` section of a grid file (every key optional)."""

    sweep: str | None = None
    """The sweep name under results/ (or a folder); defaults to the grid's ``name``, else the file's stem."""
    title: str | None = None
    summary: str | None = None
    """A paragraph under the title: what the sweep is, at what scale, and what it cannot show."""
    tables: list[str] = field(default_factory=lambda: list(TABLES))
    figures: list[str] = field(default_factory=lambda: list(FIGURES))
    baseline: str = "preln"
    """The variant every difference and ratio is taken against."""
    ablation_reference: str = "ldm-rls"
    """The reference of the ablations figure; it orders the ablation table's bases."""
    bench: str | None = None
    """A benchmark CSV; by default ``bench.csv`` in the sweep folder when it exists."""
    primary: list | None = None
    """The primary family: the comparisons the grid's verdicts rest on (``harness.reporting.claims``)."""
    secondary: dict | None = None
    """Secondary families by name, each a list of comparisons."""

    @property
    def claims(self) -> list | None:
        """Every declared comparison, parsed from ``primary`` and ``secondary`` (checked when ``report_spec`` built
        the spec); None when the grid declares none."""
        declared = {k: v for k, v in (("primary", self.primary), ("secondary", self.secondary)) if v is not None}
        return parse_claims({**declared, "baseline": self.baseline}, "the report section") if declared else None


def _names(value: Any, allowed: tuple[str, ...], key: str, source: str) -> list[str]:
    if value is None or value == "all":
        return list(allowed)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"report.{key} in {source} must be a list of names from: {', '.join(allowed)}.")
    for name in value:
        if name not in allowed:
            raise UsageError(
                f"Unknown {key[:-1]} {name!r} in report.{key} of {source}.{did_you_mean(name, allowed)} "
                f"Allowed: {', '.join(allowed)}."
            )
    return [n for n in allowed if n in value]  # fixed order, whatever order the file lists them in


def report_spec(section: dict[str, Any] | ReportSpec | None, source: str = "the report section") -> ReportSpec:
    """A validated ``ReportSpec`` from a ``report:`` mapping; ``None`` means everything."""
    if isinstance(section, ReportSpec):
        return section
    if section is None:
        return ReportSpec()
    if not isinstance(section, dict):
        raise UsageError(
            f"The report section of {source} must be a mapping with keys "
            f"{', '.join(f.name for f in fields(ReportSpec))}."
        )
    known = [f.name for f in fields(ReportSpec)]
    for key in section:
        if key not in known:
            raise UsageError(
                f"Unknown key {key!r} in the report section of {source}.{did_you_mean(key, known)} "
                f"Allowed keys: {', '.join(known)}."
            )
    for key in ("sweep", "title", "summary", "baseline", "ablation_reference", "bench"):
        if key in section and section[key] is not None and not isinstance(section[key], str):
            raise UsageError(f"report.{key} in {source} must be a string.")
    parse_claims(section, source)  # refuses a bad declaration here, naming the file
    return ReportSpec(
        sweep=section.get("sweep"),
        title=section.get("title"),
        summary=section.get("summary"),
        tables=_names(section.get("tables"), TABLES, "tables", source),
        figures=_names(section.get("figures"), FIGURES, "figures", source),
        baseline=section.get("baseline") or "preln",
        ablation_reference=section.get("ablation_reference") or "ldm-rls",
        bench=section.get("bench"),
        primary=section.get("primary"),
        secondary=section.get("secondary"),
    )


def _is_sweep(path: Path) -> bool:
    return path.is_dir() or (path.is_file() and is_archive(path))


def resolve_target(target: str | Path, root: str | Path | None = None) -> tuple[Path, ReportSpec]:
    """The sweep (a folder or an archive) and report spec named by a sweep name under the results root, a folder, a
    sweep archive, or a grid file."""
    base_dir = Path(root) if root is not None else results_root()
    path = Path(target)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        grid = read_yaml(path, "grid file") or {}
        if not isinstance(grid, dict):
            raise UsageError(f"The grid file {path} must hold a mapping.")
        spec = report_spec(grid.get("report"), str(path))
        base = grid.get("base") if isinstance(grid.get("base"), dict) else {}
        name = spec.sweep or grid.get("name") or base.get("name") or path.stem
        folder = Path(spec.sweep) if spec.sweep and _is_sweep(Path(spec.sweep)) else base_dir / str(name)
        if not _is_sweep(folder):
            raise UsageError(
                f"The grid file {path} names the sweep {name!r}, but {folder} does not exist: "
                "run the sweep first, or set report.sweep to its folder or archive."
            )
        return folder, spec
    if _is_sweep(path):
        return path, ReportSpec()
    if _is_sweep(base_dir / str(target)):
        return base_dir / str(target), ReportSpec()
    if path.is_file():
        raise UsageError(
            f"{str(target)!r} is neither a sweep archive ({', '.join(ARCHIVE_SUFFIXES)}) nor a grid file (.yaml): "
            "give a sweep folder, an archive `depthmem pack` wrote, or a grid file."
        )
    known = sorted(p.name for p in base_dir.iterdir() if p.is_dir()) if base_dir.is_dir() else []
    listing = f" Sweeps under {base_dir}/: {', '.join(known)}." if known else ""
    raise UsageError(
        f"No sweep {str(target)!r}: give a sweep name under {base_dir}/, a sweep folder, a sweep archive "
        f"(.tar.xz), or a grid file (.yaml).{listing}"
    )


def report_folder(sweep_dir: str | Path, out_dir: str | Path | None) -> Path:
    """Where the report goes: ``out_dir``, else the sweep folder; an archive is never written into."""
    if out_dir is not None:
        return Path(out_dir)
    if is_archive(sweep_dir):
        raise UsageError(
            f"The report of the sweep archive {sweep_dir} needs a folder to be written to: add --out FOLDER."
        )
    return Path(sweep_dir)


def _find_bench(sweep_dir: Path, bench: str | Path | None, notes: list[str]) -> pd.DataFrame | None:
    if bench is not None and not Path(bench).is_file():
        raise UsageError(f"The benchmark CSV {str(bench)!r} does not exist: give the file `depthmem bench` wrote.")
    if bench is None and is_archive(sweep_dir):
        return None  # an archive holds no bench.csv: one comes with --bench
    path = Path(bench) if bench is not None else sweep_dir / "bench.csv"
    if not path.is_file():
        return None
    try:
        return tabs.read_bench(path)
    except (OSError, ValueError) as e:
        if bench is not None:
            raise UsageError(f"The benchmark CSV {path} cannot be used: {e}.") from None
        notes.append(f"Skipped the benchmark CSV {path.name}: {e}.")
        return None


def _state_line(sweep: Sweep) -> str:
    counts = Counter(r.state for r in sweep.runs)
    parts = ", ".join(f"{counts[s]} {s}" for s in sorted(counts))
    n = len(sweep.finished())
    if n == len(sweep.runs):
        return f"{n} run directories ({parts}); every one enters the averages."
    counted = f"{n} finished run enters" if n == 1 else f"{n} finished runs enter"
    return (
        f"{len(sweep.runs)} run directories ({parts}); {counted} the averages, the others are listed under "
        "*Runs not counted in any average*."
    )


def _table_section(table: tabs.Table, folder: Path, out_dir: Path) -> list[str]:
    paths = tabs.write_table(table, folder)
    rel = {k: p.relative_to(out_dir).as_posix() for k, p in paths.items()}
    return [
        f"## {table.title}",
        "",
        tabs.to_markdown(table),
        "",
        *[f"{n}" for n in table.notes],
        "",
        f"LaTeX: [{rel['tex']}]({rel['tex']}) · CSV: [{rel['csv']}]({rel['csv']})",
        "",
    ]


def claims_section(ctx: report_items.Context) -> list[str]:
    """The declared families and their sizes, or nothing for a grid that declares none."""
    tests = tabs.declared(ctx)
    if tests is None:
        return []
    lines = [
        "## Claims",
        "",
        "The comparisons this grid declares, by family: Holm's procedure adjusts each p-value within its family "
        "(the size counts one test per claim and setting with a Δ); a difference outside every family is shown "
        "with its interval and no adjusted p. Downstream differences paired on items are a family of their own, "
        "their table's.",
        "",
        *tabs.family_lines(tests),
    ]
    untuned = sensitivity.untuned_claims(ctx)
    if untuned:
        lines.append(
            f"- ⚠ Not tuned, though a claim rests on them: {', '.join(untuned)}. Their Δ compares a tuned rate with "
            "a borrowed one; add them to tune.variants."
        )
    return [*lines, ""]


def _context(sweep: Sweep, spec: ReportSpec, bench_frame: pd.DataFrame | None) -> report_items.Context:
    colours = figs.palette(
        [r.variant for r in sweep.runs] + (list(bench_frame["variant"]) if bench_frame is not None else [])
    )
    return report_items.Context(
        sweep,
        baseline=spec.baseline,
        ablation_reference=spec.ablation_reference,
        bench=bench_frame,
        colours=colours,
        claims=spec.claims,
    )


def redraw_figure(
    sweep_dir: str | Path,
    name: str,
    *,
    out_dir: str | Path | None = None,
    spec: ReportSpec | dict[str, Any] | None = None,
    bench: str | Path | None = None,
) -> list[Path]:
    """Draw one figure again into ``<out_dir>/figures`` (PNG and PDF), leaving the tables and REPORT.md as they
    are: for checking a figure's layout without rewriting the whole report."""
    if name not in FIGURES:
        raise UsageError(f"Unknown figure {name!r}. Allowed: {', '.join(FIGURES)}.")
    spec = report_spec(spec)
    sweep_dir = Path(sweep_dir)
    sweep = load_sweep(sweep_dir)
    if not sweep.runs:
        raise UsageError(f"No run directories (folders with a config.json) under {sweep_dir}: nothing to draw.")
    bench_frame = _find_bench(sweep_dir, bench if bench is not None else spec.bench, [])
    try:
        fig, _ = report_items.get("figure", name).fn(_context(sweep, spec, bench_frame))
    except report_items.NoData as reason:
        raise UsageError(f"Figure {name!r} cannot be drawn from {sweep_dir}: {reason}.") from None
    figure_dir = writable_dir(report_folder(sweep_dir, out_dir), "report folder") / "figures"
    return figs.save_figure(fig, figure_dir, name)


def _table_sections(ctx, spec: ReportSpec, table_dir: Path, out_dir: Path, skipped: list[str]) -> list[str]:
    """REPORT.md's sections of the tables the spec asks for; what could not be made is added to ``skipped``."""
    lines: list[str] = []
    for item in report_items.items("table"):
        if not (item.always or item.name in spec.tables):
            continue
        try:
            table = ctx.table(item.name)
        except report_items.NoData as reason:
            if not item.always:
                skipped.append(f"- table `{item.name}`: {reason}.")
            continue
        if table.data.empty:
            skipped.append(f"- table `{item.name}`: it has no rows.")
            continue
        lines += _table_section(table, table_dir, out_dir)
    return lines


def _figure_sections(ctx, spec: ReportSpec, figure_dir: Path, out_dir: Path, skipped: list[str]) -> list[str]:
    """REPORT.md's lines of the figures the spec asks for; what could not be made is added to ``skipped``."""
    figure_lines: list[str] = []
    for item in report_items.items("figure"):
        if item.name not in spec.figures:
            continue
        try:
            fig, caption = item.fn(ctx)
        except report_items.NoData as reason:
            skipped.append(f"- figure `{item.name}`: {reason}.")
            continue
        png, pdf = (p.relative_to(out_dir).as_posix() for p in figs.save_figure(fig, figure_dir, item.name))
        figure_lines += [
            f"### {item.name.replace('_', ' ').capitalize()}",
            "",
            f"![{item.name}]({png})",
            "",
            f"{caption} PDF: [{pdf}]({pdf})",
            "",
        ]
    return figure_lines


def report(
    sweep_dir: str | Path,
    *,
    out_dir: str | Path | None = None,
    spec: ReportSpec | dict[str, Any] | None = None,
    bench: str | Path | None = None,
) -> Path:
    """Write the sweep's tables, figures and ``REPORT.md`` (into ``out_dir``, default the sweep folder; a sweep
    archive needs ``out_dir``)."""
    spec = report_spec(spec)
    sweep_dir = Path(sweep_dir)
    out_dir = report_folder(sweep_dir, out_dir)
    notes: list[str] = []
    bench_frame = _find_bench(sweep_dir, bench if bench is not None else spec.bench, notes)
    sweep = load_sweep(sweep_dir)
    if not sweep.runs:
        raise UsageError(f"No run directories (folders with a config.json) under {sweep_dir}: nothing to report.")
    out_dir = writable_dir(out_dir, "report folder")
    table_dir, figure_dir = out_dir / "tables", out_dir / "figures"
    remove_stale_temps(out_dir, table_dir, figure_dir)
    notes = sweep.notes + notes

    tidy = aggregate(sweep)
    data_paths = save_frame(tidy, out_dir / "aggregate")
    run_paths = save_frame(runs_frame(sweep), out_dir / "runs")

    title = spec.title or f"Report: {archive_stem(sweep_dir) if is_archive(sweep_dir) else sweep_dir.resolve().name}"
    lines = [
        f"# {title}",
        "",
        f"Generated by `depthmem report` from the run directories alone (nothing retrained). {_state_line(sweep)}",
        "",
        tuning_report.protocol_line(sweep_dir, tuning_report.lrs(sweep)),
        "",
    ]
    if spec.summary:
        lines[2:2] = [" ".join(spec.summary.split()), ""]

    ctx = _context(sweep, spec, bench_frame)
    lines += claims_section(ctx)
    skipped: list[str] = []
    lines += _table_sections(ctx, spec, table_dir, out_dir, skipped)
    figure_lines = _figure_sections(ctx, spec, figure_dir, out_dir, skipped)
    if figure_lines:
        lines += ["## Figures", "", *figure_lines]
    if skipped:
        lines += ["## Not produced", "", *skipped, ""]
    if notes:
        lines += ["## Notes on the inputs", "", *[f"- {n}" for n in notes], ""]
    data, runs = ([p.relative_to(out_dir).as_posix() for p in paths] for paths in (data_paths, run_paths))
    lines += [
        "## Data",
        "",
        f"The tidy table (one row per run × step × metric): [{data[0]}]({data[0]}), [{data[1]}]({data[1]}); "
        f"one row per run with its state: [{runs[0]}]({runs[0]}), [{runs[1]}]({runs[1]}). "
        "Regenerate everything with `depthmem report SWEEP`.",
        "",
    ]
    return atomic_write_text(out_dir / "REPORT.md", "\n".join(lines))
