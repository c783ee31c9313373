"""Tiny random Llama checkpoints (transformers' LlamaForCausalLM, saved as an HF directory) for tests.

The tokenizer is byte-level BPE without merges (256 byte tokens + ChatML control tokens), so text
round-trips and chat templates render, with no model file needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

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


def assert_no_leak(llm) -> None:
    """Every target KV block (and every draft KV block) is back in its pool; no request is left queued."""
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    draft_blocks = getattr(llm.engine.speculator.proposer, "block_manager", None)
    if draft_blocks is not None:
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks


def assert_same_kv(kv_cache, num_layers: int, slots: list[int], other_slots: list[int]) -> None:
    """The K and V at ``slots`` equal those at ``other_slots`` in every layer."""
    for layer in range(num_layers):
        for cache in kv_cache.layer(layer):
            flat = cache.view(-1, *cache.shape[2:])
            torch.testing.assert_close(flat[slots], flat[other_slots], rtol=1e-5, atol=1e-5)
