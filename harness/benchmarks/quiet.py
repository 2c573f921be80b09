"""Whether other work shared the CPU while a measurement ran.

The load average cannot say: it counts the measurement's own threads, and it decays over minutes, so right after
one measurement it still holds that measurement when the next one starts. Instead the machine's busy CPU time
(``/proc/stat``) is compared with this process's own (all its threads and waited-for children, ``os.times``):
the difference is what everything else used, in cores, averaged over the span. Reference numbers come only from
spans where that stayed below ``OTHERS_LIMIT``.
"""

from __future__ import annotations

import os
import time

# Other work may keep at most this many cores busy, on average, during a measurement called quiet. Daemons, the
# shell and the profiler's own bookkeeping stay well below it; one competing process pinned to a core is 1.0.
OTHERS_LIMIT = 0.25


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot, or None where ``/proc/stat`` is missing."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user and nice)
    ticks = [int(x) for x in fields[1:9]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    return busy / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds used by this process (every thread) and its finished children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """``with OtherLoad() as load: ...`` sets ``load.others``: the mean number of cores kept busy by other
    processes while the block ran (None where the machine's counters cannot be read)."""

    def __init__(self):
        self.others: float | None = None

    def __enter__(self):
        self._start = (time.monotonic(), machine_busy_seconds(), own_seconds())
        return self

    def __exit__(self, *exc):
        wall0, machine0, own0 = self._start
        wall, machine = time.monotonic() - wall0, machine_busy_seconds()
        if machine0 is None or machine is None or wall <= 0:
            return False
        # Counters tick at 100 Hz; a short span can come out slightly negative.
        self.others = round(max(0.0, (machine - machine0 - (own_seconds() - own0)) / wall), 3)
        return False


def others_now(seconds: float = 1.0) -> float | None:
    """Cores other processes keep busy right now: ``OtherLoad`` over ``seconds`` of this process sleeping."""
    with OtherLoad() as load:
        time.sleep(seconds)
    return load.others


def is_busy(*others: float | None) -> bool:
    """Whether any of the measured spans had other work above ``OTHERS_LIMIT`` (unknown spans do not count)."""
    return any(o is not None and o > OTHERS_LIMIT for o in others)


__all__ = ["OTHERS_LIMIT", "OtherLoad", "others_now", "is_busy", "machine_busy_seconds", "own_seconds"]


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, for the record (empty where the platform has none); whether a run
    was quiet is judged by ``others_now`` and ``OtherLoad``, since the load average counts the run's own threads."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
