"""EAGLE-3 heads (the format vLLM and SGLang load) and method ``"eagle3"``:

* the target's forward keeps the residual stream entering the auxiliary layers, as transformers'
  ``hidden_states[i]`` (vLLM's indexing), at every row of the batch;
* checkpoints written here in each naming style (``midlayer.``, ``model.layers.0.``, ``layers.0.``), with a
  reduced draft vocabulary and ``d2t`` or the whole one, with an embedding of their own or the target's: the first
  guesses after a prompt equal the head's formula written out again here in float64;
* the engine: greedy and seeded output equal plain decoding's, alone and batched, eager and on the static path,
  under preemption and with a prompt served from the prefix cache; every head K/V block returns to its pool;
* with penalties, log-probabilities, ``n``, stop strings, stop tokens and ``min_tokens``, chain and tree on the static
  path, and behind the OpenAI-compatible server: plain decoding's outputs; ``{"method": "eagle3"}`` without a model
  serves the embedded SmolLM2 with the head shipped for it;
* a head that does not fit the target (hidden size, vocabulary, ``d2t`` length, auxiliary layer ids, head_dim) is
  refused with an error naming the field.

Besides heads with random weights, a head built by hand guesses the token that most often followed the last one in
plain decoding (its attention reads the current token's embedding, its ``lm_head`` scores the successors through a
reduced vocabulary and ``d2t``), so guesses are accepted often but not always: acceptance, the bonus token and
the head's K/V past rejected guesses all run."""

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import save_file

from nanospec import LLM, SamplingParams
from nanospec.cache.block_manager import slots_of
from nanospec.speculative.eagle3 import Eagle3Proposer, Eagle3State
from nanospec.speculative.proposal import Proposal
from tiny import (assert_no_leak, assert_prompt_logprobs_as_plain, fixed_costs, make_tiny_llama,
                  most_common_successors)

HIDDEN, LAYERS, VOCAB = 64, 3, 320
PROMPTS = [[5, 9, 33, 5, 9, 33, 5, 9], list(range(40, 61)) * 2, [7] * 9, [100, 101, 102, 103, 104, 105, 3], [11, 12],
           [42]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=11, ignore_eos=True),
           SamplingParams(temperature=0.5, top_k=20, max_tokens=20, seed=-5, ignore_eos=True)]
ALL_PARAMS = [GREEDY, *SAMPLED]
STYLES = {"midlayer": "midlayer.", "model.layers.0": "model.layers.0.", "layers.0": "layers.0."}


def head_config(**changes) -> dict:
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
              "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
              "vocab_size": VOCAB, "draft_vocab_size": VOCAB, "tie_word_embeddings": False}
    config.update(changes)
    return config


def random_tensors(config: dict, *, seed: int, embedding: bool, hot: list[int] | None = None) -> dict:
    """Canonical names (``midlayer.``) -> random tensors of the head's shapes; ``hot``: the draft vocabulary's
    target ids (then ``d2t`` and ``t2d``)."""
    g = torch.Generator().manual_seed(seed)
    H, F = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    draft = len(hot) if hot is not None else config["vocab_size"]
    target_hidden = config.get("target_hidden_size", H)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    t = {"fc.weight": rand(H, 3 * target_hidden), "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
         "lm_head.weight": rand(draft, H)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{name}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    for name, shape in (("q", (q, 2 * H)), ("k", (kv, 2 * H)), ("v", (kv, 2 * H)), ("o", (H, q))):
        t[f"midlayer.self_attn.{name}_proj.weight"] = rand(*shape)
    for name, shape in (("gate", (F, H)), ("up", (F, H)), ("down", (H, F))):
        t[f"midlayer.mlp.{name}_proj.weight"] = rand(*shape)
    if embedding:
        t["embed_tokens.weight"] = rand(config["vocab_size"], H)
    if hot is not None:
        t["d2t"] = torch.tensor(hot) - torch.arange(draft)
        t["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill_(0, torch.tensor(hot), True)
    return t


def write_head(directory: Path, tensors: dict, config: dict, style: str = "midlayer") -> Path:
    """The checkpoint as published: ``midlayer.`` renamed to the style's layer prefix, the rest as it is (under
    ``model.`` too in the ``model.layers.0`` style)."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = STYLES[style]
    named = {}
    for name, tensor in tensors.items():
        if name.startswith("midlayer."):
            name = prefix + name.removeprefix("midlayer.")
        elif style == "model.layers.0" and name != "lm_head.weight":
            name = "model." + name
        named[name] = tensor.contiguous()
    save_file(named, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3_target")
    model = make_tiny_llama(path, seed=1, tie=True, layers=LAYERS, max_pos=256, hidden=HIDDEN, vocab=VOCAB)
    return path, model


@pytest.fixture(scope="module")
def plain(target, device):
    return LLM(str(target[0]), num_blocks=256, block_size=4, device=device, dtype="float32")


@pytest.fixture(scope="module")
def expected(plain):
    """Plain decoding's tokens: ``expected[j][i]`` for ``ALL_PARAMS[j]`` and ``PROMPTS[i]``."""
    return [[o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)] for params in ALL_PARAMS]


def build_successor_head(directory: Path, model, sequences: list[list[int]], weighted: bool = False) -> Path:
    """A head that guesses the most common successor of the token it is fed: fc = 0, so the layer sees the token
    alone; q = k = 4 x, v = x on the token's normed embedding (a row attends to itself, or to rows of the same
    token), o = I, no MLP; lm_head row d is the sum of the normed embeddings of the tokens whose successor is
    the draft id d's target token. ``weighted``: every successor seen counts, times how often it followed, so
    the head's second best token is the second most common successor."""
    counts: dict[int, Counter] = {}
    for ids in sequences:
        for token, successor in zip(ids, ids[1:]):
            counts.setdefault(token, Counter())[successor] += 1
    if weighted:
        pairs = [(token, successor, n) for token, c in counts.items() for successor, n in c.items()]
    else:
        pairs = [(token, successor, 1) for token, successor in most_common_successors(sequences).items()]
    hot = sorted({successor for _, successor, _ in pairs})
    config = head_config(draft_vocab_size=len(hot))
    t = random_tensors(config, seed=3, embedding=False, hot=hot)
    embed = model.model.embed_tokens.weight.detach().float()
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-5)
    eye = torch.eye(HIDDEN)
    t["fc.weight"].zero_()
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{name}.weight"].fill_(1.0)
    t["norm.weight"].fill_(1.0)
    t["midlayer.self_attn.q_proj.weight"] = torch.cat([4 * eye, 0 * eye], dim=1)
    t["midlayer.self_attn.k_proj.weight"] = torch.cat([4 * eye, 0 * eye], dim=1)
    t["midlayer.self_attn.v_proj.weight"] = torch.cat([eye, 0 * eye], dim=1)
    t["midlayer.self_attn.o_proj.weight"] = eye.clone()
    t["midlayer.mlp.down_proj.weight"].zero_()
    lm_head = torch.zeros(len(hot), HIDDEN)
    for token, successor, n in pairs:
        lm_head[hot.index(successor)] += n * normed[token]
    t["lm_head.weight"] = lm_head
    return write_head(directory, t, config, "layers.0")


def plain_sequences(expected) -> list[list[int]]:
    return [prompt + out for outputs in expected for prompt, out in zip(PROMPTS, outputs)]


@pytest.fixture(scope="module")
def successor_head(tmp_path_factory, target, expected):
    return build_successor_head(tmp_path_factory.mktemp("eagle3_successor"), target[1], plain_sequences(expected))


@pytest.fixture(scope="module")
def weighted_successor_head(tmp_path_factory, target, expected):
    return build_successor_head(tmp_path_factory.mktemp("eagle3_weighted"), target[1], plain_sequences(expected),
                                weighted=True)


def eagle_llm(target, head, device, *, k: int = 3, adaptive: bool = False, tree: dict | None = None,
              **kwargs) -> LLM:
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "adaptive": adaptive,
              **(tree or {})}
    kwargs = {"num_blocks": 256, "block_size": 4, "device": device, "dtype": "float32", **kwargs}
    return LLM(str(target[0]), speculative_config=config, **kwargs)


def assert_head_blocks_returned(llm) -> None:
    assert_no_leak(llm)  # the target's pool, and the head's (the proposer's block_manager)
    blocks = llm.engine.speculator.proposer.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def assert_guesses_accepted_and_rejected(llm) -> None:
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats


# ---------------------------------------------------------------- the target's auxiliary states

def test_forward_keeps_the_residual_stream_entering_the_aux_layers(target, device):
    """``runner.aux_hidden`` after a prefill: transformers' ``hidden_states[i]`` (the embeddings for 0, else layer
    i - 1's output) for each id, concatenated in layer order, at every prompt row."""
    path, model = target
    head = write_head(path.parent / "eagle3_aux_probe", random_tensors(head_config(), seed=0, embedding=False),
                      head_config(eagle_aux_hidden_state_layer_ids=[2, 0, 1]))
    llm = eagle_llm(target, head, device)
    assert llm.engine.runner.aux_layers == (0, 1, 2)
    prompt = PROMPTS[1]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    reference = torch.cat([states[i][0] for i in (0, 1, 2)], dim=-1)
    # the last forward was the prefill (max_tokens=1: one step)
    torch.testing.assert_close(llm.engine.runner.aux_hidden.cpu(), reference, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the head's formula

def reference_head(tensors: dict, config: dict, model, ids: list[int], aux_ids: list[int]):
    """The head in float64 with dense attention: its output at the prompt's last row (after the prompt's rows,
    causal), the K/V of those rows, ``layer(tokens, hidden, positions, keys, values)`` (appends its K/V),
    ``log_probs(out)`` over the draft vocabulary and ``to_target(draft id)``."""
    t = {name: v.double() if v.is_floating_point() else v for name, v in tensors.items()}
    eps, nh, nk, d = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    embed = t.get("embed_tokens.weight", model.model.embed_tokens.weight.detach().double())

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

    def rope(x, pos):  # x [T, h, d]
        angles = pos[:, None].double() * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0].double() for i in sorted(aux_ids)], dim=-1)

    def layer(tokens, hidden, positions, keys, values):
        x = torch.cat([norm(embed[tokens], t["midlayer.input_layernorm.weight"]),
                       norm(hidden, t["midlayer.hidden_norm.weight"])], -1)
        q = rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(-1, nh, d), positions)
        keys.append(rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(-1, nk, d), positions))
        values.append((x @ t["midlayer.self_attn.v_proj.weight"].T).view(-1, nk, d))
        K, V = torch.cat(keys).repeat_interleave(nh // nk, 1), torch.cat(values).repeat_interleave(nh // nk, 1)
        scores = torch.einsum("qhd,khd->hqk", q, K) / d ** 0.5
        past = K.shape[0] - len(tokens)
        mask = torch.ones(len(tokens), K.shape[0], dtype=torch.bool).tril(past)
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), V)
        h = hidden + attn.reshape(len(tokens), -1) @ t["midlayer.self_attn.o_proj.weight"].T
        m = norm(h, t["midlayer.post_attention_layernorm.weight"])
        gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T

    def log_probs(out):
        return torch.log_softmax(norm(out, t["norm.weight"]) @ t["lm_head.weight"].T, -1)

    def to_target(draft):
        return draft + int(t["d2t"][draft]) if "d2t" in t else draft

    first = model(torch.tensor([ids])).logits[0, -1].argmax().item()  # the token the prefill emits
    keys, values = [], []
    out = layer(torch.tensor(ids[1:] + [first]), aux @ t["fc.weight"].T, torch.arange(len(ids)), keys, values)[-1:]
    return out, keys, values, layer, log_probs, to_target


def reference_guesses(tensors: dict, config: dict, model, ids: list[int], aux_ids: list[int], k: int) -> list[int]:
    """The head over the prompt in float64 with dense causal attention, then k - 1 steps on its own output."""
    out, keys, values, layer, log_probs, to_target = reference_head(tensors, config, model, ids, aux_ids)
    guesses = [to_target(int(log_probs(out[0]).argmax()))]
    for step in range(1, k):
        out = layer(torch.tensor([guesses[-1]]), out, torch.tensor([len(ids) - 1 + step]), keys, values)
        guesses.append(to_target(int(log_probs(out[0]).argmax())))
    return guesses


def reference_tree(tensors: dict, config: dict, model, ids: list[int], aux_ids: list[int], width: int, depth: int,
                   budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """EAGLE-2 written out in float64, node by node: a node's output is the head fed its path one token a step
    after the prompt; depth 1 is the root's ``width`` best tokens, each deeper depth the ``width`` best children of
    each of the last depth's ``width`` best nodes; every node ranked by summed log-probability (shallower first on
    ties), the best ``budget`` kept. (score, path of target ids) best first."""
    root, keys, values, layer, log_probs, to_target = reference_head(tensors, config, model, ids, aux_ids)

    def output(path):
        out, k, v = root, list(keys), list(values)
        for j, token in enumerate(path, 1):
            out = layer(torch.tensor([token]), out, torch.tensor([len(ids) - 1 + j]), k, v)
        return out

    def children(score, path):
        top = log_probs(output(path)[0]).topk(width)
        return [(score + float(lp), path + (to_target(int(i)),)) for lp, i in zip(top.values, top.indices)]

    nodes = frontier = children(0.0, ())
    for _ in range(1, depth):
        generated = [child for score, path in frontier for child in children(score, path)]
        nodes = nodes + generated
        frontier = sorted(generated, key=lambda node: -node[0])[:width]
    return sorted(nodes, key=lambda node: (-node[0], len(node[1])))[:budget]


@pytest.mark.parametrize("style, embedding, hot", [("midlayer", False, True), ("model.layers.0", True, False),
                                                   ("layers.0", False, False)])
def test_first_guesses_follow_the_formula(target, device, tmp_path, style, embedding, hot):
    _, model = target
    vocab = list(range(7, VOCAB, 3)) if hot else None
    config = head_config(draft_vocab_size=len(vocab) if hot else VOCAB, eagle_aux_hidden_state_layer_ids=[1, 0, 2])
    tensors = random_tensors(config, seed=5, embedding=embedding, hot=vocab)
    llm = eagle_llm(target, write_head(tmp_path / style, tensors, config, style), device, k=3)
    engine = llm.engine
    checked = 0
    for prompt in PROMPTS[:4]:
        seq_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()  # the prefill: the head runs over the prompt and drafts
        state = engine.sequences[seq_id].spec_state
        assert state.ranked.token_ids == reference_guesses(tensors, config, model, prompt, [0, 1, 2], 3)
        checked += 1
        while engine.has_unfinished():
            engine.step()
    assert checked == 4
    assert_head_blocks_returned(llm)


# ---------------------------------------------------------------- the engine: lossless

@pytest.mark.parametrize("style", list(STYLES))
def test_random_heads_in_each_style_equal_plain(target, expected, device, tmp_path, style):
    config = head_config(draft_vocab_size=100)
    tensors = random_tensors(config, seed=2, embedding=style == "midlayer", hot=list(range(3, 203, 2)))
    llm = eagle_llm(target, write_head(tmp_path / style, tensors, config, style), device, k=3, max_num_seqs=8)
    for j, params in enumerate(ALL_PARAMS):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j], j
    assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == expected[0][0]
    assert llm.stats()["num_draft_tokens"] > 0
    assert_head_blocks_returned(llm)


@pytest.mark.parametrize("k, enforce_eager", [(3, True), (2, False)], ids=["k3-eager", "k2-static"])
def test_greedy_equals_plain(target, successor_head, expected, device, k, enforce_eager):
    llm = eagle_llm(target, successor_head, device, k=k, enforce_eager=enforce_eager, max_num_seqs=8)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected[0]
    for i in (0, 5):  # alone, the one-token prompt too
        assert llm.generate([PROMPTS[i]], GREEDY)[0].outputs[0].token_ids == expected[0][i]
    assert_guesses_accepted_and_rejected(llm)
    if not enforce_eager:
        assert llm.engine.runner.graphs  # the static path did run
    assert_head_blocks_returned(llm)


def test_chunked_prefill_equals_plain(target, successor_head, weighted_successor_head, expected, device):
    """Prompts of up to 42 tokens computed 5 a step (chunked prefill): greedy and seeded outputs equal plain
    decoding's, its guesses accepted."""
    for head, tree in [(successor_head, None), (weighted_successor_head, TREE)]:
        llm = eagle_llm(target, head, device, tree=tree, max_num_batched_tokens=5)
        for j, params in enumerate(ALL_PARAMS):
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j]
        assert llm.stats()["num_accepted_tokens"] > 0
        assert_head_blocks_returned(llm)


def test_the_head_runs_over_every_chunk_of_a_prompt(target, weighted_successor_head, device):
    """A 42-token prompt computed 5 a step: the head runs over each chunk's rows too, so when the prompt ends its
    K/V covers the whole prompt with the values a whole prefill gives (bit for bit on a CPU), and so do its first
    guesses."""
    seen = {}
    for budget in (5, 4096):
        llm = eagle_llm(target, weighted_successor_head, device, tree=TREE, max_num_batched_tokens=budget,
                        max_num_seqs=1)
        engine, proposer = llm.engine, llm.engine.speculator.proposer
        seq = engine.sequences[engine.add_request(PROMPTS[1], GREEDY)]
        steps = 0
        while seq.num_output_tokens == 0:
            engine.step()
            steps += 1
        st = seq.spec_state
        slots = torch.tensor(slots_of(st.block_table, proposer.block_size, range(st.num_cached - st.base)))
        k_cache, v_cache = proposer.kv_cache.layer_slots(0)
        seen[budget] = (steps, st.base, st.num_cached, k_cache[slots].clone(), v_cache[slots].clone(),
                        st.ranked.token_ids, st.ranked.parents)
        while engine.has_unfinished():
            engine.step()
        assert_head_blocks_returned(llm)
    (chunked_steps, *chunked), (whole_steps, *whole) = seen[5], seen[4096]
    assert (chunked_steps, whole_steps) == (9, 1)
    assert chunked[:2] == whole[:2] == [0, len(PROMPTS[1])]
    exact = dict(rtol=0, atol=0) if torch.device(device).type == "cpu" else {}
    for got, want in zip(chunked[2:4], whole[2:4]):
        torch.testing.assert_close(got, want, **exact)
    assert chunked[4:] == whole[4:]


@pytest.mark.parametrize("adaptive", [False, True], ids=["every_guess", "adaptive"])
def test_the_head_drafts_one_depth_deeper_than_the_policy_verified(target, successor_head, expected, device, adaptive):
    """Each depth drafted costs a head forward: with the policy on the chain is drafted one depth deeper than the
    step verified (at most k), so the policy may verify one more next step; without it, k deep."""
    llm = eagle_llm(target, successor_head, device, k=4, adaptive=adaptive, max_num_seqs=1)
    proposer, seen = llm.engine.speculator.proposer, []
    read_forward = proposer.read_forward

    def recording(proposals, logits, hidden, verification):
        out = read_forward(proposals, logits, hidden, verification)
        seen.append((proposals[0].max_depth(), verification.seqs[0].spec_state.drafted))
        return out

    proposer.read_forward = recording
    for i in (0, 2):
        assert llm.generate([PROMPTS[i]], GREEDY)[0].outputs[0].token_ids == expected[0][i]
    assert seen and all(drafted == (min(verified + 1, 4) if adaptive else 4) for verified, drafted in seen), seen
    assert {drafted for _, drafted in seen} != {4} or not adaptive, seen  # the policy did not verify every guess
    assert_head_blocks_returned(llm)


@pytest.mark.parametrize("adaptive", [False, True], ids=["every_guess", "adaptive"])
def test_seeded_sampling_equals_plain(target, successor_head, expected, device, adaptive):
    llm = eagle_llm(target, successor_head, device, adaptive=adaptive)
    for j, params in enumerate(SAMPLED, 1):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j], j
        assert llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids == expected[j][1], j
    if not adaptive:
        assert_guesses_accepted_and_rejected(llm)
    assert_head_blocks_returned(llm)


def test_batch_mixing_speculating_and_plain_requests(target, successor_head, expected, plain, device):
    runs = [(i, j, p) for i in range(len(PROMPTS)) for j in range(len(ALL_PARAMS))
            for p in (ALL_PARAMS[j], dataclasses.replace(ALL_PARAMS[j], speculate=False),
                      dataclasses.replace(ALL_PARAMS[j], prompt_logprobs=1))]  # (its prompt rows come out first)
    llm = eagle_llm(target, successor_head, device)
    outs = [o.outputs[0] for o in llm.generate([PROMPTS[i] for i, _, _ in runs], [p for _, _, p in runs])]
    assert [o.token_ids for o in outs] == [expected[j][i] for i, j, _ in runs]
    assert_prompt_logprobs_as_plain(outs, [PROMPTS[i] for i, _, _ in runs], [p for _, _, p in runs], plain)
    assert all(o.num_draft_tokens == 0 for o, (_, _, p) in zip(outs, runs) if not p.speculate)
    assert_guesses_accepted_and_rejected(llm)
    assert_head_blocks_returned(llm)


def test_preemption_keeps_outputs_and_frees_every_block(target, successor_head, expected, device):
    llm = eagle_llm(target, successor_head, device, num_blocks=24, max_num_seqs=8)
    for j, params in enumerate(ALL_PARAMS[:2]):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j], j
    assert llm.stats()["num_preemptions"] > 0
    assert_guesses_accepted_and_rejected(llm)
    assert_head_blocks_returned(llm)


@pytest.mark.parametrize("tree", [None, {"tree_top_k": 3, "tree_budget": 10}], ids=["chain", "tree"])
def test_the_end_of_the_context_in_a_pool_of_one_context(target, successor_head, device, tree):
    """With the pool its default for one sequence (one whole context), the head's guesses run into the context's
    end as plain decoding does, and every block returns."""
    llm = eagle_llm(target, successor_head, device, tree=tree, num_blocks=None, max_num_seqs=1, max_model_len=24)
    assert llm.engine.block_manager.num_blocks == 24 // 4
    short = LLM(str(target[0]), num_blocks=64, block_size=4, device=device, dtype="float32", max_model_len=24)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[5]]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in outs] == [o.outputs[0].token_ids for o in short.generate(prompts, params)]
    assert all(o.finish_reason == "length" and len(p) + len(o.token_ids) == 24 for p, o in zip(prompts, outs))
    assert_guesses_accepted_and_rejected(llm)
    assert_head_blocks_returned(llm)


def test_a_prompt_from_the_prefix_cache_still_guesses(target, successor_head, expected, device):
    """The second run of a prompt is served from the target's prefix cache: the head starts where the target's
    forward starts, guesses, and the output is plain decoding's."""
    llm = eagle_llm(target, successor_head, device)
    prompt = PROMPTS[1]
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected[0][1]
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    assert out.num_cached_tokens > 0
    assert out.token_ids == expected[0][1]
    assert out.num_accepted_tokens > 0
    assert_head_blocks_returned(llm)


# ---------------------------------------------------------------- EAGLE-2 dynamic trees

TREE = {"tree_top_k": 3, "tree_budget": 10}


def record_trees(llm) -> list[tuple]:
    """Every commit's (verified proposal, verdict, the tree drafted behind its new last token)."""
    proposer, steps = llm.engine.speculator.proposer, []
    commit = proposer.commit

    def recording(seq, proposal, verdict):
        commit(seq, proposal, verdict)
        steps.append((proposal, verdict, seq.spec_state.ranked))

    proposer.commit = recording
    return steps


def assert_ranked_tree(tree, k: int, budget: int) -> None:
    """A tree best first: parents before children, a child's chance never above its parent's, chances
    non-increasing down the list, distinct siblings, at most ``budget`` nodes ``k`` deep, and a real tree."""
    assert 0 < len(tree.token_ids) <= budget and max(tree.depths) <= k
    for i, parent in enumerate(tree.parents):
        assert -1 <= parent < i
        assert parent < 0 or tree.chances[i] <= tree.chances[parent]
    # (a chance may be 0.0: a random head's float32 probability of a far-off token underflows)
    assert tree.chances == sorted(tree.chances, reverse=True) and 0 <= tree.chances[-1] <= tree.chances[0] <= 1
    assert tree.chances[0] > 0
    assert len(set(zip(tree.parents, tree.token_ids))) == len(tree.token_ids)
    assert tree.first_guesses() and not tree.is_chain


def side_branches_accepted(steps) -> int:
    """Accepted nodes that are not their parent's first (most probable) child: off the head's greedy chain."""
    count = 0
    for proposal, verdict, _ in steps:
        first_child = {}
        for i, parent in enumerate(proposal.parents):
            first_child.setdefault(parent, i)
        count += sum(first_child[proposal.parents[i]] != i for i in verdict.path)
    return count


@pytest.mark.parametrize("adaptive", [False, True], ids=["every_node", "adaptive"])
def test_trees_equal_plain_and_accept_side_branches(target, weighted_successor_head, expected, device, adaptive):
    llm = eagle_llm(target, weighted_successor_head, device, adaptive=adaptive, tree=TREE, max_num_seqs=8)
    steps = record_trees(llm)
    for j, params in enumerate(ALL_PARAMS):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j], j
        assert llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids == expected[j][1], j
    drafted = [tree for _, _, tree in steps if tree is not None]
    assert len(drafted) > 20
    for tree in drafted:
        assert_ranked_tree(tree, 3, TREE["tree_budget"])
    if not adaptive:
        assert all(len(tree.token_ids) == TREE["tree_budget"] for tree in drafted)
        assert_guesses_accepted_and_rejected(llm)
        assert side_branches_accepted(steps) > 0
    assert_head_blocks_returned(llm)


def test_trees_with_random_heads_and_preemption_equal_plain(target, expected, device, tmp_path):
    config = head_config(draft_vocab_size=100)
    tensors = random_tensors(config, seed=2, embedding=False, hot=list(range(3, 203, 2)))
    head = write_head(tmp_path / "head", tensors, config)
    llm = eagle_llm(target, head, device, k=4, tree={"tree_top_k": 2}, num_blocks=30, max_num_seqs=8)
    for j, params in enumerate(ALL_PARAMS[:2]):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j], j
    assert llm.stats()["num_preemptions"] > 0
    assert llm.engine.speculator.proposer.max_tokens_per_step == 8  # the default budget: k * tree_top_k
    assert_head_blocks_returned(llm)


def test_a_full_head_pool_drafts_for_fewer_sequences_and_fails_no_step(target, weighted_successor_head, device):
    """Many short sequences and a tree whose scratch rows (width x (depth - 1) = 12, 3 blocks) outnumber the blocks
    each holds in the target's pool (1 or 2 of 24): the head's pool (twice the target's) cannot hold every
    sequence's scratch at once. The head still runs over every sequence's rows, drafts for those whose scratch fits,
    and no step fails (a failed step is run again one sequence at a time); the output is plain decoding's."""
    prompts = [[(11 * i) % 300 + 3, (7 * i) % 300 + 3] for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(target[0]), num_blocks=24, block_size=4, device=device, dtype="float32",
               max_num_seqs=32).generate(prompts, params)
    llm = eagle_llm(target, weighted_successor_head, device, k=4, tree={"tree_top_k": 4, "tree_budget": 4},
                    num_blocks=24, max_num_seqs=32)
    isolate, failed = llm.engine._isolate, []
    llm.engine._isolate = lambda seqs, error: failed.append(error) or isolate(seqs, error)
    proposer, drafted = llm.engine.speculator.proposer, []
    commit = proposer.commit

    def recording(seq, proposal, verdict):
        commit(seq, proposal, verdict)
        drafted.append(seq.spec_state.drafted)

    proposer.commit = recording
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in want]
    assert failed == []
    assert 0 < sum(map(bool, drafted)) < len(drafted)  # some sequences drafted, some waited
    assert llm.stats()["num_draft_tokens"] > 0
    assert_head_blocks_returned(llm)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_small_pool_with_the_policy_on_equals_plain(target, weighted_successor_head, expected, device, tree):
    """A target pool of 8 blocks of 4 (32 tokens; the head's: 64): the policy's measurement of a draft step (after
    up to 64 positions, plus the scratch rows) fits the head's pool, and the output is plain decoding's."""
    llm = eagle_llm(target, weighted_successor_head, device, adaptive=True, tree=tree, num_blocks=8)
    assert llm.generate([PROMPTS[4]], GREEDY)[0].outputs[0].token_ids == expected[0][4]
    assert_head_blocks_returned(llm)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_short_context_with_the_policy_on_equals_plain(target, weighted_successor_head, expected, device, tree):
    """max_model_len 32, under the 64 positions the policy's measurement of a draft step follows: it measures within
    the context the head's RoPE covers, and the output is plain decoding's."""
    llm = eagle_llm(target, weighted_successor_head, device, adaptive=True, tree=tree, max_model_len=32)
    assert llm.generate([PROMPTS[4]], GREEDY)[0].outputs[0].token_ids == expected[0][4]
    assert_head_blocks_returned(llm)


def test_first_tree_follows_eagle2(target, device, tmp_path):
    """After a prompt the engine's tree (tokens, shape, order, scores) is EAGLE-2's search written out node by
    node in float64 (each node fed its own path): depth 3 needs each node to attend to its ancestors only."""
    _, model = target
    vocab = list(range(5, VOCAB, 2))
    config = head_config(draft_vocab_size=len(vocab), eagle_aux_hidden_state_layer_ids=[1, 0, 2])
    tensors = random_tensors(config, seed=7, embedding=False, hot=vocab)
    llm = eagle_llm(target, write_head(tmp_path / "head", tensors, config), device, k=3,
                    tree={"tree_top_k": 3, "tree_budget": 14})
    engine = llm.engine
    for prompt in PROMPTS[:4]:
        seq_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.step()  # the prefill: the head runs over the prompt and drafts its tree
        state = engine.sequences[seq_id].spec_state
        reference = reference_tree(tensors, config, model, prompt, [0, 1, 2], 3, 3, 14)
        paths = [tuple(path) for path in state.ranked.paths()]
        assert paths == [path for _, path in reference]
        assert max(len(path) for path in paths) == 3
        got = [math.log(state.calibration.paths[path]) for path in paths]
        assert got == pytest.approx([score for score, _ in reference], abs=1e-4)
        while engine.has_unfinished():
            engine.step()
    assert_head_blocks_returned(llm)


# ---------------------------------------------------------------- a head whose guesses do not pay keeps running

class HeadStep(NamedTuple):
    verified: int   # guesses the step verified
    declined: bool  # it verified none of those drafted
    accepted: int
    base: int | None  # the first position the head holds K/V for
    drafted: int


def record_head_steps(llm) -> dict[int, list[HeadStep]]:
    """Per sequence, what each step's ``read_forward`` did for it."""
    proposer, seen = llm.engine.speculator.proposer, {}
    read_forward = proposer.read_forward

    def recording(proposals, logits, hidden, verification):
        out = read_forward(proposals, logits, hidden, verification)
        for b, (seq, p) in enumerate(zip(verification.seqs, proposals)):
            if (st := seq.spec_state) is not None:
                seen.setdefault(seq.seq_id, []).append(HeadStep(
                    len(p.token_ids), not p.token_ids and bool(p.unverified_guesses),
                    int((verification.path[b] >= 0).sum()), st.base, st.drafted))
        return out

    proposer.read_forward = recording
    return seen


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_random_head_keeps_running_and_equals_plain(target, expected, device, tmp_path, tree):
    """A random head's guesses are rarely right, so the policy soon verifies none: the head still runs over the
    sequence's rows at every step, keeps its K/V from its first run and drafts one depth; greedy and seeded outputs
    are plain decoding's and every block returns."""
    config = head_config(draft_vocab_size=100)
    tensors = random_tensors(config, seed=2, embedding=False, hot=list(range(3, 203, 2)))
    llm = eagle_llm(target, write_head(tmp_path / "head", tensors, config), device, adaptive=True, tree=tree,
                    max_num_seqs=8)
    fixed_costs(llm, 0.3)
    seen = record_head_steps(llm)
    for j, params in enumerate(ALL_PARAMS):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j], j
    assert_head_blocks_returned(llm)
    assert any(step.declined for steps in seen.values() for step in steps), seen
    for steps in seen.values():
        assert len({step.base for step in steps}) == 1 and steps[0].base is not None, steps
        assert all(step.drafted for step in steps), steps


# ---------------------------------------------------------------- prompt lookup beside the head

@pytest.mark.parametrize("tree, adaptive", [(None, False), (TREE, True)], ids=["chain", "tree-adaptive"])
def test_prompt_lookup_joins_a_random_heads_guesses_and_equals_plain(target, expected, device, tmp_path, tree,
                                                                     adaptive):
    """A random head (its guesses rarely right) with the n-gram chain joined: one ranked tree per step, every path's
    prefix before it; greedy and seeded outputs are plain
    decoding's and every block returns."""
    config = head_config(draft_vocab_size=100)
    tensors = random_tensors(config, seed=2, embedding=False, hot=list(range(3, 203, 2)))
    llm = eagle_llm(target, write_head(tmp_path / "head", tensors, config), device, adaptive=adaptive,
                    tree={**(tree or {}), "prompt_lookup": True}, max_num_seqs=8)
    proposer = llm.engine.speculator.proposer
    assert proposer.max_tokens_per_step == (proposer.tree.num_nodes if tree else 3) + 3
    if adaptive:
        fixed_costs(llm, 0.3)
    seen, propose = [], proposer.propose

    def recording(seqs, depths):
        proposals = propose(seqs, depths)
        for seq, p in zip(seqs, proposals):
            paths = [tuple(path) for path in p.paths()]
            assert all(path[:-1] in paths[:i] for i, path in enumerate(paths) if len(path) > 1), paths
            assert p.chances is None or p.chances == sorted(p.chances, reverse=True)
            seen.append(len(set(paths) - seq.spec_state.drafted_paths))
        return proposals

    proposer.propose = recording
    for j, params in enumerate(ALL_PARAMS):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected[j], j
    assert_head_blocks_returned(llm)
    assert any(seen)  # proposals held n-gram paths the head did not draft
    if not adaptive:
        assert_guesses_accepted_and_rejected(llm)


def test_the_policy_prices_only_the_heads_guesses_as_drafting():
    """rank: each node's chance, and as its depth the head forwards verifying it costs: one more than the deepest of
    the head's guesses on its path (its pass over the step's rows, then its draft one depth deeper), none where the
    path holds only the n-gram chain's guesses; nodes deeper than asked left out."""
    proposer = Eagle3Proposer.__new__(Eagle3Proposer)
    seq = type("Seq", (), {})()
    seq.num_tokens = 10
    head = {(1,): 0.9, (1, 2): 0.5, (1, 2, 3): 0.2}
    chain = {(1,): 0.8, (1, 4): 0.64, (1, 4, 5): 0.51, (6,): 0.3}  # (the n-gram chain's, merged as join does)
    tree = Proposal.ranked({path: max(head.get(path, 0.0), chain.get(path, 0.0)) for path in {**head, **chain}})
    seq.spec_state = Eagle3State(num_tokens=10, ranked=tree, drafted_paths=frozenset(head))
    depth = {(1,): 2, (1, 2): 3, (1, 2, 3): 4, (1, 4): 2, (1, 4, 5): 2, (6,): 0}
    want = [(c, depth[tuple(path)]) for c, path in zip(tree.chances, tree.paths())]
    assert proposer.rank([seq], [3]) == [want]
    assert proposer.rank([seq], [2]) == [[(c, d) for (c, d), path in zip(want, tree.paths()) if len(path) <= 2]]
    seq.num_tokens = 11  # a stale tree: nothing
    assert proposer.rank([seq], [3]) == [[]]


def test_the_shipped_heads_prompt_lookup_is_served_and_can_be_set(tmp_path):
    """``prompt_lookup`` where the config leaves it out: the head directory's ``speculative_config.json``, else
    off; the config's own value wins."""
    from nanospec.speculative.config import parse_speculative_config
    (tmp_path / "speculative_config.json").write_text(json.dumps({"tree_top_k": 2, "prompt_lookup": True}))
    parsed = parse_speculative_config({"method": "eagle3", "model": str(tmp_path)})
    assert (parsed.tree_top_k, parsed.prompt_lookup) == (2, True)
    parsed = parse_speculative_config({"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3,
                                       "prompt_lookup": False})
    assert (parsed.num_speculative_tokens, parsed.tree_top_k, parsed.prompt_lookup) == (3, 1, False)
    (tmp_path / "speculative_config.json").write_text(json.dumps({"tree_top_k": 2}))
    assert parse_speculative_config({"method": "eagle3", "model": str(tmp_path)}).prompt_lookup is False


def test_after_a_declined_step_the_heads_guesses_are_accepted(target, successor_head, expected, device):
    """A policy that verifies every guess but at every fourth step: after each declined step the head, which kept
    its K/V, drafts again and its guesses are accepted on the next; the output is plain decoding's."""
    llm = eagle_llm(target, successor_head, device, adaptive=True, max_num_seqs=1)
    calls = []

    def every_guess_but_every_fourth_step(chances, num_tokens, num_seqs):
        calls.append(num_tokens)
        return [0 if len(calls) % 4 == 0 else len(c) for c in chances]

    llm.engine.speculator.policy.choose_nodes = every_guess_but_every_fourth_step
    seen = record_head_steps(llm)
    for i in (1, 2):
        assert llm.generate([PROMPTS[i]], GREEDY)[0].outputs[0].token_ids == expected[0][i]
    assert_head_blocks_returned(llm)
    after = [steps[i + 1] for steps in seen.values() for i in range(len(steps) - 1) if steps[i].declined]
    assert len(after) >= 2, seen
    assert all(step.drafted for steps in seen.values() for step in steps), seen
    assert sum(step.accepted > 0 for step in after) >= len(after) // 2, seen


# ---------------------------------------------------------------- penalties, log-probabilities, stops, n

# negative frequency / presence penalties and a repetition penalty < 1 make the tiny target repeat itself, so the
# penalized output differs from the unpenalized one the successor heads learned: guesses land and miss
PENALTIES = {"repetition_penalty": 0.8, "frequency_penalty": -0.6, "presence_penalty": 0.3, "logprobs": 2}
FEATURES = {"penalized_greedy": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **PENALTIES),
            "penalized_seeded": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=3, ignore_eos=True,
                                               **PENALTIES),
            "n3_seeded": SamplingParams(temperature=1.0, max_tokens=10, seed=7, n=3, logprobs=1, ignore_eos=True)}


@pytest.fixture(scope="module")
def plain_features(plain):
    """Plain decoding's outputs for each of ``FEATURES``, and its free runs (greedy, then ``SAMPLED[0]``) to choose
    stop strings and stop tokens from."""
    outputs = {name: plain.generate(PROMPTS, params) for name, params in FEATURES.items()}
    return outputs, [plain.generate(PROMPTS, params) for params in ALL_PARAMS[:2]]


@pytest.fixture(scope="module", params=["chain", "tree"])
def featured(request, target, successor_head, weighted_successor_head, device):
    """An eagle3 LLM that verifies every guess: a chain of 3, or a tree of width 3 and 10 nodes; decode and verify
    from static buffers (CUDA graphs on CUDA)."""
    if request.param == "chain":
        llm = eagle_llm(target, successor_head, device, max_num_seqs=8, enforce_eager=False)
    else:
        llm = eagle_llm(target, weighted_successor_head, device, tree=TREE, max_num_seqs=8, enforce_eager=False)
    yield llm
    assert llm.engine.runner.graphs  # the static path did run


def completions(outputs) -> list:
    """The completions of a list of ``RequestOutput`` s, one prompt's after another."""
    return [out for request in outputs for out in request.outputs]


def assert_same_outputs(got, want, what) -> None:
    """``RequestOutput`` s with as many completions each, whose token ids, text, finish reason and choice index are
    equal; log-probabilities (the target's, here from verify rows) equal within 1e-4 with the same top tokens."""
    assert [len(r.outputs) for r in got] == [len(r.outputs) for r in want], what
    got, want = completions(got), completions(want)
    assert [(o.token_ids, o.text, o.finish_reason, o.index) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason, o.index) for o in want], what
    for out, ref in zip(got, want):
        assert (out.logprobs is None) == (ref.logprobs is None), what
        for a, b in zip(out.logprobs or [], ref.logprobs or []):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, what
            assert [t for t, _ in a.top] == [t for t, _ in b.top], what


def test_penalties_logprobs_and_n_equal_plain(featured, plain_features):
    """Penalized greedy and seeded sampling with log-probabilities, and n = 3 seeded choices: plain decoding's
    outputs, alone and batched, with guesses accepted and rejected."""
    outputs, _ = plain_features
    drafted = accepted = 0
    for name, params in FEATURES.items():
        got = featured.generate(PROMPTS, params)
        assert_same_outputs(got, outputs[name], name)
        assert len(got) == len(PROMPTS) and all(len(r.outputs) == params.n for r in got), name
        drafted += sum(o.num_draft_tokens for o in completions(got))
        accepted += sum(o.num_accepted_tokens for o in completions(got))
        assert_same_outputs(featured.generate([PROMPTS[1]], params), outputs[name][1:2], name)
    assert 0 < accepted < drafted
    assert_head_blocks_returned(featured)


def test_stop_strings_stop_tokens_and_min_tokens_equal_plain(featured, plain, plain_features):
    """A stop string met in the middle of a step's accepted guesses ends the text before it; a stop token ends the
    output with it; ``min_tokens`` holds the stop token off: the same text, tokens and finish reason as plain
    decoding, greedy and seeded."""
    _, free_runs = plain_features
    checked = accepted = 0
    for base, free in zip(ALL_PARAMS[:2], map(completions, free_runs)):
        stops = [out.text[6:8] or "never appears" for out in free]
        for params in ([dataclasses.replace(base, stop=[stop, "never appears \x00"]) for stop in stops],
                       [dataclasses.replace(base, stop_token_ids=[out.token_ids[6]]) for out in free],
                       [dataclasses.replace(base, stop_token_ids=[out.token_ids[6]], min_tokens=12) for out in free]):
            want, got = plain.generate(PROMPTS, params), featured.generate(PROMPTS, params)
            assert_same_outputs(got, want, params[0])
            checked += sum(out.finish_reason == "stop" and len(out.token_ids) < base.max_tokens
                           for out in completions(want))
            accepted += sum(out.num_accepted_tokens for out in completions(got))
    assert checked >= 2 * 2 * len(PROMPTS)  # most requests did stop early
    assert accepted > 0
    assert_head_blocks_returned(featured)


# ---------------------------------------------------------------- the server

def test_server_equals_offline(target, successor_head, expected, plain_features, device):
    """The OpenAI-compatible server over an eagle3 LLM: a batch of completions (token-id prompts), and concurrent
    streams with penalties, log-probabilities, n and a stop string, equal plain decoding's."""
    import asyncio

    openai = pytest.importorskip("openai", reason="needs the server's client: pip install -e '.[test]'")
    from test_serve import _client, _idle, _wait_until, serving

    llm = eagle_llm(target, successor_head, device, max_num_seqs=8)
    penalized = FEATURES["penalized_seeded"]
    texts = [out.outputs[0].text for out in plain_features[0]["penalized_seeded"]]
    i = max(range(len(PROMPTS)), key=lambda i: len(texts[i]))  # a stop string from the middle of the longest text
    stop = texts[i][len(texts[i]) // 3:][:2]
    requests = [*((prompt, penalized) for prompt in PROMPTS), (PROMPTS[0], dataclasses.replace(penalized, n=2)),
                (PROMPTS[i], dataclasses.replace(penalized, stop=[stop]))]
    want = [llm.generate([prompt], dataclasses.replace(params, speculate=False))[0].outputs
            for prompt, params in requests]

    async def stream(client, prompt, params):
        chunks = await client.completions.create(
            model="tiny", prompt=prompt, stream=True, max_tokens=params.max_tokens, temperature=params.temperature,
            top_p=params.top_p, seed=params.seed, logprobs=params.logprobs, n=params.n, stop=params.stop,
            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
            extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": params.repetition_penalty})
        ids, logprobs, reasons = {}, {}, {}
        async for chunk in chunks:
            for choice in chunk.choices:
                ids.setdefault(choice.index, []).extend(choice.token_ids)
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
                reasons[choice.index] = choice.finish_reason
        return [(ids[i], logprobs[i], reasons[i]) for i in sorted(ids)]

    async def streams():
        async with _client(url, openai.AsyncOpenAI) as client:
            return await asyncio.gather(*[stream(client, prompt, params) for prompt, params in requests])

    with serving(llm) as url:
        got = _client(url).completions.create(model="tiny", prompt=PROMPTS, max_tokens=20, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
        assert [c.token_ids for c in got.choices] == expected[0]
        streamed = asyncio.run(streams())
        _wait_until(lambda: _idle(llm))
    assert want[-1][0].finish_reason == "stop" and len(want[-1][0].token_ids) < penalized.max_tokens
    for choices, outs in zip(streamed, want):
        assert [(ids, reason) for ids, _, reason in choices] == [(o.token_ids, o.finish_reason) for o in outs]
        for (_, logprobs, _), out in zip(choices, outs):
            assert logprobs == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
    assert 0 < llm.stats()["num_accepted_tokens"] < llm.stats()["num_draft_tokens"]
    assert_head_blocks_returned(llm)


@pytest.mark.slow
def test_the_shipped_head_serves_the_embedded_model():
    """``--speculative-config '{"method": "eagle3"}'``, no model: the head shipped for the embedded SmolLM2 (with its
    speculative_config.json's num_speculative_tokens), through the command line's arguments and the server; the
    chat's answer is plain decoding's."""
    from test_serve import _client, _idle, _wait_until, serving

    from nanospec.model.embedded import embedded_model_path
    from nanospec.serve.__main__ import parse_args
    from nanospec.speculative.eagle3 import SHIPPED_FOR_EMBEDDED, Eagle3Proposer

    try:
        embedded_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    served = json.loads((SHIPPED_FOR_EMBEDDED / "speculative_config.json").read_text())
    args = parse_args(["--speculative-config", '{"method": "eagle3", "adaptive": false}', "--dtype", "float32",
                       "--device", "cpu", "--num-blocks", "64"])
    llm = LLM.from_args(args.engine)
    proposer = llm.engine.speculator.proposer
    assert isinstance(proposer, Eagle3Proposer) and proposer.k == served["num_speculative_tokens"]
    assert (proposer.prompt_lookup is not None) == served.get("prompt_lookup", False)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with serving(llm) as url:
        chat = _client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
        _wait_until(lambda: _idle(llm))
    plain_answer = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, speculate=False))[0].outputs[0]
    assert chat.choices[0].message.content == plain_answer.text
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert_head_blocks_returned(llm)


# ---------------------------------------------------------------- refused heads

def _bad(config_changes: dict | None = None, tensor_changes: dict | None = None):
    def make(directory: Path) -> Path:
        config = head_config(**(config_changes or {}))
        tensors = random_tensors(head_config(draft_vocab_size=100), seed=0, embedding=False,
                                 hot=list(range(100)))
        for name, tensor in (tensor_changes or {}).items():
            if tensor is None:
                del tensors[name]
            else:
                tensors[name] = tensor
        if "draft_vocab_size" not in (config_changes or {}):
            config["draft_vocab_size"] = 100
        return write_head(directory, tensors, config)
    return make


BAD_HEADS = {
    "hidden_size": (_bad({"hidden_size": 32, "head_dim": 8}), r"hidden_size = 32 but the target's hidden_size is 64"),
    "target_hidden_size": (_bad({"target_hidden_size": 48}), r"target_hidden_size = 48 but the target's hidden_size"),
    "vocab_size": (_bad({"vocab_size": 400}), r"vocab_size = 400 but the target's vocab_size is 320"),
    "d2t_length": (_bad(tensor_changes={"d2t": torch.zeros(90, dtype=torch.int64)}),
                   r"tensor d2t has shape \(90,\), but config.json \(.*draft_vocab_size 100.*\) implies \(100,\)"),
    "d2t_missing": (_bad({"draft_vocab_size": 100}, {"d2t": None}),
                    r"missing tensors that config.json \(.*draft_vocab_size 100, vocab_size 320\) implies: d2t"),
    "d2t_range": (_bad(tensor_changes={"d2t": torch.full((100,), 300, dtype=torch.int64)}),
                  r"d2t maps a draft id outside the target's vocabulary \[0, 320\)"),
    "aux_ids": (_bad({"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}),
                r"eagle_aux_hidden_state_layer_ids = \[0, 1, 3\]: each must be a distinct layer id in \[0, 3\)"),
    "aux_ids_in_eagle_config": (_bad({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 5, 1]}}),
                                r"eagle_aux_hidden_state_layer_ids = \[0, 5, 1\]"),
    "head_dim": (_bad({"head_dim": 32}), r"tensor midlayer.self_attn.q_proj.weight has shape \(64, 128\), but "
                                         r"config.json \(.*head_dim 32.*\) implies \(128, 128\)"),
    "layers": (_bad({"num_hidden_layers": 2}), r"num_hidden_layers must be 1"),
    "architectures": (_bad({"architectures": ["LlamaForCausalLM"]}), r"architectures must be one of"),
}


@pytest.mark.parametrize("case", list(BAD_HEADS))
def test_a_head_that_does_not_fit_is_refused_naming_the_field(target, device, tmp_path, case):
    make, words = BAD_HEADS[case]
    directory = make(tmp_path / case)
    with pytest.raises(ValueError, match=words):
        eagle_llm(target, directory, device)


def test_a_truncated_head_file_is_refused_naming_it(target, device, tmp_path):
    head = write_head(tmp_path / "head", random_tensors(head_config(), seed=0, embedding=False), head_config())
    file = next(head.glob("*.safetensors"))
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"not a valid safetensors file: .*\.safetensors \(tensor .* is cut short"):
        eagle_llm(target, head, device)


def test_a_head_directory_without_config_is_refused_naming_it(target, device, tmp_path):
    head = write_head(tmp_path / "head", random_tensors(head_config(), seed=0, embedding=False), head_config())
    (head / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{head} has no config.json (an EAGLE-3 head directory")):
        eagle_llm(target, head, device)


def test_default_aux_layers_out_of_range_name_the_field(tmp_path, device):
    path = tmp_path / "two_layers"
    make_tiny_llama(path, seed=1, layers=2, hidden=HIDDEN, vocab=VOCAB)
    head = write_head(tmp_path / "head", random_tensors(head_config(), seed=0, embedding=False), head_config())
    with pytest.raises(ValueError, match=r"the default eagle_aux_hidden_state_layer_ids \(2, L // 2, L - 3\) for "
                                         r"L = 2 = \[2, 1, -1\]"):
        eagle_llm((path, None), head, device)


def test_config_errors(target, device, tmp_path):
    with pytest.raises(ValueError, match="needs 'model'"):  # no shipped head for a tiny random target
        LLM(str(target[0]), num_blocks=64, block_size=4, device=device, speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(speculative_config={"method": "eagle3", "model": 7})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(speculative_config={"method": "eagle3", "model": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(speculative_config={"method": "eagle3", "model": str(tmp_path), "max_candidates": 2})
    with pytest.raises(ValueError, match=r"\['prompt_lookup'\] must be True or False, got 'yes'"):
        LLM(speculative_config={"method": "eagle3", "model": str(tmp_path), "prompt_lookup": "yes"})
    with pytest.raises(ValueError, match=r"\['tree_top_k'\] must be an integer in \[1, 64\], got 0"):
        LLM(speculative_config={"method": "eagle3", "model": str(tmp_path), "tree_top_k": 0})


@pytest.mark.parametrize("tree, words", [
    ({"tree_budget": 6}, r"\['tree_budget'\] = 6 needs a tree: set 'tree_top_k' > 1"),
    ({"tree_top_k": 41}, r"\['tree_top_k'\] = 41 exceeds the head's draft_vocab_size \(40\)"),
    ({"tree_top_k": 2, "tree_budget": 11}, r"\['tree_budget'\] = 11 exceeds the nodes a tree of tree_top_k 2 and "
                                           r"num_speculative_tokens 3 generates \(10 = "),
], ids=["budget_without_tree", "width_over_draft_vocab", "budget_over_tree"])
def test_tree_config_errors_name_the_key(target, device, tmp_path, tree, words):
    config = head_config(draft_vocab_size=40)
    head = write_head(tmp_path / "head", random_tensors(config, seed=0, embedding=False, hot=list(range(40))),
                      config)
    with pytest.raises(ValueError, match=words):
        eagle_llm(target, head, device, tree=tree)
