"""Errors a researcher can act on.

The command line turns these into one plain sentence and an exit code; anything else is a bug and keeps its
traceback (or shows it with ``--debug``).
"""


class DepthmemError(Exception):
    """A problem with the user's input or environment, stated in one sentence."""

    exit_code = 1


class UsageError(DepthmemError):
    """A bad name, value, config key, grid or command-line argument (exit code 2)."""

    exit_code = 2


class RunFailed(DepthmemError):
    """A run that started but could not finish (diverged, killed, out of memory)."""

    exit_code = 1
