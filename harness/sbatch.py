"""Text that goes into a job's sbatch script.

submitit writes each setting as a ``#SBATCH --key=value`` line and each setup entry as a shell line, without
quoting, so a newline in a partition name (``"debug\ntouch x"``) would add a line of its own to the job: every such
string must be one line of printable text.
"""

from __future__ import annotations

import unicodedata
from typing import Any


def bad_characters(text: str) -> list[str]:
    """The control characters (newlines, tabs, escapes, NUL, ...) in ``text``, as ``repr`` shows them."""
    return sorted({repr(c)[1:-1] for c in str(text) if unicodedata.category(c) in ("Cc", "Zl", "Zp")})


def check_line(text: Any, what: str) -> None:
    """A ``ValueError`` naming ``what`` when ``text`` holds a control character."""
    bad = bad_characters(str(text))
    if bad:
        raise ValueError(
            f"{what} must be one line of printable text, as it goes into the job's sbatch script, "
            f"but {str(text)!r} holds {', '.join(bad)}"
        )


def check_values(value: Any, what: str) -> None:
    """``check_line`` on every string in ``value`` (nested lists and mappings, keys included)."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_line(key, what)
            check_values(item, f"{what}.{key}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_values(item, what)
    elif isinstance(value, str):
        check_line(value, what)
