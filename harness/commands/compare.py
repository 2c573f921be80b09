"""``depthmem compare SWEEP_A SWEEP_B``: the final validation loss and downstream accuracy of two sweeps, paired by
variant, grid values and seed, with ``B - A`` and its interval."""

from __future__ import annotations

import json
import math

from harness.commands import add_results_option
from harness.errors import UsageError


def add_parser(sub):
    p = sub.add_parser(
        "compare",
        help="compare two sweeps run by run: B - A per variant and grid value, paired by seed",
        description="Pair the runs of two sweeps (a base change, a code change, two clusters) that have the same "
        "variant, grid values and seed, and print per variant and grid value the final validation loss in A and "
        "in B, the difference B - A with its 95%% paired interval, the number of seed pairs and the Holm-adjusted "
        "p-value; then downstream accuracy per task where both sweeps have eval/table.csv. Rows only one sweep "
        "has are listed as such. Each SWEEP is a sweep name under the results root, a sweep folder, a sweep "
        "archive from `depthmem pack`, or a grid file.",
    )
    p.add_argument("sweep_a", metavar="SWEEP_A", help="the reference sweep: a name under results/, folder or archive")
    p.add_argument("sweep_b", metavar="SWEEP_B", help="the sweep compared with it (the difference is B - A)")
    add_results_option(p)
    p.add_argument("--json", action="store_true", help="print the rows as JSON (numbers typed, null for none)")
    p.add_argument("--out", metavar="FILE.csv", help="also write the rows to this CSV file")
    return p


def run(args) -> int:
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.io import atomic_write_text
    from harness.reporting.compare import compare_sweeps, to_markdown
    from harness.reporting.report import resolve_target

    if args.out is not None and not args.out.endswith(".csv"):
        raise UsageError(f"--out takes a file name ending in .csv, got {args.out!r}.")
    a, _ = resolve_target(args.sweep_a, args.results)
    b, _ = resolve_target(args.sweep_b, args.results)
    frame = compare_sweeps(a, b)
    if args.out is not None:
        atomic_write_text(args.out, frame.to_csv(index=False))
    if args.json:
        rows = [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict("records")]
        print(json.dumps(rows, indent=2))
    else:
        print(to_markdown(frame, str(a), str(b)))
    return 0


def _plain(value):
    """A JSON value: NaN becomes null, numpy scalars plain numbers."""
    if hasattr(value, "item"):
        value = value.item()
    return None if isinstance(value, float) and math.isnan(value) else value
