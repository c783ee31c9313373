"""Chat with a model in the terminal: python -m nanospec.chat

Streams tokens as they are accepted. Commands: /reset (forget the conversation), /stats (tokens/s,
steps, speculation acceptance and tau of the last turn and the session, and how much of the last prompt came from
the prefix cache: a turn computes only what the conversation added), /quit or /exit, /help (lists them). Another single
word starting with "/" (/foo) is an unknown command, named on stderr and not sent to the model.
When stdin is not a terminal each input line is one user turn and the program exits at EOF:
  echo "What is the capital of France?" | python -m nanospec.chat

Sampling defaults to temperature 0.2 and top-p 0.9, the settings SmolLM2's model card suggests;
--greedy always takes the likeliest token. Without --seed every run samples afresh; --seed N repeats a run's
answers. Input is read as UTF-8: bytes that are not valid UTF-8, piped or typed, become U+FFFD. While the model
loads, a line per phase goes to stderr (--quiet: none).

Ctrl-C during an answer stops it as soon as the engine step in flight has produced its tokens (a step
is never cut half-way) and returns to the prompt; that unfinished turn, the question and the partial
answer, is dropped from the conversation. A second Ctrl-C before the answer stops quits. An answer that
--max-tokens cuts inside a character shows U+FFFD for it; the conversation keeps the text before it.

Exit status:
  0    normal end: end of input (EOF, Ctrl-D) or /quit
  1    the answer cannot be written to stdout (e.g. a full disk, or stdout closed; one line on stderr says why), or,
       with stdin not a terminal, a message could not be answered (an error line each; later lines are still answered)
  2    bad arguments, or a model that cannot be loaded (one line on stderr says why)
  130  Ctrl-C while the model loads, at the prompt, or twice during one answer
  141  the reader of stdout went away (e.g. piped into head): the chat stops quietly, as a shell filter does
"""

from __future__ import annotations

import argparse
import io
import os
import random
import re
import signal
import sys
import time

from nanospec.model.embedded import EMBEDDED_SAMPLING

# the banner's and /help's line: every command repl() accepts
COMMANDS = "/reset clears the conversation, /stats shows speed, /help lists the commands, /quit or /exit exits"
# 141: 128 + SIGPIPE, as a shell reports it
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 130, 141


def parse_args(argv=None):
    intro, _, exit_status = __doc__.partition("Exit status:\n")
    p = argparse.ArgumentParser(prog="python -m nanospec.chat", description=intro,
                                epilog="exit status:\n" + exit_status,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    temperature = p.add_mutually_exclusive_group()
    temperature.add_argument("--temperature", type=float, default=EMBEDDED_SAMPLING["temperature"],
                             help=f"default {EMBEDDED_SAMPLING['temperature']}; 0 = greedy")
    temperature.add_argument("--greedy", action="store_true", help="always take the likeliest token (temperature 0)")
    p.add_argument("--top-p", type=float, default=EMBEDDED_SAMPLING["top_p"],
                   help=f"nucleus mass in (0, 1] (default {EMBEDDED_SAMPLING['top_p']})")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens (default -1: all)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep the tokens at least this share as likely as the likeliest, in [0, 1] (default 0: off)")
    p.add_argument("--max-tokens", type=int, default=256, help="the longest answer, in tokens (default 256)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed every answer's sampling, for answers a rerun repeats (default: a fresh seed each run)")
    p.add_argument("--system", default=None,
                   help="system prompt; left out or --system \"\": the chat template's default, if it has one "
                        "(SmolLM2's: \"You are a helpful AI assistant named SmolLM, trained by Hugging Face\")")
    p.add_argument("--spec", default=None,
                   help="speculative decoding: 'ngram', 'draft:PATH' (a small Llama with the same vocabulary), "
                        "'lookahead', 'mlp' / 'eagle3' (the MLP speculator / EAGLE-3 head shipped for the embedded "
                        "model) or 'mlp:DIR' / 'eagle3:DIR' (one for this model)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA default) / float16")
    p.add_argument("--quantization", default="auto",
                   help="weights: auto (the default: a GGUF's 4-bit blocks kept, a Hugging Face checkpoint as "
                        "stored), int4 (groups of 32), int4-g64, int4-g128, int8 (per channel), or none (float)")
    p.add_argument("--device", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many processes (default 1)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the conversation's K/V between turns, so a turn computes only what is new (default on)")
    p.add_argument("--stats", action="store_true", help="print stats after every answer")
    p.add_argument("--quiet", "-q", action="store_true", help="no start-up lines on stderr (errors still show)")
    args = p.parse_args(argv)
    if args.greedy:
        args.temperature = 0.0
    return args


SHIPPED = {"mlp": "mlp_speculator", "eagle3": "eagle3"}  # --spec NAME[:DIR]: the method (no DIR: the shipped one)


def spec_config_from_arg(spec: str | None, k: int | None) -> dict | None:
    """The speculative_config for --spec and -k; ValueError (one line) for a bad combination."""
    if spec is None:
        if k is not None:
            raise ValueError(f"-k {k} needs --spec (the number of tokens a speculative method guesses per step)")
        return None
    if k is not None and k < 1:
        raise ValueError(f"-k {k}: the number of speculative tokens must be >= 1")
    if spec == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 5 if k is None else k}
    elif spec.startswith("draft:"):
        config = {"method": "draft", "model": spec[len("draft:"):], "num_speculative_tokens": 4 if k is None else k}
    elif spec == "lookahead":
        if k is not None:
            raise ValueError("-k does not apply to --spec lookahead (its window sizes set how much it guesses)")
        config = {"method": "lookahead"}
    elif (name := spec.partition(":")[0]) in SHIPPED and spec != f"{name}:":
        config = {"method": SHIPPED[name]}  # k: the directory's own unless -k says otherwise
        if spec != name:
            config["model"] = spec[len(name) + 1:]
        if k is not None:
            config["num_speculative_tokens"] = k
    else:
        raise ValueError(f"--spec {spec!r}: use 'ngram', 'draft:PATH', 'lookahead', 'mlp', 'mlp:PATH', 'eagle3' or "
                         f"'eagle3:DIR'")
    return config


def replace_undecodable_input() -> None:
    """Decode stdin as UTF-8 with invalid bytes replaced by U+FFFD, and let stdout replace what its encoding
    cannot write. input() decodes a typed terminal line with stdin's encoding and errors too, so this covers
    piped and typed input alike. Streams that are not plain text files (or were already read) are left alone."""
    settings = {"stdin": {"encoding": "utf-8", "errors": "replace"}, "stdout": {"errors": "replace"}}
    for name, changes in settings.items():
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper):
            try:
                stream.reconfigure(**changes)
            except io.UnsupportedOperation:
                pass


def load(args):
    """(LLM, SamplingParams) from the arguments. Checks the sampling and speculation arguments first, then loads
    (nanospec logs a line per phase to stderr). ValueError / OSError: bad arguments, an unloadable model, one
    without a chat template, or a --max-tokens that fills its context."""
    from nanospec import LLM, SamplingParams
    from nanospec.device import fix_malloc_mmap_threshold
    from nanospec.log import set_level
    from nanospec.model.quantization import quantization_from_cli

    fix_malloc_mmap_threshold()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)
    spec_config = spec_config_from_arg(args.spec, args.num_speculative_tokens)
    quantization = quantization_from_cli(args.quantization)
    if args.quiet:
        set_level("warning")
    engine_seed = random.SystemRandom().getrandbits(63)  # draws the seed of each unseeded answer
    llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config=spec_config, seed=engine_seed,
              tensor_parallel_size=args.tensor_parallel_size,
              quantization=quantization,
              enable_prefix_caching=args.enable_prefix_caching,
              max_num_seqs=1)  # one conversation: the KV pool holds one context
    if llm.get_tokenizer().chat_template is None:
        llm.shutdown()
        raise ValueError(f"{args.model} has no chat template, so it cannot chat (for raw text, use LLM.generate "
                         "or the server's /v1/completions)")
    if params.max_tokens >= llm.engine.max_model_len:  # the room kept for the answer would drop every turn
        llm.shutdown()
        raise ValueError(f"--max-tokens {params.max_tokens} leaves no room for the conversation: the context holds "
                         f"{llm.engine.max_model_len} tokens, prompt and answer together")
    return llm, params


def plural(n: int, word: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


class TurnStats:
    """Tokens/s, target steps, acceptance and tau (tokens per target step after the prefill), and the prompt tokens
    the prefix cache held."""

    def __init__(self):
        self.tokens = self.steps = self.draft = self.accepted = self.decode_tokens = self.decode_steps = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.seconds = 0.0

    def add(self, out, seconds: float):
        self.prompt_tokens += len(out.prompt_token_ids)
        self.cached_tokens += out.num_cached_tokens
        self.tokens += len(out.token_ids)
        self.steps += out.num_steps
        self.decode_tokens += max(len(out.token_ids) - 1, 0)  # the prefill step emits the first token
        self.decode_steps += max(out.num_steps - 1, 0)
        self.draft += out.num_draft_tokens
        self.accepted += out.num_accepted_tokens
        self.seconds += seconds

    def line(self, label: str) -> str:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        text = (f"[{label}] {plural(self.tokens, 'token')} in {self.seconds:.2f} s ({tps:.1f} tok/s), "
                f"{plural(self.steps, 'target step')}")
        if self.draft:
            tau = self.decode_tokens / self.decode_steps if self.decode_steps else 1.0
            text += (f", acceptance {self.accepted / self.draft:.1%} ({self.accepted}/{plural(self.draft, 'draft')}), "
                     f"tau {tau:.2f} tokens/step")
        if self.prompt_tokens:
            text += (f"; prompt {plural(self.prompt_tokens, 'token')}, {self.cached_tokens} from the prefix cache "
                     f"({self.cached_tokens / self.prompt_tokens:.0%})")
        return text


class CtrlC:
    """While active, the first SIGINT only sets ``pressed`` (the answer stops between engine steps, so the
    engine is never left half-way through one); a second raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.pressed = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: signals are not ours to handle
            pass
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def stream_answer(llm, messages, params):
    """Print the answer as it streams; returns (text, last CompletionOutput or None, interrupted)."""
    text, out = "", None
    with CtrlC() as ctrl_c:
        stream = llm.stream_chat(messages, params)
        try:
            for out in stream:
                text += out.delta_text
                print(out.delta_text, end="", flush=True)
                if ctrl_c.pressed:
                    break
        finally:
            stream.close()  # aborts the request if it is not finished
    return text, out, ctrl_c.pressed and not (out is not None and out.finished)


def fit_to_context(llm, system: list[dict], history: list[dict], turn: dict, max_tokens: int) -> int:
    """How many of the oldest turns (a question and its answer) ``history`` must lose for ``system + history +
    [turn]`` to leave ``max_tokens`` for the answer in the context: all of them if even that is not enough (the
    answer is then cut at the context's end). ValueError if the system prompt and ``turn`` alone fill the context."""
    tokenizer, context = llm.get_tokenizer(), llm.engine.max_model_len
    for dropped in range(len(history) // 2 + 1):
        prompt = tokenizer.encode(tokenizer.apply_chat_template(system + history[2 * dropped:] + [turn]))
        if len(prompt) + max_tokens <= context:
            return dropped
    if len(prompt) >= context:
        raise ValueError(f"this message does not fit the context even without the earlier turns: the prompt has "
                         f"{len(prompt)} tokens and the context holds {context} (prompt + at least one answer token)")
    return len(history) // 2


def repl(llm, params, args) -> int:
    """Answer turns until EOF or /quit; returns EXIT_ERROR if stdin is not a terminal and a turn failed, else
    EXIT_OK. KeyboardInterrupt at the prompt (or a second Ctrl-C during an answer) propagates to the caller. A
    closed stdin (``<&-``) is no input: it ends at once, as at EOF."""
    if sys.stdin is None:
        return EXIT_OK
    interactive = sys.stdin.isatty()
    failed = False  # a turn ended in an error line
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    session, last = TurnStats(), TurnStats()
    if interactive:
        print(f"nanospec chat: {COMMANDS}; Ctrl-C stops an answer.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:  # Ctrl-D: the shell's prompt starts on a line of its own
            if interactive:
                print()
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/help":
            print(COMMANDS)
            continue
        if line == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if line == "/stats":
            print(last.line("last turn"))
            print(session.line("session"))
            continue
        if re.fullmatch(r"/[a-zA-Z]+", line):  # a single /word is a command; other lines starting with / are text
            print(f"unknown command {line}: /help lists the commands", file=sys.stderr)
            continue
        turn = {"role": "user", "content": line}
        start = time.perf_counter()
        try:
            dropped = fit_to_context(llm, system, history, turn, params.max_tokens)
            if dropped:
                del history[:2 * dropped]
                print(f"(dropped the {plural(dropped, 'oldest turn')} to fit the context)",
                      file=sys.stderr)
            answer, out, interrupted = stream_answer(llm, system + history + [turn], params)
        except ValueError as e:  # e.g. this input alone does not fit the context; the template refuses it
            print(f"\nerror: {e}", file=sys.stderr)
            failed = True
            continue
        print()
        if out is not None and out.finish_reason == "error":  # the engine failed this turn: it is dropped
            print(f"error: {out.error}", file=sys.stderr)
            failed = True
        elif interrupted:
            print("(interrupted: this question and the partial answer are dropped from the conversation)")
        else:
            if out is not None and out.finish_reason == "length":  # cut inside a character: its bytes decode as U+FFFD
                answer = answer.rstrip("\ufffd")
            history += [turn, {"role": "assistant", "content": answer}]
        if out is not None:
            last = TurnStats()
            last.add(out, time.perf_counter() - start)
            session.add(out, time.perf_counter() - start)
            if args.stats:
                print(last.line("stats"))
    return EXIT_ERROR if failed and not interactive else EXIT_OK


def main(argv=None) -> int:
    """Run the chat; returns the exit status (see the module docstring). Argument syntax errors exit 2
    through argparse."""
    args = parse_args(argv)
    if sys.stdout is None:  # started with stdout closed (>&-): no answer can be written
        print("error: cannot write the answer: stdout is closed", file=sys.stderr)
        return EXIT_ERROR
    replace_undecodable_input()
    try:
        try:
            llm, params = load(args)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        try:
            status = repl(llm, params, args)
        finally:
            llm.shutdown()  # the tensor-parallel workers, if any
    except KeyboardInterrupt:
        if sys.stderr.isatty():
            print(file=sys.stderr)  # the shell prompt starts on a line of its own
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout's reader is gone: point stdout at /dev/null so that flushing it at exit raises nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as e:  # stdout cannot be written (e.g. a full disk): one line, and nothing more at exit
        print(f"error: cannot write the answer: {e}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    return status


if __name__ == "__main__":
    sys.exit(main())
