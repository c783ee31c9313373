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


HELP_EACH = """
import contextlib, io, runpy, sys
for script in sys.argv[1:]:
    sys.argv, out = [script, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        code = "ran"
    except SystemExit as exit:
        code = exit.code
    print(repr((script, code, out.getvalue()[:6])))
"""


def test_example_help_prints_usage_and_runs_nothing():
    """Every example with --help prints its usage and exits 0 before any work (one process for all of them)."""
    scripts = sorted(str(path) for path in (ROOT / "examples").glob("*.py"))
    result = subprocess.run([sys.executable, "-c", HELP_EACH, *scripts], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=checkout_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == [repr((script, 0, "usage:")) for script in scripts], result.stdout
    assert "nanospec: loading" not in result.stderr
