"""The teaching scripts in examples/ run to the end (the quick ones; 04 and 08 are run by their own tests or by
hand: 04 decodes 16 prompts, 08 starts processes, tests/test_tensor_parallel.py runs it)."""

import subprocess
import sys

import pytest

from checkout import ROOT, checkout_env


@pytest.mark.parametrize("script", ["03_rejection_step.py", "05_tree_mask.py",
                                    pytest.param("06_lookahead.py", marks=pytest.mark.slow)])
def test_example_runs(script):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=checkout_env())
    assert result.returncode == 0, result.stderr[-2000:]
    if script == "06_lookahead.py":
        assert "identical to plain greedy decoding: True" in result.stdout


@pytest.mark.parametrize("script", sorted(path.name for path in (ROOT / "examples").glob("*.py")))
def test_example_help_prints_usage_and_runs_nothing(script):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--help"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env=checkout_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: ") and "nanospec: loading" not in result.stderr
