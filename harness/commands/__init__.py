"""Subcommands of ``depthmem``: each module has ``add_parser(subparsers)`` and ``run(args)``."""
