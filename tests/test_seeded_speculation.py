"""Seeded sampling with speculation gives exactly plain seeded sampling's tokens when the guesses are one-hot
(n-gram chains and trees, lookahead, draft trees, a coupled draft), alone and batched, adaptive k on, in a
fresh LLM; and matched verification accepts a guess as often as the target would have drawn it.

fp32 on the test device, speculative against plain on the same device and backend: exactly equal."""

import math

import pytest
import torch

from nanospec import LLM, SamplingParams
from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal
from nanospec.speculative.verify import verify
from tiny import assert_no_leak, make_tiny_llama

PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 3], [11, 12], [42]]
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=20, max_tokens=30, seed=2**70 + 3, ignore_eos=True),
          SamplingParams(temperature=0.5, max_tokens=30, seed=-5, ignore_eos=True),
          SamplingParams(temperature=1.5, min_p=0.2, top_k=40, max_tokens=30, seed=123, ignore_eos=True)]
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    "ngram_no_adaptive": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "max_candidates": 3, "prompt_lookup_max": 2},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "guess_set_size": 3, "adaptive": False},
    "draft_coupled": {"method": "draft", "num_speculative_tokens": 3, "acceptance": "coupled"},
    "draft_coupled_no_adaptive": {"method": "draft", "num_speculative_tokens": 2, "acceptance": "coupled",
                                  "adaptive": False},
    "draft_tree": {"method": "draft", "num_speculative_tokens": 3, "tree_top_k": 2, "tree_budget": 6,
                   "adaptive": False},  # verified whole: under the policy a random draft's tree may never be drafted
    "self_draft_coupled": {"method": "draft", "num_speculative_tokens": 3, "acceptance": "coupled",
                           "adaptive": False},  # the target as its own draft: its coupled guesses are right
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = tmp_path_factory.mktemp("seeded_target")
    make_tiny_llama(target, seed=1, tie=True, layers=3, max_pos=256)
    draft = tmp_path_factory.mktemp("seeded_draft")
    make_tiny_llama(draft, seed=2, tie=False, layers=1, num_heads=2, num_kv_heads=1, hidden=32, max_pos=256)
    return target, draft


@pytest.fixture(scope="module")
def plain_outputs(paths, device):
    llm = LLM(str(paths[0]), num_blocks=256, block_size=4, device=device, dtype="float32")
    return {(i, j): llm.generate([prompt], params)[0].outputs[0].token_ids
            for i, prompt in enumerate(PROMPTS) for j, params in enumerate(PARAMS)}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_seeded_outputs_equal_plain_alone_and_batched(paths, plain_outputs, method, device):
    config = dict(METHODS[method])
    if config["method"] == "draft":
        config["model"] = str(paths[0] if method.startswith("self") else paths[1])
    llm = LLM(str(paths[0]), num_blocks=256, block_size=4, speculative_config=config, device=device,
              dtype="float32")
    for j, params in enumerate(PARAMS):
        alone = [llm.generate([prompt], params)[0].outputs[0] for prompt in PROMPTS]
        assert [o.token_ids for o in alone] == [plain_outputs[i, j] for i in range(len(PROMPTS))], (method, j)
        batched = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        assert [o.token_ids for o in batched] == [plain_outputs[i, j] for i in range(len(PROMPTS))], (method, j)
    stats = llm.stats()
    if method != "draft_coupled":  # (with adaptive k a tiny random draft may not pay: the policy stops it)
        assert stats["num_draft_tokens"] > 0  # guesses were verified, not skipped
    if method.startswith("self"):  # (a random model's samples rarely repeat: here every guess should be right)
        assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"]
    assert_no_leak(llm)


def test_mixed_params_in_one_batch_equal_plain(paths, plain_outputs, device):
    """Each request keeps its own seed, temperature and top-k/top-p inside one speculative batch."""
    llm = LLM(str(paths[0]), num_blocks=256, block_size=4, speculative_config=METHODS["ngram_tree"], device=device,
              dtype="float32")
    prompts = [p for p in PROMPTS for _ in PARAMS]
    params = [q for _ in PROMPTS for q in PARAMS]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [plain_outputs[i, j] for i in range(len(PROMPTS)) for j in
                                                      range(len(PARAMS))]


def _sequence(seed: int, temperature: float = 1.0) -> Sequence:
    return Sequence(0, [1, 2, 3], SamplingParams(temperature=temperature, seed=seed), seed, None, [])


@pytest.mark.parametrize("guesses", [[3], [3, 5]], ids=["chain", "two-children"])
def test_matched_acceptance_is_the_guesses_mass(guesses, device):
    """A root with one-hot children: the walk accepts a child iff the target's race picks its token, so the
    first token is distributed as p and a child is accepted with probability p(its token) (a bound at 1e-6
    false-alarm probability, Hoeffding: |freq - p| < sqrt(ln(2e6) / (2n)))."""
    vocab, n = 8, 20_000
    p = torch.tensor([0.05, 0.1, 0.05, 0.4, 0.1, 0.2, 0.05, 0.05])
    # on the test device: verify runs its kernels there (the race, the tree walk: Triton on CUDA)
    logits = torch.log(p)[None].expand(1 + len(guesses), vocab).contiguous().to(device)
    proposal = Proposal(guesses, [-1] * len(guesses))
    accepted, first = torch.zeros(vocab), torch.zeros(vocab)
    verdicts = verify([_sequence(seed) for seed in range(n)], [proposal] * n, logits.repeat(n, 1)).read()
    for verdict in verdicts:
        first[verdict.emitted[0]] += 1
        if verdict.path:
            accepted[guesses[verdict.path[0]]] += 1
    bound = math.sqrt(math.log(2e6) / (2 * n))
    assert (first / n - p).abs().max() < bound
    for g in guesses:
        assert abs(accepted[g] / n - p[g]) < bound
    assert accepted.sum() == sum(first[g] for g in guesses)  # accepted exactly when the race picked a guess
