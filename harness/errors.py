"""Errors a researcher can act on.

The command line turns these into one plain sentence and an exit code; anything else is a bug and keeps its
traceback (or shows it with ``--debug``). The base classes live in ``variants.errors``, so the mixers raise the
same errors without importing the harness.
"""

from variants.errors import DepthmemError, UsageError, did_you_mean


class RunFailed(DepthmemError):
    """A run that started but could not finish (diverged, killed, out of memory)."""

    exit_code = 1


class RunStopped(RunFailed):
    """A run that a signal stopped (Ctrl-C, a cancel, a preemption) after saving where it was: the same command
    resumes it."""


__all__ = ["DepthmemError", "UsageError", "RunFailed", "RunStopped", "did_you_mean"]
