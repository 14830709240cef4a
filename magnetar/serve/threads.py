"""The decode steps' intra-op threads on a CPU rank alone on its host: every usable CPU while the host's other
processes leave them idle, one fewer while they keep some of them busy (docs/serving.md, "CPU threads").

Why: a decode step is hundreds of small parallel regions, each waiting for its slowest thread. With as many threads
as CPUs, a CPU taken by another process stalls every region (a busy 2-core host decoded 2.3x slower than with one
thread fewer); with one CPU left free, an idle host wastes it (SmolLM2 in bf16 on a 2-core Intel VM: 69 against
39 ms/token, docs/results.md, "Decode threads that follow the host's load"). vLLM's CPU server leaves one core to
its scheduler always. Here the rank measures what the others use: the busy time of its usable CPUs in
``/proc/stat`` less its own process's CPU time (``os.times``: every thread of it -- the HTTP server's included),
over at least :data:`PERIOD_S` of wall time, read between two decode steps.

:class:`DecodeThreads` is pure but for its ``read`` and ``clock`` (tests pass their own).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

PERIOD_S = 1.0  # the shortest window the others' CPU use is measured over
BUSY_CPUS = 0.5  # the others keep at least this many CPUs busy (in CPU-seconds per second): one thread fewer
IDLE_CPUS = 0.25  # ... and at most this many: every CPU again (between the two, the count stays: no flapping)
# /proc/stat's per-CPU fields after the name: user nice system idle iowait irq softirq steal (guest time is in user)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def busy_seconds(stat_text: str, cpus: set[int], tick_hz: float) -> Optional[float]:
    """The busy seconds of ``cpus`` in ``/proc/stat``'s text (user, nice, system, irq, softirq and steal: a CPU a
    hypervisor gave another guest is taken too), or None when a CPU of them has no line."""
    total, seen = 0, set()
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        values = [int(x) for x in fields]
        total += sum(values[i] for i in _BUSY_FIELDS if i < len(values))
        seen.add(int(name[3:]))
    return total / tick_hz if seen == cpus else None


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class DecodeThreads:
    """The decode steps' thread count: ``high`` (every usable CPU) while the other processes on ``cpus`` use at most
    :data:`IDLE_CPUS` of them, ``low`` (one fewer) once they use :data:`BUSY_CPUS` or more; ``low`` until the first
    window is measured, and for good when ``/proc/stat`` cannot be read. :meth:`current` is called before each
    decode step and measures at most once per ``period_s``."""

    def __init__(self, high: int, low: int, cpus: set[int], *, period_s: float = PERIOD_S,
                 read: Optional[Callable[[], str]] = None, own: Optional[Callable[[], float]] = None,
                 clock: Optional[Callable[[], float]] = None):
        if not 1 <= low < high:
            raise ValueError(f"DecodeThreads: low ({low}) must be at least 1 and less than high ({high})")
        self.high, self.low, self.cpus, self.period_s = high, low, set(cpus), period_s
        self._read, self._own, self._clock = read or _read_stat, own or _own_seconds, clock or time.monotonic
        self._tick_hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self.threads = low
        self.others: Optional[float] = None  # the other processes' CPUs, last window
        self.broken: Optional[str] = None  # why the load cannot be read (the count stays low)
        self._last = self._sample()

    def _sample(self) -> Optional[tuple[float, float, float]]:
        """(wall, busy CPU seconds of ``cpus``, this process's CPU seconds) now, or None (``broken`` says why)."""
        try:
            busy = busy_seconds(self._read(), self.cpus, self._tick_hz)
        except (OSError, ValueError) as e:
            busy, self.broken = None, f"/proc/stat unreadable ({type(e).__name__}: {e})"
        if busy is None:
            self.broken = self.broken or f"/proc/stat has no line for some of CPUs {sorted(self.cpus)}"
            return None
        return self._clock(), busy, self._own()

    def current(self) -> int:
        """The thread count for the next decode step (a window over: measured and decided first)."""
        if self._last is None or self._clock() - self._last[0] < self.period_s:
            return self.threads
        now = self._sample()
        if now is None:  # for good: the count no longer follows a load it cannot read
            self.threads, self._last = self.low, None
            return self.threads
        wall = now[0] - self._last[0]
        self.others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        before = self.threads
        if self.others >= BUSY_CPUS:
            self.threads = self.low
        elif self.others <= IDLE_CPUS:
            self.threads = self.high
        if self.threads != before:
            log.info("decode threads %d -> %d: other processes used %.2f of %d CPUs over the last %.1f s", before,
                     self.threads, self.others, len(self.cpus), wall)
        return self.threads


def decode_threads(threads: Optional[int], local_ranks: int, on_cpu: bool) -> Optional[DecodeThreads]:
    """The adaptive count for a server's decode steps, or None where the count stays fixed: ``--threads`` or
    ``OMP_NUM_THREADS`` given (the user chose), a GPU rank, several ranks on the host (each others' load), one
    usable CPU, or no ``/proc/stat`` (not Linux: the fixed rule, one CPU left)."""
    from magnetar.parallel.launcher import usable_cpus

    if threads is not None or os.environ.get("OMP_NUM_THREADS") or not on_cpu or local_ranks != 1:
        return None
    try:
        cpus = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    n = usable_cpus()
    if n < 2 or len(cpus) != n:
        return None
    policy = DecodeThreads(n, n - 1, cpus)
    if policy.broken is not None:
        log.info("decode threads stay at %d: %s", n - 1, policy.broken)
        return None
    return policy
