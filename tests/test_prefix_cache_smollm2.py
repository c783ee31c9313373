"""Prefix caching on the real embedded SmolLM2 as it loads by default (4-bit weights, the CPU's bfloat16 matmul
inputs): outputs with the cache equal outputs without, bit for bit, down to each token's logprob.

A cached token's K/V was computed in an earlier request (in its prefill, or by a decode step); the same token's K/V
without the cache is computed in one prefill of the whole prompt. They are equal because every row of a forward
attends alone (:class:`nanospec.kernels.cpu_attention.PagedAttentionPlan`) and the matmul kernels are row-wise
(a row's output does not depend on the rows beside it). Comparing logprobs exactly catches a difference in the
last bit, which a near tie turns into a different token only now and then. The engines run on the CPU wherever the
tests run: on CUDA, cuBLAS and the Triton matmuls round a row differently with the number of rows in its call, so
this bit-for-bit contract is the CPU's.
"""

import pytest

from nanospec import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?",
             "Write a haiku about both.", "Now one about the sea."]
SYSTEM = ("You are a helpful assistant for a travel agency. Answer briefly and precisely; when you do not know, "
          "say so. Prices are in euros, distances in kilometres, and dates are written day, month, year.")
GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=11, logprobs=0)


@pytest.fixture(scope="module")
def engines():
    return {on: LLM(enable_prefix_caching=on, max_num_seqs=8, device="cpu") for on in (True, False)}


def answers(outputs):
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for out in outputs for o in out.outputs]


def test_a_conversation_with_the_cache_equals_without(engines):
    """Each turn's prompt is the conversation so far (the cache-off answers): with the cache on, all but its new
    turn comes from the cache, computed by the previous turn's prefill and decode steps."""
    messages = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        on, off = (answers(engines[c].chat(messages, GREEDY)) for c in (True, False))
        assert on == off, f"turn {len(messages) // 2}"
        messages.append({"role": "assistant", "content": engines[False].tokenizer.decode(off[0][0])})
    assert engines[True].stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_batch_sharing_a_conversation_with_the_cache_equals_without(engines, params):
    """A batch of follow-ups to one answered question, and of other questions under the same system prompt: with
    the cache on they share the blocks the answered request left, its answer's computed by decode steps."""
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    engines[True].reset_prefix_cache()
    answer = engines[True].chat(first, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    conversations = [first + [{"role": "assistant", "content": answer}, {"role": "user", "content": q}]
                     for q in QUESTIONS[1:]]
    conversations += [first[:1] + [{"role": "user", "content": q}] for q in QUESTIONS[1:3]]
    on, off = (answers(engines[c].chat(conversations, params)) for c in (True, False))
    assert on == off
