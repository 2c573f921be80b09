"""Subcommands of ``depthmem``: each module has ``add_parser(subparsers)`` and ``run(args)``."""


def add_results_option(p) -> None:
    """``--results DIR`` (or ``--results-dir``), the folder holding sweeps by name, as ``args.results``: the same
    option, wording and default on every command that finds a sweep by its name."""
    p.add_argument(
        "--results",
        "--results-dir",
        dest="results",
        metavar="DIR",
        help="folder holding sweeps by name (default: $DEPTHMEM_RESULTS, else ./results)",
    )
