"""Numbers as a reader wants them in a table: durations, counts with SI prefixes, shares as percentages.

Plain Python only: the status command formats its table with these, and it must not load torch or pandas.
"""

from __future__ import annotations

import math


def duration(seconds: float | None) -> str:
    """``1:02:03`` or ``2:03``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def si(n: float, unit: str = "") -> str:
    """``800256`` as ``800.3k``, ``1.2e9`` as ``1.20G``: three significant digits, an SI prefix; small counts
    as they are."""
    if n is None or not math.isfinite(n):
        return "?"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.3g}{prefix}{unit}" if value < 100 else f"{value:,.0f}{prefix}{unit}"
    return f"{n:g}{(' ' + unit) if unit else ''}" if n != int(n) else f"{int(n)}{(' ' + unit) if unit else ''}"


def percent(fraction: float) -> str:
    """``0.044506`` as ``4.45%``; shares under 0.01% keep two significant digits (``0.0031%``)."""
    if fraction is None or not math.isfinite(fraction):
        return "?"
    value = 100 * fraction
    if value == 0:
        return "0%"
    if abs(value) < 0.01:
        digits = 1 - math.floor(math.log10(abs(value)))
        return f"{value:.{digits}f}%"
    return f"{value:.3g}%" if abs(value) < 100 else f"{value:,.0f}%"


def tokens(n: float) -> str:
    """A token count in millions at every scale (``0.26M``, ``1,024M``), so a column of them lines up."""
    m = n / 1e6
    if m == 0:
        return "0M"
    if m < 0.01:
        return f"{m:.2g}M"
    if m < 100:
        return f"{m:.3g}M"
    return f"{m:,.0f}M"


def gpu_time(hours: float) -> str:
    """GPU time in minutes below ten hours (``0.27 GPU-min``), in hours above."""
    minutes = hours * 60
    if minutes < 600:
        return f"{minutes:.2g} GPU-min" if minutes < 10 else f"{minutes:,.0f} GPU-min"
    return f"{hours:,.0f} GPU-h"


__all__ = ["duration", "si", "percent", "tokens", "gpu_time"]
