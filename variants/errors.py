"""Errors a researcher can act on, raised by the mixers and the harness alike.

The command line turns these into one plain sentence and an exit code; anything else is a bug and keeps its
traceback (or shows it with ``--debug``). ``harness.errors`` re-exports them beside the errors of runs.
"""


class DepthmemError(Exception):
    """A problem with the user's input or environment, stated in one sentence."""

    exit_code = 1


class UsageError(DepthmemError):
    """A bad name, value, config key, grid or command-line argument (exit code 2)."""

    exit_code = 2


def did_you_mean(word: str, options) -> str:
    """`` Did you mean 'x'?`` for the closest of ``options``, or an empty string when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" Did you mean {close[0]!r}?" if close else ""
