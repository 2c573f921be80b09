"""``depthmem report SWEEP``: the tables, figures and REPORT.md of a sweep, from its run directories alone (a folder, or
the archive ``depthmem pack`` wrote)."""

from __future__ import annotations

import json

from harness.commands import add_results_option


def add_parser(sub):
    p = sub.add_parser(
        "report",
        help="write a sweep's tables, figures and REPORT.md from its results",
        description="Turn a sweep's run directories into Markdown/LaTeX tables, seaborn figures and "
        "REPORT.md, deterministically and without retraining. SWEEP is a sweep name "
        "under results/, a sweep folder, a sweep archive from `depthmem pack` (with --out), or a grid file "
        "whose report: section says what to produce.",
    )
    p.add_argument(
        "sweep", metavar="SWEEP", help="sweep name under results/, a sweep folder, a .tar.xz archive, or a grid .yaml"
    )
    p.add_argument(
        "--out", metavar="DIR", help="where to write the report (default: the sweep folder; needed for an archive)"
    )
    p.add_argument("--bench", metavar="CSV", help="benchmark CSV from `depthmem bench` (default: SWEEP/bench.csv)")
    add_results_option(p)
    p.add_argument(
        "--figure",
        metavar="NAME",
        help="draw only this figure again (PNG and PDF under OUT/figures), leaving tables and REPORT.md as they are",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be read and written, then exit")
    return p


def run(args) -> int:
    from dataclasses import asdict

    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.reporting.report import redraw_figure, report, report_folder, resolve_target

    sweep_dir, spec = resolve_target(args.sweep, args.results)
    if args.dry_run:
        plan = {
            "sweep_dir": str(sweep_dir),
            "out_dir": str(report_folder(sweep_dir, args.out)),
            "bench": args.bench,
            "spec": asdict(spec),
        }
        print(json.dumps(plan, indent=2))
        return 0
    if args.figure:
        for path in redraw_figure(sweep_dir, args.figure, out_dir=args.out, spec=spec, bench=args.bench):
            print(path)
        return 0
    path = report(sweep_dir, out_dir=args.out, spec=spec, bench=args.bench)
    print(path)
    return 0
