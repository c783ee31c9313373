"""How many CPU threads an engine step uses, learned online from the steps' own times.

Every barrier of a step's parallel regions waits for its slowest thread, so beside busy processes fewer threads can
be much faster. Steps run at the ``current`` count; each step's time is averaged per (threads, size), the size its
token count rounded up to a power of two, with how long the threads waited for a core (:class:`Contention`).
Every ``interval`` steps a probe runs up to ``PROBE_STEPS`` steps at the next power of two down or up and is adopted
when its median is below ``SWITCH_BELOW`` of the current count's average; the interval doubles after each losing
probe (up to ``MAX_INTERVAL``). Steps that wait more than ``BUSY_WAIT`` or take ``SLOW_FACTOR`` times their average
start a probe down at once; a probe up is skipped while threads wait more than ``IDLE_WAIT``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

PROBE_STEPS = 3
FIRST_INTERVAL = 32  # steps between two scheduled probes, doubled after each that loses
FIRST_WAIT_GAP = 2  # steps at least between two probes started by waiting, doubled after each that loses
MAX_INTERVAL = 256
SWITCH_BELOW = 0.8
SLOW_FACTOR = 2.0
BUSY_WAIT, IDLE_WAIT = 0.25, 0.1  # seconds the threads waited for a core, per second
EMA_WEIGHT = 0.3  # of the newest step in a moving average


class ThreadTuner:
    def __init__(self, max_threads: int | None = None):
        self.max_threads = max_threads or torch.get_num_threads()
        self.counts = sorted({self.max_threads, *(1 << i for i in range(self.max_threads.bit_length())
                                                  if 1 << i < self.max_threads)}, reverse=True)
        self.current = self.max_threads
        self.average: dict[tuple[int, int], float] = {}  # (threads, size) -> seconds a step
        self.waiting = 0.0  # seconds the threads waited for a core per second, at the current count (average)
        self.interval, self.wait_gap = FIRST_INTERVAL, FIRST_WAIT_GAP
        self.since_probe = 0
        self.slow_streak = self.wait_streak = 0  # steps in a row that were slow / waited for cores
        self.probe_threads: int | None = None
        self.probe_cause = ""  # "scheduled", "slow" or "wait"
        self.probe_ratios: list[float] = []
        self._probe_down_next = True

    @property
    def threads(self) -> int:
        """The count the next step runs with."""
        return self.probe_threads if self.probe_threads is not None else self.current

    def observe(self, threads: int, num_tokens: int, seconds: float, waiting: float | None) -> None:
        """A step over ``num_tokens`` tokens at ``threads`` threads took ``seconds``, its threads waiting for a core
        ``waiting`` seconds per second (None: not known)."""
        if seconds <= 0:
            return
        size = max(num_tokens, 1).bit_length()
        reference = self.average.get((self.current, size))
        old = self.average.get((threads, size))
        self.average[threads, size] = seconds if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * seconds
        if threads == self.probe_threads:
            if reference is None:  # nothing to compare with: tried again later
                self._end_probe()
                return
            self.probe_ratios.append(seconds / reference)
            if len(self.probe_ratios) == PROBE_STEPS or self.probe_ratios[-1] > 1 / SWITCH_BELOW:
                self._end_probe()
            return
        if threads != self.current:
            return
        if waiting is not None:
            self.waiting = (1 - EMA_WEIGHT) * self.waiting + EMA_WEIGHT * waiting
        slow = reference is not None and seconds > SLOW_FACTOR * reference
        self.slow_streak = self.slow_streak + 1 if slow else 0
        self.wait_streak = self.wait_streak + 1 if waiting is not None and waiting > BUSY_WAIT else 0
        self.since_probe += 1
        can_go_down = self.current > self.counts[-1]
        if can_go_down and self.slow_streak >= 2:
            self._start_probe(down=True, cause="slow")
        elif can_go_down and self.wait_streak >= 2 and self.since_probe >= self.wait_gap:
            self._start_probe(down=True, cause="wait")
        elif self.since_probe >= self.interval:
            self._scheduled_probe()

    def _scheduled_probe(self) -> None:
        """Down and up in turn; up only while the threads hardly wait for a core."""
        can_down = self.current > self.counts[-1]
        can_up = self.current < self.max_threads and self.waiting <= IDLE_WAIT
        if can_down and can_up:
            down, self._probe_down_next = self._probe_down_next, not self._probe_down_next
            self._start_probe(down, "scheduled")
        elif can_down or can_up:
            self._start_probe(can_down, "scheduled")
        else:
            self.since_probe = 0

    def _start_probe(self, down: bool, cause: str) -> None:
        i = self.counts.index(self.current)
        self.probe_threads = self.counts[i + 1] if down else self.counts[i - 1]
        self.probe_cause, self.probe_ratios = cause, []
        self.slow_streak = self.wait_streak = 0

    def _end_probe(self) -> None:
        if self.probe_ratios and statistics.median(self.probe_ratios) < SWITCH_BELOW:
            self.current, self.waiting = self.probe_threads, 0.0
            self.interval, self.wait_gap = FIRST_INTERVAL, FIRST_WAIT_GAP
        elif self.probe_ratios and self.probe_cause == "scheduled":
            self.interval = min(2 * self.interval, MAX_INTERVAL)
        elif self.probe_ratios and self.probe_cause == "wait":
            self.wait_gap = min(2 * self.wait_gap, MAX_INTERVAL)
        self.since_probe = 0
        self.probe_threads = None


_schedstat_fds: dict[str, int] = {}  # thread id -> its open /proc/self/task/<id>/schedstat (read, not opened, a step)


def _waited_ns() -> int | None:
    """Nanoseconds this process's threads waited for a core (Linux ``schedstat``), or None."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
        for gone in _schedstat_fds.keys() - set(tasks):
            os.close(_schedstat_fds.pop(gone))
        for task in tasks:
            if task not in _schedstat_fds:
                _schedstat_fds[task] = os.open(f"/proc/self/task/{task}/schedstat", os.O_RDONLY)
            total += int(os.pread(_schedstat_fds[task], 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total


class Contention:
    """``with Contention() as c:``: ``c.seconds`` of wall time and ``c.waiting``, the seconds per second the process's
    threads waited for a core (None where the OS does not say)."""

    def __enter__(self) -> Contention:
        self._waited, self._wall = _waited_ns(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._wall
        waited = _waited_ns()
        self.waiting = None if waited is None or self._waited is None or self.seconds <= 0 else \
            (waited - self._waited) / 1e9 / self.seconds
