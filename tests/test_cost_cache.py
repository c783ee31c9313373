"""The goodput policy's forward costs are timed once per model, weights, device, thread count and forward shape and
read back after (nanospec.speculative.cost_cache); a busy machine is timed at one thread and its costs are not kept."""

import json

import pytest
import torch

from nanospec import LLM
from nanospec.speculative import cost_cache, speculator
from tiny import make_tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


class FakeContention:
    """Contention reporting the given waiting for every block it measures."""
    waiting_of_next: list[float] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.seconds, self.waiting = 1.0, FakeContention.waiting_of_next.pop(0)



@pytest.fixture(autouse=True)
def free_machine(monkeypatch):
    """The machine reports no waiting for a core (the suite may share a busy one: its own test is below)."""
    monkeypatch.setattr(cost_cache, "Contention", FakeContention)
    FakeContention.waiting_of_next = [0.0] * 100


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cost_cache_target")
    make_tiny_llama(path, seed=3, layers=2, max_pos=128)
    return str(path)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def timings(monkeypatch):
    """Counts the target's timing runs (the speculator's calls of time_forwards)."""
    calls = []
    real = speculator.time_forwards

    def counted(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(speculator, "time_forwards", counted)
    return calls


def entries(cache_dir):
    return json.loads((cache_dir / cost_cache.FILE_NAME).read_text())["entries"]


def test_costs_are_measured_once_then_read(model_path, cache_dir, timings):
    first = LLM(model_path, num_blocks=64, block_size=4, speculative_config=NGRAM)
    assert len(timings) == 1  # the measurement
    assert len(entries(cache_dir)) == 1
    timings.clear()
    second = LLM(model_path, num_blocks=64, block_size=4, speculative_config=NGRAM)
    assert timings == []
    assert second.engine.speculator.policy.points == first.engine.speculator.policy.points


def test_a_change_of_threads_or_dtype_is_measured_anew_and_of_k_only_its_new_shapes(model_path, cache_dir, timings):
    LLM(model_path, dtype="float32", num_blocks=64, block_size=4, speculative_config=NGRAM)  # k = 3: 4 tokens a row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        LLM(model_path, dtype="float32", num_blocks=64, block_size=4, speculative_config=NGRAM)
    finally:
        torch.set_num_threads(threads)
    timings.clear()
    LLM(model_path, dtype="float32", num_blocks=64, block_size=4,
        speculative_config={**NGRAM, "num_speculative_tokens": 2})  # k = 2: rows of 3 in its batches
    (timed,) = timings
    assert timed and all(n > 1 and t == 3 for n, t in timed)  # one row of 1..3 tokens was timed for k = 3
    LLM(model_path, dtype="bfloat16", num_blocks=64, block_size=4, speculative_config=NGRAM)
    stored = list(entries(cache_dir).values())
    assert len(stored) == 3 - (threads == 1)
    assert {e["key"]["weights"]["dtype"] for e in stored} == {"torch.float32", "torch.bfloat16"}
    assert all(e["key"]["device"].startswith("cpu") or e["key"]["device"].startswith("cuda") for e in stored)
    (both_ks,) = [e["costs"] for e in stored if e["key"]["weights"]["dtype"] == "torch.float32"
                  and e["key"]["threads"] == threads]
    assert {"1x1", "1x4", "2x4", "2x3"} <= set(both_ks)


def test_a_file_that_cannot_be_read_is_ignored_and_rewritten(model_path, cache_dir, timings):
    (cache_dir / cost_cache.FILE_NAME).write_text("{not json")
    LLM(model_path, num_blocks=64, block_size=4, speculative_config=NGRAM)
    assert len(entries(cache_dir)) == 1
    data = json.loads((cache_dir / cost_cache.FILE_NAME).read_text())
    (entry,) = data["entries"].values()
    entry["costs"] = {name: -1.0 for name in entry["costs"]}  # not a cost: measured again
    (cache_dir / cost_cache.FILE_NAME).write_text(json.dumps(data))
    timings.clear()
    LLM(model_path, num_blocks=64, block_size=4, speculative_config=NGRAM)
    assert len(timings) == 1
    (entry,) = entries(cache_dir).values()
    assert entry["costs"] and all(c > 0 for c in entry["costs"].values())


def test_an_empty_cache_dir_turns_the_cache_off(model_path, monkeypatch, timings, tmp_path):
    monkeypatch.setenv("NANOSPEC_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    LLM(model_path, num_blocks=64, block_size=4, speculative_config=NGRAM)
    LLM(model_path, num_blocks=64, block_size=4, speculative_config=NGRAM)
    assert len(timings) == 2 and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the one-thread fallback is for CPU timings")
def test_a_busy_machine_is_timed_at_one_thread_and_not_kept(cache_dir, capsys):
    threads_seen, probes_seen, threads = [], [], torch.get_num_threads()

    def key():
        return {"threads": torch.get_num_threads(), "counts": [1, 2]}

    def measure(shapes):
        threads_seen.append(torch.get_num_threads())
        return [0.01 * t for _, t in shapes]

    def probe():
        probes_seen.append(torch.get_num_threads())

    cpu = torch.device("cpu")
    shapes = [(1, 1), (1, 2)]
    torch.set_num_threads(2)
    try:
        FakeContention.waiting_of_next = [1.3, 0.6]  # the probe, then the measurement: waiting for cores
        costs, measured = cost_cache.cached_forward_costs(key, shapes, measure, probe, cpu)
        assert torch.get_num_threads() == 2
        assert measured and costs == [0.01, 0.02] and probes_seen == [2] and threads_seen == [1]
        assert not (cache_dir / cost_cache.FILE_NAME).exists()
        assert "busy" in capsys.readouterr().err
        FakeContention.waiting_of_next = [0.0, 0.0]  # a free machine: measured at its threads and kept
        costs, measured = cost_cache.cached_forward_costs(key, shapes, measure, probe, cpu)
        assert threads_seen[-1] == 2 and len(entries(cache_dir)) == 1
        assert cost_cache.cached_forward_costs(key, shapes, measure, probe, cpu) == (costs, False)
    finally:
        torch.set_num_threads(threads)
