"""The chat CLI on a tiny model: piped input answers each line and exits at EOF; /stats reports speculation."""

import subprocess
import sys

import pytest

from tiny import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tiny")
    make_tiny_llama(path, max_pos=512)
    return path


def run_chat(args, stdin):
    return subprocess.run([sys.executable, "-m", "nanospec.chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_piped_lines_are_answered_and_stats_shown(tiny_path):
    result = run_chat(["--model", str(tiny_path), "--max-tokens", "8", "--spec", "ngram"],
                      "hello there\n/stats\nsecond question\n/reset\n")
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stdout and "target steps" in result.stdout
    assert "(conversation cleared)" in result.stdout


def test_bad_model_path_is_a_clear_error(tmp_path):
    result = run_chat(["--model", str(tmp_path / "missing")], "hi\n")
    assert result.returncode == 2
    assert "error:" in result.stderr and "missing" in result.stderr
    assert "Traceback" not in result.stderr
