"""Chat with a model in the terminal: ``python -m nanospec.chat``.

Streams tokens as they are accepted. Commands: ``/reset`` (forget the conversation), ``/stats``
(tokens/s, steps, speculation acceptance and tau of the last turn and the session), ``/quit``.
When stdin is not a terminal each input line is one user turn and the program exits at EOF:
``echo "What is the capital of France?" | python -m nanospec.chat``.
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nanospec.chat", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own)")
    p.add_argument("--spec", default=None,
                   help="speculative decoding: 'ngram', 'draft:PATH' (a small Llama with the same vocabulary), "
                        "'lookahead'")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA default) / float16")
    p.add_argument("--device", default=None)
    p.add_argument("--stats", action="store_true", help="print stats after every answer")
    return p.parse_args(argv)


def spec_config_from_arg(spec: str | None, k: int | None) -> dict | None:
    if spec is None:
        return None
    if k is not None and k < 1:
        raise SystemExit(f"-k {k}: the number of speculative tokens must be >= 1")
    if spec == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 5 if k is None else k}
    elif spec.startswith("draft:"):
        config = {"method": "draft", "model": spec[len("draft:"):], "num_speculative_tokens": 4 if k is None else k}
    elif spec == "lookahead":
        if k is not None:
            raise SystemExit("-k does not apply to --spec lookahead (its window sizes set how much it guesses)")
        config = {"method": "lookahead"}
    else:
        raise SystemExit(f"--spec {spec!r}: use 'ngram', 'draft:PATH' or 'lookahead'")
    return config


class TurnStats:
    """Tokens/s, target steps, acceptance and tau (tokens per target step after the prefill)."""

    def __init__(self):
        self.tokens = self.steps = self.draft = self.accepted = self.decode_tokens = self.decode_steps = 0
        self.seconds = 0.0

    def add(self, out, seconds: float):
        self.tokens += len(out.token_ids)
        self.steps += out.num_steps
        self.decode_tokens += max(len(out.token_ids) - 1, 0)  # the prefill step emits the first token
        self.decode_steps += max(out.num_steps - 1, 0)
        self.draft += out.num_draft_tokens
        self.accepted += out.num_accepted_tokens
        self.seconds += seconds

    def line(self, label: str) -> str:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        text = f"[{label}] {self.tokens} tokens in {self.seconds:.2f} s ({tps:.1f} tok/s), {self.steps} target steps"
        if self.draft:
            tau = self.decode_tokens / self.decode_steps if self.decode_steps else 1.0
            text += (f", acceptance {self.accepted / self.draft:.1%} ({self.accepted}/{self.draft} drafts), "
                     f"tau {tau:.2f} tokens/step")
        return text


def main(argv=None) -> int:
    args = parse_args(argv)
    from nanospec import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype, device=args.device,
                  speculative_config=spec_config_from_arg(args.spec, args.num_speculative_tokens))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    session, last = TurnStats(), TurnStats()
    if interactive:
        print("nanospec chat: /reset clears the conversation, /stats shows speed, /quit exits.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if line == "/stats":
            print(last.line("last turn"))
            print(session.line("session"))
            continue
        history.append({"role": "user", "content": line})
        start = time.perf_counter()
        answer, out = "", None
        try:
            for out in llm.stream_chat(system + history, params):
                answer += out.delta_text
                print(out.delta_text, end="", flush=True)
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e}", file=sys.stderr)
            history.pop()
            continue
        except KeyboardInterrupt:
            print("\n(interrupted)")
        print()
        history.append({"role": "assistant", "content": answer})
        if out is not None:
            last = TurnStats()
            last.add(out, time.perf_counter() - start)
            session.add(out, time.perf_counter() - start)
            if args.stats:
                print(last.line("stats"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
