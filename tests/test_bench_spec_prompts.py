"""bench_spec's prompt sets: the project's 16 prompts and Spec-Bench's 480 questions, read without a model."""

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_spec", ROOT / "benchmarks" / "bench_spec.py")
bench_spec = importlib.util.module_from_spec(spec)
sys.modules["bench_spec"] = bench_spec  # its dataclasses look their module up
spec.loader.exec_module(bench_spec)
load_prompts = bench_spec.load_prompts


def test_spec_bench_reads_the_first_turn_and_groups_mt_bench():
    prompts = load_prompts(ROOT / "benchmarks" / "spec_bench_questions.jsonl", None, None)
    assert Counter(c for _, c, _ in prompts) == {c: 80 for c in ("mt_bench", "translation", "summarization", "qa",
                                                                  "math_reasoning", "rag")}
    first = json.loads((ROOT / "benchmarks" / "spec_bench_questions.jsonl").read_text().splitlines()[0])
    assert prompts[0] == (0, "mt_bench", first["turns"][0])


def test_a_limit_spreads_over_each_category_in_file_order(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"category": c, "prompt": f"{c}{i}"})
                              for c, n in (("a", 10), ("b", 3)) for i in range(n)) + "\n")
    assert [t for _, _, t in load_prompts(path, None, 4)] == ["a0", "a2", "a5", "a7", "b0", "b1", "b2"]
    assert [t for _, _, t in load_prompts(path, ["b"], 1)] == ["b0"]
    assert [i for i, _, _ in load_prompts(path, None, None)] == list(range(13))
    with pytest.raises(SystemExit, match="unknown category 'c'"):
        load_prompts(path, ["c"], None)
