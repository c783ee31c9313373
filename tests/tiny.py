"""Tiny random Llama checkpoints (transformers' LlamaForCausalLM, saved as an HF directory) for tests.

The tokenizer is byte-level BPE without merges (256 byte tokens + ChatML control tokens), so text
round-trips and chat templates render, with no model file needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nanospec.speculative.policy import GoodputPolicy

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_byte_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    specials = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab = dict(specials)
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def add_bos_to_tokenizer(out_dir: Path) -> None:
    """Make the tiny tokenizer.json's post-processor put BOS (<|im_start|>, id 1) in front of a text, as Llama's
    does; the chat template still writes its own <|im_start|>."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok.save(str(Path(out_dir) / "tokenizer.json"))


def make_tiny_llama(out_dir: Path, *, seed: int = 0, tie: bool = True, num_heads: int = 4, num_kv_heads: int = 2,
                    head_dim: int = 16, hidden: int = 64, layers: int = 2, vocab: int = 320, ffn: int = 96,
                    max_pos: int = 512, rope_scaling: dict | None = None, std: float = 0.2):
    """Write a random LlamaForCausalLM to ``out_dir``; returns the transformers model (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rope = {"rope_type": "default", "rope_theta": 10000.0} if rope_scaling is None else dict(rope_scaling)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                         max_position_embeddings=max_pos, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2, rope_parameters=rope)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than HF's init so that logits are far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    write_byte_tokenizer(out_dir)
    return model


def fixed_costs(llm, draft_cost: float) -> None:
    """The goodput policy over fixed costs (every target forward 1, each depth guessed ``draft_cost``): what it
    verifies then depends on the acceptance estimates alone, not on timings."""
    speculator = llm.engine.speculator
    k = speculator.max_tokens_per_step
    speculator.policy = GoodputPolicy(k, [1.0] * (k + 1), draft_cost)


def assert_no_leak(llm) -> None:
    """Every target KV block (and every draft KV block) is back in its pool; no request is left queued."""
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    draft_blocks = getattr(llm.engine.speculator.proposer, "block_manager", None)
    if draft_blocks is not None:
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks


def assert_prompt_logprobs_as_plain(outs, prompts, params_list, plain) -> None:
    """Each output whose parameters asked for ``prompt_logprobs`` reports its prompt's as ``plain`` (an LLM without
    speculation) does: None first, then the same tokens and log-probabilities (1e-4)."""
    asked = [(out, prompt, params) for out, prompt, params in zip(outs, prompts, params_list)
             if params.prompt_logprobs is not None]
    alone = plain.generate([prompt for _, prompt, _ in asked], [params for _, _, params in asked])
    for (out, _, _), reference in zip(asked, alone):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(reference.prompt_token_ids)
        for x, y in zip(out.prompt_logprobs[1:], reference.outputs[0].prompt_logprobs[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
    assert asked


# How far the K/V a sequence got step by step (decode, verify, draft backfill, a compacted tree path) may be from
# a fresh prefill's of the same tokens, in fp32. Not bit-identical, by design: the matmuls run over a different
# number of rows (1 or k+1 against n), and BLAS / cuBLAS pick different kernels (GEMV, split-K, other tiles) by
# shape, so the sums over the hidden size are added in another order; the Triton attention sees other tile shapes
# (BLOCK_R follows the query length). Each is a ~1e-7 relative rounding that the layers carry on. Measured on the
# CPU (oneDNN, torch reference): max |difference| ~1e-6 on values of size ~1-10, so 1e-5 there. On CUDA (cuBLAS
# kernels chosen by M, compiled Triton kernels) the same kind of rounding, with other kernels: 1e-4, stated and not
# measured here. A real bug (a wrong slot, a wrong RoPE position, a stale block) gives differences of order 1 (the
# values themselves): ``assert_same_kv`` also checks that K/V one slot off differ by far more than the tolerance,
# so the bound can tell such a bug from rounding.
KV_TOLERANCE = {"cpu": dict(rtol=1e-5, atol=1e-5), "cuda": dict(rtol=1e-4, atol=1e-4)}


def assert_same_kv(kv_cache, num_layers: int, slots: list[int], other_slots: list[int]) -> None:
    """The K and V at ``slots`` equal those at ``other_slots`` in every layer, to fp32 rounding (KV_TOLERANCE for
    the cache's device)."""
    assert len(slots) == len(other_slots) > 1
    for layer in range(num_layers):
        for cache in kv_cache.layer(layer):
            assert cache.dtype == torch.float32, "the KV tolerances are fp32's"
            tolerance = KV_TOLERANCE[cache.device.type]
            flat = cache.view(-1, *cache.shape[2:])
            ours, theirs = flat[slots], flat[other_slots]
            torch.testing.assert_close(ours, theirs, **tolerance)
            # the tolerance tells rounding from a bug: the K/V of the neighbouring token is far outside it
            one_off = (ours[1:] - theirs[:-1]).abs().amax().item()
            assert one_off > 100 * tolerance["atol"], f"layer {layer}: K/V one slot off differ by only {one_off}"


# ---------------------------------------------------------------- comparing tokens across backends / devices
# Two computations that round differently (Triton kernels against the torch reference, a GPU against transformers
# on the CPU, different devices) give logits that agree to ~1e-6 in fp32, not bit for bit. Greedy tokens then agree
# except where two candidates are tied to within that rounding: there either token is right, and from there on
# the two texts legitimately go apart. So token sequences from such computations are compared up to their first
# difference, which must be such a near tie in the reference's own logits (checked below), and no further.
# LOGITS_TOLERANCE is what the logits themselves must agree to (fp32, the CPU and CUDA without TF32: measured
# ~1e-6 on the CPU); NEAR_TIE, how close two candidates must be for a flip to be rounding: a flip needs their gap
# under twice the logits' disagreement, which at these logits' sizes (|x| < 10) is < 2e-3 only when the logits
# disagree beyond LOGITS_TOLERANCE's bound; 1e-3 leaves the margin and still fails a wrong token at any ordinary gap.
LOGITS_TOLERANCE = dict(rtol=1e-4, atol=1e-4)
NEAR_TIE = 1e-3


def _prefill(llm, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states (after its final norm, in the model's dtype) after every prefix of
    ``ids``, ``[len(ids), H]``, by one prefill on ``llm``'s device with the current backend, in blocks of the
    pool that are freed again."""
    from nanospec.model.forward_batch import build_forward_batch

    engine = llm.engine
    table: list[int] = []
    engine.block_manager.reserve(table, len(ids))
    try:
        batch = build_forward_batch([ids], [0], [table], engine.block_manager.block_size, [list(range(len(ids)))],
                                    llm.device)
        return llm.model.forward(batch, engine.kv_cache)
    finally:
        engine.block_manager.free(table)


def forward_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits after every prefix of ``ids``, ``[len(ids), V]`` (row i predicts token i + 1), by one prefill."""
    return llm.model.compute_logits(_prefill(llm, ids)).float()


def greedy_pick(logits_row: torch.Tensor, index: int) -> int:
    return int(logits_row.argmax())


def assert_same_tokens_up_to_a_near_tie(got: list[int], expected: list[int], reference_logits, pick=greedy_pick,
                                        near_tie: float = NEAR_TIE) -> int:
    """``got`` equals ``expected`` token for token, or up to a first difference (at output index i) that rounding
    explains: in the reference's logits for that position, ``reference_logits(i)`` (1-D, fp32, on any device),
    moving the two tokens' logits ``near_tie`` towards each other's side makes ``pick`` (argmax, or the seeded
    sampler at that position) choose either one. Past it nothing is compared (the contexts differ). Returns how
    many tokens were compared equal."""
    assert len(got) == len(expected), (got, expected)
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if first is None:
        return len(got)
    row = reference_logits(first).float().cpu()
    for winner, loser in ((got[first], expected[first]), (expected[first], got[first])):
        nudged = row.clone()
        nudged[winner] += near_tie
        nudged[loser] -= near_tie
        assert pick(nudged, first) == winner, (
            f"output token {first}: {got[first]} where {expected[first]} was expected, and that is no near tie "
            f"(logits {row[got[first]].item():.6f} and {row[expected[first]].item():.6f}, max {row.max().item():.6f})"
            f"\n got:      {got}\n expected: {expected}")
    return first


# ---------------------------------------------------------------- an MLP speculator that a tiny target accepts
def forward_hidden(llm, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states (after its final norm) after every prefix of ``ids``, ``[len(ids), H]``
    (row i is the state whose logits predict token i + 1), by one prefill as in :func:`forward_logits`."""
    return _prefill(llm, ids).float()


def successor_speculator(successors: dict[int, int], emb_dim: int, vocab_size: int, n_predict: int = 3):
    """An MLP speculator built by hand (no training) whose every stage guesses ``successors[t]`` after token ``t``
    (an arbitrary token after one outside the table): inner_dim = vocab_size, ``emb_i`` the identity, so after the
    norm and GELU the state is ``sqrt(V) * one_hot(t)`` up to the tiny ``proj_i`` term (the hidden state flows in,
    but cannot change a guess), and ``head_i[successors[t], t] = 1``. Guesses chain: t_2 = successors[t_1], ...
    Built from a target's own outputs, it guesses them often but not always."""
    from nanospec.model.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=emb_dim, inner_dim=vocab_size, n_predict=n_predict,
                                              vocab_size=vocab_size))
    head = torch.zeros(vocab_size, vocab_size)
    for token, successor in successors.items():
        head[successor, token] = 1.0
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(n_predict):
            model.emb[i].weight.copy_(torch.eye(vocab_size))
            model.proj[i].weight.copy_(1e-3 * torch.randn(model.proj[i].weight.shape, generator=generator))
            model.ln[i].weight.fill_(1.0)
            model.ln[i].bias.zero_()
            model.head[i].weight.copy_(head)
    return model


def most_common_successors(sequences: list[list[int]]) -> dict[int, int]:
    """Token -> the token that follows it most often in ``sequences`` (the first seen among equals)."""
    from collections import Counter

    counts: dict[int, Counter] = {}
    for ids in sequences:
        for token, successor in zip(ids, ids[1:]):
            counts.setdefault(token, Counter())[successor] += 1
    return {token: c.most_common(1)[0][0] for token, c in counts.items()}
