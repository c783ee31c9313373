"""The real embedded SmolLM2-135M-Instruct against transformers (the independent oracle), fp32 on CPU.

Also speculative decoding on real chat prompts: greedy output with n-gram and with a layer-truncated
SmolLM2 draft equals plain greedy token for token, in fp32 on the test device (plain on that device too: same
device, backend and dtype, so exactly).

The comparisons with transformers run explicitly on the CPU: it is the oracle there, in fp32, and the record of
what these prompts give.
"""

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.model.forward_batch import build_forward_batch
from nanospec.model.embedded import embedded_model_path
from tiny import assert_no_leak

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Summarize in one sentence: The city library will close for renovation from March until June. "
    "Books can be returned at the drop box beside the main entrance.",
    "List three fruits that are red.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning, my friend' into French.",
    "Rewrite this list in alphabetical order: pears, apples, bananas, cherries.",
    "What is 17 times 3? Answer with the number only.",
    "Give me a haiku about the sea.",
    "Replace the variable name tmp with buffer: def f(tmp): return tmp + 1",
    "Why is the sky blue?",
]
NEW_TOKENS = 48
SPECULATED = slice(0, None, 3)  # the questions the speculation tests batch: four, two of them copying ones


@pytest.fixture(scope="module")
def gguf():
    return embedded_model_path()


@pytest.fixture(scope="module")
def llm():
    # float weights, explicitly on the CPU: compared with transformers' float32 on the CPU
    return LLM(dtype="float32", device="cpu", quantization=None)


def chat_ids(llm, question):
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": question}]))


@pytest.fixture(scope="module")
def prompts(llm):
    return [chat_ids(llm, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain_outputs(llm, prompts):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))


@pytest.fixture(scope="module")
def plain_on_device(device, prompts):
    """Plain greedy outputs of the model as served by default (its 4-bit weights kept, fp32 activations) on the test
    device, for speculation there to equal."""
    return LLM(dtype="float32", device=device).generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))


def test_served_model_keeps_the_files_4bit_weights_and_answers(plain_on_device):
    llm = LLM(dtype="float32", device="cpu", num_blocks=64)
    assert llm.model.quantization == "int4-g32 (120), int8 (1)"  # Q4_1 layers, the Q8_0 embedding as the head
    assert "Paris" in plain_on_device[0].outputs[0].text


def test_logits_match_transformers(llm, transformers_smollm2, prompts):
    ids = prompts[2]
    table: list[int] = []
    bm = llm.engine.block_manager
    bm.reserve(table, len(ids))
    batch = build_forward_batch([ids], [0], [table], bm.block_size, [list(range(len(ids)))], "cpu")
    ours = llm.model.compute_logits(llm.model.forward(batch, llm.engine.kv_cache))
    bm.free(table)
    with torch.no_grad():
        ref = transformers_smollm2(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_chat_matches_transformers(llm, transformers_smollm2, prompts, plain_outputs):
    """transformers' greedy decoding of each prompt gives our tokens: its argmax after the prompt and each prefix of
    our answer is our next token (so, by induction, its greedy path is our answer), and it stops where we do: at an
    eos, or after NEW_TOKENS. One transformers forward over prompt + answer per prompt."""
    assert len(prompts) >= 10
    eos = llm.tokenizer.eos_token_ids
    for ids, out in zip(prompts, plain_outputs):
        tokens = out.outputs[0].token_ids
        assert tokens and not any(t in eos for t in tokens[:-1])
        assert len(tokens) == NEW_TOKENS or tokens[-1] in eos
        with torch.no_grad():
            logits = transformers_smollm2(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == tokens, f"prompt {llm.tokenizer.decode(ids)!r}"
    assert "Paris" in plain_outputs[0].outputs[0].text


def test_batch_matches_alone(llm, prompts, plain_outputs):
    for ids, out in zip(prompts[:3], plain_outputs[:3]):
        alone = llm.generate([ids], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_ngram_greedy_equals_plain_on_real_prompts(prompts, plain_on_device, device):
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                  "adaptive": False}, dtype="float32", device=device)
    outs = llm.generate(prompts[SPECULATED], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for out, plain in zip(outs, plain_on_device[SPECULATED]):
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0
    plain_steps = sum(o.outputs[0].num_steps for o in plain_on_device[SPECULATED])
    assert sum(o.outputs[0].num_steps for o in outs) < plain_steps
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def draft_dir(gguf, tmp_path_factory):
    from nanospec.convert import convert

    return convert(gguf, tmp_path_factory.mktemp("draft"), num_layers=6)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_truncated_draft_greedy_equals_plain_on_real_prompts(draft_dir, prompts, plain_on_device, tree, device):
    # adaptive off: every step verifies, whatever this machine's cost curve says
    config = {"method": "draft", "model": str(draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    if tree:
        config.update(tree_top_k=2, tree_budget=8)
    llm = LLM(speculative_config=config, dtype="float32", device=device)
    outs = llm.generate(prompts[SPECULATED], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for out, plain in zip(outs, plain_on_device[SPECULATED]):
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert llm.stats()["num_accepted_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 5, "max_candidates": 3},
    {"method": "lookahead", "window_size": 5, "ngram_size": 4, "guess_set_size": 5, "adaptive": False},
], ids=["ngram_tree", "lookahead"])
def test_tree_methods_greedy_equal_plain_on_real_prompts(prompts, plain_on_device, config, device):
    llm = LLM(speculative_config=config, dtype="float32", device=device)
    outs = llm.generate(prompts[SPECULATED], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for out, plain in zip(outs, plain_on_device[SPECULATED]):
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert llm.stats()["num_accepted_tokens"] > 0
    assert_no_leak(llm)
