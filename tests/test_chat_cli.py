"""The chat CLI: piped input answers each line and exits at EOF; /stats reports speculation; input that is not
UTF-8 is replaced; Ctrl-C while loading exits 130 quietly, during an answer drops that turn and goes on; the
sampling defaults; exit statuses.

Most tests drive ``main(argv)`` in this process with a scripted stand-in for ``LLM`` (fast, and the Ctrl-C
timing is exact); the rest run ``python -m nanospec.chat`` on a tiny random model, and two use the real
embedded SmolLM2 (loaded once for the module).
"""

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

import nanospec
from nanospec import chat
from nanospec.outputs import CompletionOutput
from tiny import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tiny")
    make_tiny_llama(path, max_pos=512)
    return path


def run_chat(args, stdin: bytes, **kwargs):
    """``python -m nanospec.chat ARGS`` with STDIN piped; stdout and stderr decoded (invalid bytes replaced)."""
    result = subprocess.run([sys.executable, "-m", "nanospec.chat", *args], input=stdin, capture_output=True,
                            timeout=300, **kwargs)
    result.stdout = result.stdout.decode("utf-8", "replace")
    result.stderr = result.stderr.decode("utf-8", "replace")
    return result


# ---------------------------------------------------------------- a scripted LLM, in this process
class ScriptedTokenizer:
    """A character per token; the chat template joins the messages' contents."""

    def __init__(self, chat_template="(scripted)"):
        self.chat_template = chat_template

    def apply_chat_template(self, messages):
        return "".join(m["content"] for m in messages)

    def encode(self, text):
        return [ord(c) for c in text]


class ScriptedLLM:
    """Stands in for ``LLM``: each answer streams PIECES; ``ctrl_c`` maps a call number to how many SIGINTs
    this process sends itself after the second piece of that answer. Records what every call received."""

    PIECES = ["Paris ", "is ", "the ", "capital."]
    FINISH = "stop"  # the last piece's finish_reason

    def __init__(self, ctrl_c=None, max_model_len=1 << 20, tokenizer=None):
        self.engine = types.SimpleNamespace(max_model_len=max_model_len)
        self.tokenizer = tokenizer or ScriptedTokenizer()
        self.ctrl_c = ctrl_c or {}
        self.calls: list[tuple[list[dict], object]] = []
        self.closed: list[bool] = []  # per call: whether the stream was closed (finished or aborted)
        self.shut_down = False

    def shutdown(self):
        self.shut_down = True

    def get_tokenizer(self):
        return self.tokenizer

    def stream_chat(self, messages, params):
        self.calls.append((list(messages), params))
        self.closed.append(False)
        return self._stream(len(self.calls) - 1)

    def _stream(self, call):
        try:
            for i, piece in enumerate(self.PIECES):
                last = i == len(self.PIECES) - 1
                yield CompletionOutput(request_id=call, prompt_token_ids=[1], text="", token_ids=list(range(i + 1)),
                                       finish_reason=self.FINISH if last else None, num_steps=i + 1, delta_text=piece)
                if i == 1:
                    for _ in range(self.ctrl_c.get(call, 0)):
                        signal.raise_signal(signal.SIGINT)
        finally:
            self.closed[call] = True


@pytest.fixture
def use_llm(monkeypatch):
    """use_llm(obj): ``main`` loads obj (an LLM-like object, or an exception to raise) instead of a model."""
    def install(obj):
        def load(model=None, **kwargs):
            if isinstance(obj, BaseException):
                raise obj
            return obj
        monkeypatch.setattr(nanospec, "LLM", load)
        return obj
    return install


def main_with_stdin(monkeypatch, argv, stdin: bytes) -> int:
    """``main(argv)`` reading STDIN from a strict UTF-8 text stream, as a pipe gives it."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    return chat.main(argv)


def test_piped_input_that_is_not_utf8_is_replaced(monkeypatch, use_llm, capsys):
    llm = use_llm(ScriptedLLM())
    assert main_with_stdin(monkeypatch, [], b"caf\xe9 \xff\xfeok\n") == 0
    assert llm.calls[0][0][-1]["content"] == "caf\ufffd \ufffd\ufffdok"
    assert "Paris is the capital." in capsys.readouterr().out
    assert llm.shut_down  # the chat ends the LLM (and its tensor-parallel workers) when it ends


def test_output_the_terminal_cannot_encode_is_replaced(monkeypatch, use_llm):
    use_llm(ScriptedLLM()).PIECES = ["caf\u00e9"]
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="ascii"))
    assert main_with_stdin(monkeypatch, [], b"hi\n") == 0
    sys.stdout.flush()
    assert b"caf?" in out.getvalue()


def test_sampling_defaults_are_smollm2s_and_greedy_is_one_flag(monkeypatch, use_llm):
    llm = use_llm(ScriptedLLM())
    for argv, expected in [([], (0.2, 0.9, -1)), (["--greedy"], (0.0, 0.9, -1)),
                           (["--temperature", "0.7", "--top-p", "0.5", "--top-k", "40"], (0.7, 0.5, 40))]:
        assert main_with_stdin(monkeypatch, argv, b"hi\n") == 0
        params = llm.calls[-1][1]
        assert (params.temperature, params.top_p, params.top_k) == expected, argv
    with pytest.raises(SystemExit) as exit_info:  # one or the other
        chat.main(["--greedy", "--temperature", "0.5"])
    assert exit_info.value.code == 2


def test_ctrl_c_during_an_answer_drops_that_turn_and_the_repl_goes_on(monkeypatch, use_llm, capsys):
    llm = use_llm(ScriptedLLM(ctrl_c={1: 1}))
    handler_before = signal.getsignal(signal.SIGINT)
    assert main_with_stdin(monkeypatch, [], b"first\nsecond\nthird\n") == 0
    out = capsys.readouterr().out
    assert "Paris is the \n(interrupted: this question and the partial answer are dropped" in out
    assert out.count("Paris is the capital.") == 2  # the first and third answers are whole
    assert llm.closed == [True, True, True]  # the interrupted stream was closed, so its request aborted
    third_messages = llm.calls[2][0]
    assert [m["content"] for m in third_messages] == ["first", "Paris is the capital.", "third"]
    assert signal.getsignal(signal.SIGINT) is handler_before  # the answer's own handler is gone again


def test_second_ctrl_c_during_one_answer_quits_with_130(monkeypatch, use_llm, capsys):
    llm = use_llm(ScriptedLLM(ctrl_c={0: 2}))
    assert main_with_stdin(monkeypatch, [], b"first\nsecond\n") == 130
    assert len(llm.calls) == 1 and llm.closed == [True]
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_at_the_prompt_exits_130(monkeypatch, use_llm):
    class InterruptedStdin:
        def isatty(self):
            return False

        def readline(self):
            raise KeyboardInterrupt

    use_llm(ScriptedLLM())
    monkeypatch.setattr(sys, "stdin", InterruptedStdin())
    assert chat.main([]) == 130


def test_help_lists_the_commands_and_is_not_a_question(monkeypatch, use_llm, capsys):
    llm = use_llm(ScriptedLLM())
    assert main_with_stdin(monkeypatch, [], b"/help\nhi\n") == 0
    assert [messages for messages, _ in llm.calls] == [[{"role": "user", "content": "hi"}]]
    help_line = capsys.readouterr().out.splitlines()[0]
    assert help_line == chat.COMMANDS
    for command in ("/reset", "/stats", "/help", "/quit", "/exit"):  # every command the chat accepts
        assert command in help_line


def test_an_unknown_command_is_named_and_not_sent(monkeypatch, use_llm, capsys):
    """A single word starting with "/" is a command; any other line starting with "/" is a question."""
    llm = use_llm(ScriptedLLM())
    assert main_with_stdin(monkeypatch, [], b"/foo\n/stat\n/usr/bin is what?\n/ hi\n") == 0
    assert [messages[-1]["content"] for messages, _ in llm.calls] == ["/usr/bin is what?", "/ hi"]
    err = capsys.readouterr().err
    assert err == "unknown command /foo: /help lists the commands\nunknown command /stat: /help lists the commands\n"


def test_stats_say_one_token_and_one_step_in_the_singular():
    def out(tokens, steps):
        return CompletionOutput(request_id=0, prompt_token_ids=[1] * tokens, text="", token_ids=[7] * tokens,
                                finish_reason="stop", num_steps=steps, num_draft_tokens=1, num_accepted_tokens=1)

    stats = chat.TurnStats()
    stats.add(out(1, 1), 0.5)
    assert stats.line("stats") == ("[stats] 1 token in 0.50 s (2.0 tok/s), 1 target step, acceptance 100.0% "
                                   "(1/1 draft), tau 1.00 tokens/step; prompt 1 token, 0 from the prefix cache (0%)")
    stats.add(out(2, 2), 0.5)
    assert stats.line("stats") == ("[stats] 3 tokens in 1.00 s (3.0 tok/s), 3 target steps, acceptance 100.0% "
                                   "(2/2 drafts), tau 1.00 tokens/step; prompt 3 tokens, 0 from the prefix cache (0%)")


def test_an_answer_cut_inside_a_character_is_kept_without_it(monkeypatch, use_llm, capsys):
    """--max-tokens can end an answer inside a UTF-8 character, whose bytes decode as U+FFFD: the terminal shows it,
    the conversation keeps the text before it. An answer that ends with U+FFFD for another reason keeps it."""
    llm = use_llm(ScriptedLLM())
    llm.PIECES, llm.FINISH = ["\u65e5\u672c", "\ufffd"], "length"
    assert main_with_stdin(monkeypatch, ["--max-tokens", "3"], b"one\ntwo\n") == 0
    assert llm.calls[1][0][1] == {"role": "assistant", "content": "\u65e5\u672c"}
    assert "\u65e5\u672c\ufffd" in capsys.readouterr().out
    llm.FINISH = "stop"
    assert main_with_stdin(monkeypatch, [], b"one\ntwo\n") == 0
    assert llm.calls[3][0][1] == {"role": "assistant", "content": "\u65e5\u672c\ufffd"}


class TypedStdin:
    """A terminal's stdin: input() prompts on stdout and reads LINES, then Ctrl-D (end of input)."""

    def __init__(self, lines):
        self.lines = list(lines)

    def isatty(self):
        return True

    def readline(self):
        return self.lines.pop(0) if self.lines else ""


def test_ctrl_d_at_the_prompt_ends_the_prompt_line(monkeypatch, use_llm, capsys):
    """As in Python's REPL: the shell's prompt then starts on a line of its own."""
    use_llm(ScriptedLLM())
    monkeypatch.setattr(sys, "stdin", TypedStdin(["hi\n"]))
    assert chat.main([]) == 0
    assert capsys.readouterr().out.endswith("Paris is the capital.\n> \n")


def test_ctrl_c_while_loading_exits_130_in_process(monkeypatch, use_llm, capsys):
    use_llm(KeyboardInterrupt())
    assert main_with_stdin(monkeypatch, [], b"hi\n") == 130
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "2"], "top_p must be a number in (0, 1]"),
    (["--min-p", "-1"], "min_p must be a number in [0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--spec", "bogus"], "--spec 'bogus'"),
    (["--spec", "ngram", "-k", "0"], "must be >= 1"),
    (["--spec", "lookahead", "-k", "2"], "-k does not apply"),
    (["--spec", "mlp:"], "--spec 'mlp:'"),
    (["--spec", "eagle3:"], "--spec 'eagle3:'"),
    (["--spec", "mlp", "-k", "0"], "must be >= 1"),
    (["-k", "3"], "-k 3 needs --spec"),
    (["--quantization", "None"], "--quantization must be one of auto, int4, int4-g64, int4-g128, int8 or none "
                                 "(float weights), got 'None'"),
])
def test_bad_arguments_exit_2_with_one_line_before_loading(monkeypatch, use_llm, capsys, argv, message):
    use_llm(AssertionError("nothing is loaded for bad arguments"))
    assert main_with_stdin(monkeypatch, argv, b"hi\n") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_conversation_that_outgrows_the_context_drops_its_oldest_turns(monkeypatch, use_llm, capsys):
    """A character per token, a context of 60, answers of 21 characters and 10 kept for each: the third question
    drops the first turn, a question that alone fills the context is an error that keeps the conversation, and
    the chat goes on (and, its input piped, exits 1 at the end)."""
    llm = use_llm(ScriptedLLM(max_model_len=60))
    lines = [letter * 10 for letter in "abc"] + ["d" * 70, "e" * 10]
    assert main_with_stdin(monkeypatch, ["--max-tokens", "10"], "\n".join(lines).encode() + b"\n") == 1
    answer = {"role": "assistant", "content": "".join(ScriptedLLM.PIECES)}
    b, c, e = ({"role": "user", "content": letter * 10} for letter in "bce")
    assert [messages for messages, _ in llm.calls[2:]] == [[b, answer, c], [c, answer, e]]
    err = capsys.readouterr().err
    assert err.count("(dropped the 1 oldest turn to fit the context)\n") == 2
    assert "error: this message does not fit the context even without the earlier turns: the prompt has 70 " \
           "tokens and the context holds 60" in err and "prompt 0" not in err


def test_a_failed_turn_exits_1_when_piped_and_0_when_typed(monkeypatch, use_llm, capsys):
    """A turn the engine fails is an error line and is left out of the conversation; the chat goes on. Piped
    input (a script) then ends with status 1, even after /quit; typed input with 0."""
    class FailingLLM(ScriptedLLM):
        def _stream(self, call):
            self.closed[call] = True
            yield CompletionOutput(request_id=call, prompt_token_ids=[1], text="", token_ids=[], num_steps=1,
                                   finish_reason="error" if call == 0 else "stop", error="boom", delta_text="ok")

    llm = use_llm(FailingLLM())
    assert main_with_stdin(monkeypatch, [], b"first\nsecond\n/quit\n") == 1
    assert capsys.readouterr().err == "error: boom\n"
    assert [m["content"] for m in llm.calls[1][0]] == ["second"]  # the failed turn is not in the conversation
    monkeypatch.setattr(sys, "stdin", TypedStdin(["first\n", "second\n"]))
    assert chat.main([]) == 0


def test_a_model_without_a_chat_template_exits_2_at_start_up(monkeypatch, use_llm, capsys):
    llm = use_llm(ScriptedLLM(tokenizer=ScriptedTokenizer(chat_template=None)))
    assert main_with_stdin(monkeypatch, ["--model", "raw"], b"hi\n") == 2
    err = capsys.readouterr().err
    assert err == "error: raw has no chat template, so it cannot chat (for raw text, use LLM.generate or the " \
                  "server's /v1/completions)\n"
    assert not llm.calls and llm.shut_down


def test_max_tokens_the_context_cannot_hold_exits_2_at_start_up(monkeypatch, use_llm, capsys):
    """Room for the answer is kept by dropping old turns: an answer that alone fills the context would drop every
    turn, every time."""
    llm = use_llm(ScriptedLLM(max_model_len=60))
    assert main_with_stdin(monkeypatch, ["--max-tokens", "60"], b"hi\n") == 2
    assert capsys.readouterr().err == "error: --max-tokens 60 leaves no room for the conversation: the context " \
                                      "holds 60 tokens, prompt and answer together\n"
    assert not llm.calls and llm.shut_down


def test_spec_mlp_configs():
    assert chat.spec_config_from_arg("mlp", None) == {"method": "mlp_speculator"}
    assert chat.spec_config_from_arg("mlp", 2) == {"method": "mlp_speculator", "num_speculative_tokens": 2}
    assert chat.spec_config_from_arg("mlp:some/dir", None) == {"method": "mlp_speculator", "model": "some/dir"}
    assert chat.spec_config_from_arg("eagle3", None) == {"method": "eagle3"}
    assert chat.spec_config_from_arg("eagle3:d", 3) == {"method": "eagle3", "model": "d", "num_speculative_tokens": 3}


def test_spec_mlp_without_a_speculator_for_the_model_exits_2(tiny_path, capsys, monkeypatch):
    """A tiny random model has no shipped speculator: one line says what to pass."""
    assert main_with_stdin(monkeypatch, ["--model", str(tiny_path), "--spec", "mlp"], b"hi\n") == 2
    err = capsys.readouterr().err
    assert "error: " in err and "needs 'model'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--dtype", "float8"], ["--device", "tpu"]])
def test_bad_dtype_or_device_exit_2(monkeypatch, capsys, argv):
    assert main_with_stdin(monkeypatch, argv, b"hi\n") == 2  # the real LLM refuses these before reading weights
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err


def test_unknown_option_exits_2():
    with pytest.raises(SystemExit) as exit_info:
        chat.main(["--no-such-option"])
    assert exit_info.value.code == 2


def test_help_documents_exit_statuses_interrupts_and_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        chat.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    epilog = out[out.index("exit status:"):]
    for code in ("0 ", "2 ", "130 "):
        assert f"\n  {code}" in epilog
    assert "dropped from the" in out and "temperature 0.2 and top-p 0.9" in out
    for section in ("Exit status:", "dropped from the", "temperature 0.2 and top-p 0.9"):
        assert section in chat.__doc__


def test_an_empty_system_prompt_is_the_templates_default_and_help_says_so(monkeypatch, use_llm, capsys):
    llm = use_llm(ScriptedLLM())
    assert main_with_stdin(monkeypatch, ["--system", ""], b"hi\n") == 0
    assert llm.calls[0][0] == [{"role": "user", "content": "hi"}]  # no system message: the template adds its own
    capsys.readouterr()
    with pytest.raises(SystemExit):
        chat.main(["--help"])
    assert 'left out or --system "": the chat template\'s default, if it has one' in \
        " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------- the program, on a tiny random model
def test_piped_lines_are_answered_and_stats_shown(tiny_path):
    result = run_chat(["--model", str(tiny_path), "--max-tokens", "8", "--spec", "ngram"],
                      b"hello there\n/stats\nsecond question\n/reset\n")
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stdout and "target steps" in result.stdout
    assert "(conversation cleared)" in result.stdout
    assert f"loading {tiny_path} ...\n" in result.stderr


def test_runs_without_a_seed_sample_afresh_and_a_seed_repeats(tiny_path, monkeypatch, capsys):
    """As llama.cpp's CLI (seed -1) and vLLM's SamplingParams(seed=None): no --seed, a new draw each run."""
    def answer(*seed):
        argv = ["--model", str(tiny_path), "--device", "cpu", "--temperature", "5", "--top-p", "1",
                "--max-tokens", "12", "-q", *seed]
        assert main_with_stdin(monkeypatch, argv, b"hello there\n") == 0
        return capsys.readouterr().out

    assert answer() != answer()
    assert answer("--seed", "3") == answer("--seed", "3")


def test_stats_show_how_much_of_the_last_prompt_came_from_the_prefix_cache(tiny_path):
    """The second turn's prompt starts with the first turn's: with the cache on, its full blocks (16 tokens each)
    are not computed again; with --no-enable-prefix-caching, all of it is."""
    turns = b"hello there\nsecond question\n/stats\n"
    cached = []
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        result = run_chat(["--model", str(tiny_path), "--max-tokens", "8", "--greedy", flag], turns)
        assert result.returncode == 0, result.stderr
        found = re.search(r"^\[last turn\].*prompt (\d+) tokens, (\d+) from the prefix cache", result.stdout, re.M)
        assert found, result.stdout
        cached.append((int(found.group(1)), int(found.group(2))))
    (prompt, on), (same_prompt, off) = cached
    assert prompt == same_prompt and 16 <= on < prompt and off == 0


def test_piped_bytes_that_are_not_utf8_are_not_fatal(tiny_path):
    result = run_chat(["--model", str(tiny_path), "--max-tokens", "4"], b"caf\xe9\n\xff\xfe\x80\n")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


def test_typed_bytes_that_are_not_utf8_are_not_fatal(tiny_path):
    """stdin and stdout on a terminal (a pty), so input() reads the line as typed."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "nanospec.chat", "--model", str(tiny_path), "--max-tokens", "4"],
                            stdin=terminal, stdout=terminal, stderr=subprocess.PIPE)
    os.close(terminal)
    screen, typed = b"", False
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if select.select([controller], [], [], 0.2)[0]:
                try:
                    screen += os.read(controller, 4096)
                except OSError:  # the program ended and closed the terminal
                    break
            if not typed and b"Ctrl-C stops an answer." in screen:  # the banner; input() prompts on stderr
                os.write(controller, b"caf\xe9 \xff\n/quit\n")
                typed = True
            if proc.poll() is not None and not select.select([controller], [], [], 0)[0]:
                break
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
        os.close(controller)
    assert typed and b"Traceback" not in proc.stderr.read()


def test_bad_model_path_is_a_clear_error(tmp_path):
    result = run_chat(["--model", str(tmp_path / "missing")], b"hi\n")
    assert result.returncode == 2
    assert "error:" in result.stderr and "missing" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- the real SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    return nanospec.LLM(dtype="float32", device="cpu")


def test_default_sampling_gives_sensible_text(monkeypatch, use_llm, smollm2, capsys):
    use_llm(smollm2)
    assert main_with_stdin(monkeypatch, ["--max-tokens", "12", "--seed", "0"],
                           b"What is the capital of France?\n") == 0
    assert "Paris" in capsys.readouterr().out


def test_sigint_while_loading_exits_130_without_a_traceback():
    """The real program and model: SIGINT once "nanospec: loading ..." is printed, while the weights are read."""
    proc = subprocess.Popen([sys.executable, "-m", "nanospec.chat"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    before = ""
    for line in proc.stderr:
        before += line
        if line.startswith("nanospec: loading "):
            break
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert before.endswith("nanospec: loading SmolLM2-135M-Instruct.Q4_1.gguf (embedded) ...\n"), before + stderr
    assert proc.returncode == 130, stderr
    assert "Traceback" not in before + stderr and stdout == ""


def test_tensor_parallel_answers_as_one_process(tiny_path):
    """``-tp 2``: the model split over this process and a spawned worker answers what one process answers
    (greedy); a size the model's heads do not split into is one error line."""
    args = ["--model", str(tiny_path), "--device", "cpu", "--greedy", "--max-tokens", "6"]  # one GPU is not two
    runs = [(args, b"hello there\n"), ([*args, "--tensor-parallel-size", "2"], b"hello there\n"),
            ([*args, "-tp", "3"], b"")]
    with ThreadPoolExecutor(len(runs)) as pool:  # greedy, no speculation: nothing is timed, side by side is fine
        one, two, bad = pool.map(lambda run: run_chat(*run), runs)
    assert one.returncode == two.returncode == 0, (one.stderr, two.stderr)
    assert one.stdout.strip() and two.stdout == one.stdout
    assert bad.returncode == 2 and "tensor_parallel_size=3" in bad.stderr.strip().splitlines()[-1]


def test_a_reader_that_goes_away_ends_the_chat_quietly(tiny_path, tmp_path):
    """``python -m nanospec.chat ... | head -c 1``: once head has gone, the chat stops with status 141 (128 +
    SIGPIPE) and no traceback."""
    stderr = tmp_path / "stderr"
    script = (f"printf 'one\\ntwo\\nthree\\nfour\\n' | {sys.executable} -m nanospec.chat --model {tiny_path} "
              f"--max-tokens 200 --greedy 2> {stderr} | head -c 1 > /dev/null; echo ${{PIPESTATUS[1]}}")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "141", (result.stdout, stderr.read_text())
    assert "Traceback" not in stderr.read_text()


def test_an_answer_that_cannot_be_written_is_one_error_line(tiny_path):
    """stdout on /dev/full (a full disk): one error line and status 1, no traceback."""
    with open("/dev/full", "wb") as full:
        result = subprocess.run([sys.executable, "-m", "nanospec.chat", "--model", str(tiny_path), "--max-tokens",
                                 "4", "--quiet"], input=b"hi\n", stdout=full, stderr=subprocess.PIPE, timeout=300)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert err.startswith("error: cannot write the answer: ") and "No space left" in err and err.count("\n") == 1


def test_a_closed_stdout_is_one_error_line(tiny_path):
    """``python -m nanospec.chat >&-``: status 1 and one error line, before the model loads."""
    result = subprocess.run(["bash", "-c", f"{sys.executable} -m nanospec.chat --model {tiny_path} --quiet >&-"],
                            input="hi\n", stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert result.stderr == "error: cannot write the answer: stdout is closed\n"


def test_a_closed_stdin_is_no_input(tiny_path):
    """``python -m nanospec.chat <&-``: nothing to answer, status 0, no traceback."""
    result = subprocess.run(["bash", "-c", f"{sys.executable} -m nanospec.chat --model {tiny_path} --quiet <&-"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr
