"""The CPU thread count follows how busy the machine is (nanospec.cpu_threads), on simulated step times: a step
costs what a two-core machine measured (one thread ~2x slower when the cores are free; two threads ~10x slower
beside busy processes), and the tuner must settle on the faster count, switch when the load comes and goes, and
probe ever more rarely when nothing changes."""

import os
import threading
import time

import pytest

from nanospec.cpu_threads import MAX_INTERVAL, Contention, ThreadTuner, _schedstat_fds, _waited_ns

QUIET = {2: (0.030, 0.0), 1: (0.060, 0.0)}    # threads -> (seconds a step, seconds its threads waited for a core
BUSY = {2: (0.400, 1.3), 1: (0.070, 0.6)}      # per second)


def run(tuner: ThreadTuner, machine: dict, steps: int, tokens: int = 1) -> list[int]:
    """Thread counts the steps ran at."""
    used = []
    for _ in range(steps):
        threads = tuner.threads
        seconds, waiting = machine[threads]
        tuner.observe(threads, tokens, seconds, waiting)
        used.append(threads)
    return used


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_more_rarely():
    tuner = ThreadTuner(2)
    used = run(tuner, QUIET, 2000)
    assert tuner.current == 2
    probes = used.count(1)
    assert probes <= 12, probes  # each losing probe is one step, at doubling intervals
    assert used[-MAX_INTERVAL - 1:].count(1) <= 1
    assert tuner.interval == MAX_INTERVAL


def test_busy_from_the_start_drops_to_one_thread_within_a_few_steps():
    tuner = ThreadTuner(2)
    used = run(tuner, BUSY, 500)
    assert tuner.current == 1
    assert used.index(1) <= 3 and used[6:].count(2) == 0  # waiting for a core: never probes up


def test_load_that_comes_and_goes_is_followed():
    tuner = ThreadTuner(2)
    run(tuner, QUIET, 300)
    assert tuner.current == 2
    used = run(tuner, BUSY, 300)
    assert tuner.current == 1 and used[:4].count(1) >= 1  # two slow steps start a probe down
    used = run(tuner, QUIET, 300)
    assert tuner.current == 2 and 2 in used[:40]  # with the cores back, a probe up comes within an interval


def test_sizes_are_compared_alike():
    """A probe is judged against the current count's average for the same size: a verify of 8 tokens that costs
    more than a decode is not mistaken for a slow machine."""
    tuner = ThreadTuner(2)
    costs = {(2, 1): 0.03, (2, 8): 0.05, (1, 1): 0.06, (1, 8): 0.11}
    for step in range(1000):
        tokens = 8 if step % 3 else 1
        threads = tuner.threads
        seconds = costs[threads, tokens]
        tuner.observe(threads, tokens, seconds, 0.0)
    assert tuner.current == 2


@pytest.mark.parametrize("max_threads, counts", [(1, [1]), (2, [2, 1]), (6, [6, 4, 2, 1]), (16, [16, 8, 4, 2, 1])])
def test_counts(max_threads, counts):
    tuner = ThreadTuner(max_threads)
    assert tuner.counts == counts
    run(tuner, {c: (0.01 * max_threads / c, 0.0) for c in counts}, 200)
    assert tuner.current == max_threads


def test_without_a_waiting_signal_times_alone_decide():
    """Where the OS does not say how long threads wait (no schedstat), slow steps still lead down and probes up."""
    tuner = ThreadTuner(2)
    blind = lambda machine: {t: (seconds, None) for t, (seconds, _) in machine.items()}  # noqa: E731
    run(tuner, blind(QUIET), 300)
    assert tuner.current == 2
    run(tuner, blind(BUSY), 300)
    assert tuner.current == 1
    run(tuner, blind(QUIET), 600)
    assert tuner.current == 2


def test_contention_measures_waiting_for_a_core():
    with Contention() as c:
        sum(range(10000))
    assert c.seconds > 0 and (c.waiting is None or c.waiting >= 0)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's /proc/self/task/*/schedstat is not here")
def test_waiting_is_every_live_threads_schedstat_and_an_ended_threads_file_is_closed():
    def fresh() -> int:
        return sum(int(open(f"/proc/self/task/{t}/schedstat").read().split()[1]) for t in os.listdir("/proc/self/task"))

    ended = threading.Event()
    thread = threading.Thread(target=ended.wait)
    thread.start()
    before = fresh()
    waited = _waited_ns()
    assert before <= waited <= fresh()  # each thread's count only grows
    assert str(thread.native_id) in _schedstat_fds
    ended.set()
    thread.join()
    for _ in range(200):  # the OS drops the thread's task a moment after Python's join returns
        if str(thread.native_id) not in os.listdir("/proc/self/task"):
            break
        time.sleep(0.01)
    waited = _waited_ns()
    assert str(thread.native_id) not in _schedstat_fds and set(_schedstat_fds) == set(os.listdir("/proc/self/task"))
    assert waited <= fresh()


def test_the_engine_runs_each_step_at_the_tuners_count_and_restores_torchs(tmp_path, monkeypatch):
    import torch

    from nanospec import LLM, SamplingParams
    from tiny import make_tiny_llama

    make_tiny_llama(tmp_path, layers=1, max_pos=64)
    llm = LLM(str(tmp_path), num_blocks=16, block_size=4, device="cpu")  # the tuner is the CPU's
    tuner = llm.engine.threads
    assert tuner is not None and tuner.max_threads == torch.get_num_threads()
    observed, during = [], []
    monkeypatch.setattr(tuner, "observe", lambda threads, *rest: observed.append(threads))
    monkeypatch.setattr(type(tuner), "threads", property(lambda self: 1))
    execute = llm.engine.runner.execute

    def recorded(*args, **kwargs):
        during.append(torch.get_num_threads())
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", recorded)
    before = torch.get_num_threads()
    llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=4))
    assert torch.get_num_threads() == before
    assert during and set(during) == {1} and set(observed) == {1}
