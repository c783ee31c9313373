"""Loading checkpoints: LlamaConfig <-> config.json, Hugging Face directories (single file, sharded, tied, untied),
GGUF files (a small one written here, and the embedded SmolLM2), and the errors for bad inputs.

transformers is the oracle for the HF layout; the comparison of the real GGUF with transformers' own GGUF loader
lives in test_convert.py (it shares one slow transformers load with the conversion checks).
"""

import json
import os

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file

from nanospec.model import embedded
from nanospec.model.config import LlamaConfig
from nanospec.model.embedded import INSTALL_COMMAND, embedded_model_path
from nanospec.model.gguf_file import read_gguf
from nanospec.model.loader import load_checkpoint
from nanospec.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=5000.0)


def write_tiny_tokenizer(directory):
    """A five-word tokenizer: enough for the loader, which needs a tokenizer.json next to the weights."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"}).save(directory)


def save_tiny_llama(directory, tied=False, max_shard_size=None, seed=0):
    """A random transformers LlamaForCausalLM saved with save_pretrained, plus a tokenizer. Returns the model."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    write_tiny_tokenizer(directory)
    return model


def expected_tensors(model, tied):
    state = {name: tensor for name, tensor in model.state_dict().items() if "rotary_emb" not in name}
    if tied:
        del state["lm_head.weight"]
    return state


# ---------------------------------------------------------------- config.json


def test_config_round_trips_through_transformers():
    hf = transformers.LlamaConfig(**TINY, eos_token_id=[2, 3], tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    config = LlamaConfig.from_hf_dict(hf.to_dict())
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (32, 2, 8)
    assert config.rope_theta == 5000.0 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_id == [2, 3] and config.tie_word_embeddings
    back = transformers.AutoConfig.for_model(**config.to_hf_dict())
    assert type(back) is transformers.LlamaConfig
    assert LlamaConfig.from_hf_dict(back.to_dict()) == config


def test_config_defaults_like_transformers():
    config = LlamaConfig.from_hf_dict({"hidden_size": 64, "num_attention_heads": 4, "eos_token_id": 7})
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert config.rope_theta == 10000.0 and config.rope_scaling is None and config.eos_token_id == [7]
    # transformers 4.x spells the scaling kind "type"; "default" means plain RoPE
    legacy = LlamaConfig.from_hf_dict({"rope_scaling": {"type": "linear", "factor": 4.0}})
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    transformers_5 = LlamaConfig.from_hf_dict({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert transformers_5.rope_theta == 1e6 and transformers_5.rope_scaling is None


@pytest.mark.parametrize("bad, named", [
    ({"model_type": "mistral"}, "mistral"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_config_rejects_other_models(bad, named):
    with pytest.raises(ValueError, match=named):
        LlamaConfig.from_hf_dict(bad)


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single", "sharded"])
def test_hf_directory_loads_like_transformers(tmp_path, tied, max_shard_size):
    model = save_tiny_llama(tmp_path, tied=tied, max_shard_size=max_shard_size)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)
    checkpoint = load_checkpoint(tmp_path, torch.float32)
    expected = expected_tensors(model, tied)
    assert checkpoint.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(checkpoint.tensors[name], tensor, rtol=0, atol=0, msg=name)
    assert checkpoint.config.tie_word_embeddings == tied and checkpoint.config.num_hidden_layers == 2
    assert checkpoint.path == tmp_path
    assert checkpoint.tokenizer.encode("hello world") == [3, 4] and checkpoint.tokenizer.eos_token_ids == [2]


def test_hf_directory_casts_to_dtype(tmp_path):
    model = save_tiny_llama(tmp_path)
    checkpoint = load_checkpoint(tmp_path, torch.bfloat16)
    assert {t.dtype for t in checkpoint.tensors.values()} == {torch.bfloat16}
    torch.testing.assert_close(checkpoint.tensors["model.norm.weight"], model.model.norm.weight.detach().bfloat16())


def test_hf_directory_reads_generation_config_and_chat_template_file(tmp_path):
    save_tiny_llama(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer = load_checkpoint(tmp_path, torch.float32).tokenizer
    assert tokenizer.eos_token_ids == [2, 4]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


# ---------------------------------------------------------------- GGUF


def llama_cpp_permute(weight, num_heads):
    """What llama.cpp's converter does to q/k rows (HF -> GGUF); read_gguf must undo it."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_gguf(path, state, architecture="llama", skip=(), extra_tensors=None, float16=False):
    """A small GGUF as llama.cpp writes one: llama metadata, a byte-level BPE vocabulary, permuted q/k rows."""
    c = TINY
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(c["vocab_size"])
    tokens = ["<|endoftext|>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)] + ["Ġ", "he", "Ġhe"]
    tokens += [f"<extra_{i}>" for i in range(c["vocab_size"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["h e", "Ġ he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, tensor in state.items():
        if name in skip:
            continue
        if name in names:
            gguf_name = names[name]
        else:
            _, _, layer, *module, _ = name.split(".")
            gguf_name = f"blk.{layer}.{layer_names['.'.join(module)]}.weight"
        array = tensor.numpy()
        if gguf_name.endswith("attn_q.weight"):
            array = llama_cpp_permute(array, c["num_attention_heads"])
        if gguf_name.endswith("attn_k.weight"):
            array = llama_cpp_permute(array, c["num_key_value_heads"])
        writer.add_tensor(gguf_name, np.ascontiguousarray(array.astype(np.float16 if float16 else np.float32)))
    for gguf_name, array in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_state():
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    return expected_tensors(model, tied=False)


@pytest.mark.parametrize("float16", [False, True], ids=["f32", "f16"])
def test_read_gguf_undoes_llama_cpp_layout(tmp_path, tiny_state, float16):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state, float16=float16)
    model = read_gguf(tmp_path / "tiny.gguf")
    assert model.tensors.keys() == tiny_state.keys()
    for name, tensor in tiny_state.items():
        expected = tensor.half().float() if float16 else tensor
        torch.testing.assert_close(model.tensors[name], expected, rtol=0, atol=0, msg=name)
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert not config.tie_word_embeddings and config.rope_theta == 5000.0 and config.eos_token_id == [2]
    tokenizer = Tokenizer.from_json_str(model.tokenizer_json, model.tokenizer_config)
    assert tokenizer.add_bos_token and tokenizer.encode("hehe he</s>", add_special_tokens=True) == [1, 30, 30, 31, 2]
    assert tokenizer.decode([1, 30, 31, 2]) == "he he"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_load_checkpoint_reads_gguf_and_casts(tmp_path, tiny_state):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state)
    checkpoint = load_checkpoint(tmp_path / "tiny.gguf", torch.bfloat16)
    assert {t.dtype for t in checkpoint.tensors.values()} == {torch.bfloat16}
    torch.testing.assert_close(checkpoint.tensors["lm_head.weight"], tiny_state["lm_head.weight"].bfloat16())
    assert checkpoint.tokenizer.bos_token_id == 1 and checkpoint.tokenizer.eos_token_ids == [2]


def test_gguf_errors_name_the_problem(tmp_path, tiny_state):
    write_tiny_gguf(tmp_path / "qwen.gguf", tiny_state, architecture="qwen2")
    with pytest.raises(ValueError, match="'qwen2'"):
        load_checkpoint(tmp_path / "qwen.gguf", torch.float32)
    write_tiny_gguf(tmp_path / "missing.gguf", tiny_state, skip={"model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path / "missing.gguf", torch.float32)
    rope_freqs = {"rope_freqs.weight": np.ones(4, dtype=np.float32)}
    write_tiny_gguf(tmp_path / "llama31.gguf", tiny_state, extra_tensors=rope_freqs)
    with pytest.raises(ValueError, match="rope_freqs"):
        load_checkpoint(tmp_path / "llama31.gguf", torch.float32)


# ---------------------------------------------------------------- the embedded SmolLM2


@pytest.fixture(scope="module")
def embedded_checkpoint():
    return load_checkpoint(None, torch.bfloat16)


def test_embedded_smollm2_loads(embedded_checkpoint):
    config = embedded_checkpoint.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.max_position_embeddings) == (49152, 100000.0, 8192)
    assert config.tie_word_embeddings and "lm_head.weight" not in embedded_checkpoint.tensors
    assert embedded_checkpoint.tensors.keys() == config.weight_shapes().keys()
    assert all(t.dtype == torch.bfloat16 for t in embedded_checkpoint.tensors.values())
    assert sum(t.numel() for t in embedded_checkpoint.tensors.values()) == 134_515_008
    assert embedded_checkpoint.path == embedded_model_path()
    tokenizer = embedded_checkpoint.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.add_bos_token) == (1, [2], False)


def test_embedded_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=INSTALL_COMMAND):
        embedded_model_path()


# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere", torch.float32)


def test_directory_without_config(tmp_path):
    write_tiny_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path, torch.float32)


def test_directory_without_weights(tmp_path):
    save_tiny_llama(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(tmp_path, torch.float32)


def test_junk_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=f"not a valid GGUF file: {path}"):
        load_checkpoint(path, torch.float32)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(embedded_model_path(), "rb") as f:
        path.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match=f"not a valid GGUF file: {path}"):
        load_checkpoint(path, torch.float32)


def test_truncated_tiny_gguf_data(tmp_path, tiny_state):
    """Cut inside the tensor data, past all metadata: caught before dequantizing."""
    write_tiny_gguf(tmp_path / "whole.gguf", tiny_state)
    data = (tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:-1000])
    with pytest.raises(ValueError, match=f"not a valid GGUF file: {path}"):
        load_checkpoint(path, torch.float32)


def test_junk_safetensors(tmp_path):
    save_tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=f"not a valid safetensors file: {path}"):
        load_checkpoint(tmp_path, torch.float32)


def test_truncated_safetensors(tmp_path):
    save_tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"not a valid safetensors file: {path}"):
        load_checkpoint(path.parent, torch.float32)


def test_missing_tensor(tmp_path):
    save_tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_checkpoint(tmp_path, torch.float32)


def test_wrong_tensor_shape(tmp_path):
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 50
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(48, 32\)"):
        load_checkpoint(tmp_path, torch.float32)


def test_shard_index_with_missing_file(tmp_path):
    save_tiny_llama(tmp_path, max_shard_size="20KB")
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    os.remove(tmp_path / shard)
    with pytest.raises(ValueError, match=shard):
        load_checkpoint(tmp_path, torch.float32)


def test_not_a_llama(tmp_path):
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gpt2"):
        load_checkpoint(tmp_path, torch.float32)
