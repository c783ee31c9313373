"""The GPU micro-benchmarks (benchmarks/kernels/bench_*.py) on a machine without a CUDA GPU: each exits with
status 2 and one line on stderr saying so, rather than a traceback or a silent success; and the CPU step profile
runs."""

import subprocess
import sys

import pytest
import torch

from checkout import ROOT, checkout_env

SCRIPTS = sorted((ROOT / "benchmarks" / "kernels").glob("bench_*.py"))


def test_the_benchmarks_are_found():
    assert len(SCRIPTS) >= 4, SCRIPTS


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present, so the benchmarks would run for real")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_benchmark_without_a_gpu_exits_2_with_one_line(script):
    env = checkout_env()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                            cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"{script.stem}: needs a CUDA GPU; none is available here")
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_profile_step_runs():
    """The step profile the README's figures cite runs (embedded model, a few steps, after a 40-token prompt)."""
    result = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--steps", "2", "--context", "40"],
                            capture_output=True, text=True, timeout=300, env=checkout_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ms a decode step" in result.stdout and "attention" in result.stdout, result.stdout
