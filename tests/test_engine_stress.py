"""A seeded random workload through the engine, as a release check: prompts of random lengths (some sharing long
prefixes, some longer than a chunk, some repetitive), greedy and seeded sampling with penalties, ``min_tokens``, stop
tokens and strings, logprobs, requests added while others run and aborted mid-run, in a pool small enough that
requests wait and are preempted, with and without speculation.

Invariants: each request that ends by itself has the tokens it gets alone on a plain engine (greedy, and seeded: a
seeded request does not depend on its batch mates or on speculation); its finish reason and token count agree with
``max_tokens`` and its stops; once every request has ended, every KV block is back in the pool (no reference held,
cached blocks evictable) and no request is left queued.
"""

import random

import pytest

from nanospec import LLM, SamplingParams
from tiny import assert_no_leak, make_tiny_llama

FP32 = dict(dtype="float32")
VOCAB = 320
EOS = 2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_stress")
    make_tiny_llama(path, seed=1, tie=True, layers=2, max_pos=256)
    return path


@pytest.fixture(scope="module")
def plain(tiny_path, device):
    return LLM(str(tiny_path), num_blocks=256, block_size=4, device=device, **FP32)


def random_params(rng: random.Random) -> SamplingParams:
    kw = dict(max_tokens=rng.randint(1, 24))
    if rng.random() < 0.5:
        kw.update(temperature=0.0)
    else:
        kw.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(10**6), top_p=rng.choice([1.0, 0.9]),
                  top_k=rng.choice([-1, 20]))
    if rng.random() < 0.3:
        kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [rng.randrange(3, VOCAB) for _ in range(4)]
    if rng.random() < 0.2:
        kw["stop"] = [chr(rng.randrange(97, 123))]
    if rng.random() < 0.3:
        kw["logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.2:
        kw["ignore_eos"] = True
    return SamplingParams(**kw)


def random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    bases = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(12, 40))] for _ in range(2)]
    prompts = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:  # a shared prefix (the prefix cache), maybe a whole base
            base = rng.choice(bases)
            head = base[:rng.randint(1, len(base))]
            prompts.append(head + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 6))])
        elif r < 0.55:  # longer than a chunk
            prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(40, 70))])
        elif r < 0.7:  # repetitive: n-gram guesses that are accepted
            motif = [rng.randrange(3, VOCAB) for _ in range(3)]
            prompts.append((motif * 12)[:rng.randint(4, 30)])
        else:
            prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))])
    return prompts


def run_mix(llm: LLM, rng: random.Random, n: int):
    """Add ``n`` random requests a few at a time while the engine steps, aborting some; returns the prompts, their
    params, and each request's final output by prompt index."""
    engine = llm.engine
    prompts = random_prompts(rng, n)
    params = [random_params(rng) for _ in range(n)]
    pending, index_of, final = list(range(n)), {}, {}
    for _ in range(2000):
        if not pending and not engine.has_unfinished():
            break
        if pending and (rng.random() < 0.5 or not engine.has_unfinished()):
            for i in pending[:rng.randint(1, 3)]:
                index_of[engine.add_request(prompts[i], params[i])] = i
                pending.remove(i)
        if rng.random() < 0.08:
            request_id = rng.choice(list(index_of))
            if (out := engine.abort(request_id)) is not None:
                final[index_of[request_id]] = out
        for out in engine.step():
            if out.finished:
                assert index_of[out.request_id] not in final, "a request ended twice"
                final[index_of[out.request_id]] = out
    else:
        raise AssertionError("the workload did not end in 2000 steps")
    for request_id in index_of:
        engine.pop_finished(request_id)
    assert sorted(final) == list(range(n)), "a request never ended"
    return prompts, params, final


def assert_pool_whole(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert_no_leak(llm)
    assert not any(bm.ref_counts)
    assert bm._num_free + bm.num_cached_blocks == bm.num_blocks
    assert not llm.engine.sequences


SPECULATION = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.mark.parametrize("speculation", list(SPECULATION))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_matches_alone_and_returns_every_block(tiny_path, plain, device, speculation, seed):
    rng = random.Random(seed)
    llm = LLM(str(tiny_path), num_blocks=24, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              enable_prefix_caching=True, enable_chunked_prefill=seed == 0, device=device,
              speculative_config=SPECULATION[speculation], **FP32)
    prompts, params, final = run_mix(llm, rng, 12)
    assert_pool_whole(llm)
    assert llm.stats()["num_preemptions"] > 0, "the pool is meant to be too small for every request at once"
    for i, out in final.items():
        p = params[i]
        assert out.finish_reason in ("stop", "length", "abort"), (out.finish_reason, out.error)
        if out.finish_reason == "abort":
            continue
        n = len(out.token_ids)
        assert p.min_tokens <= n <= p.max_tokens and (out.finish_reason == "stop" or n == p.max_tokens)
        if out.finish_reason == "stop" and not p.stop_list:
            assert out.token_ids[-1] in [*p.stop_token_ids, *([] if p.ignore_eos else [EOS])]
        if p.logprobs is not None:
            assert len(out.logprobs) == n
        alone = plain.generate([prompts[i]], p)[0].outputs[0]
        assert out.token_ids == alone.token_ids, (i, prompts[i], p)
        assert out.finish_reason == alone.finish_reason and out.text == alone.text
