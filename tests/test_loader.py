"""Loading checkpoints: LlamaConfig <-> config.json, Hugging Face directories (single file, sharded, tied, untied),
GGUF files (a small one written here, and the embedded SmolLM2), and the errors for bad inputs: corrupt, truncated
or absurd files are refused quickly (before any weight is read), by a ValueError naming the file and the field or
tensor at fault.

transformers is the oracle for the HF layout; the comparison of the real GGUF with transformers' own GGUF loader
lives in test_convert.py (it shares one slow transformers load with the conversion checks).
"""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import struct
import sys

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file

from nanospec.kernels.rope import ROPE_SCALING_KEYS, build_rope_cache
from nanospec.model import embedded, gguf_file, loader
from nanospec.model.config import LIMITS, LlamaConfig
from nanospec.model.embedded import INSTALL_COMMAND, embedded_model_path
from nanospec.model.gguf_file import read_gguf
from nanospec.model.loader import load_checkpoint
from nanospec.tokenizer import Tokenizer
from tiny import make_tiny_llama

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


def tiny_gguf_metadata(architecture="llama"):
    """The metadata llama.cpp writes for TINY, with a byte-level BPE vocabulary (general.architecture aside)."""
    c, arch = TINY, architecture
    tokens = ["<|endoftext|>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)] + ["Ġ", "he", "Ġhe"]
    tokens += [f"<extra_{i}>" for i in range(c["vocab_size"] - len(tokens))]
    return {
        f"{arch}.block_count": c["num_hidden_layers"],
        f"{arch}.context_length": c["max_position_embeddings"],
        f"{arch}.embedding_length": c["hidden_size"],
        f"{arch}.feed_forward_length": c["intermediate_size"],
        f"{arch}.attention.head_count": c["num_attention_heads"],
        f"{arch}.attention.head_count_kv": c["num_key_value_heads"],
        f"{arch}.rope.freq_base": c["rope_theta"],
        f"{arch}.attention.layer_norm_rms_epsilon": c["rms_norm_eps"],
        f"{arch}.vocab_size": c["vocab_size"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["h e", "Ġ he"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}",
    }


def gguf_type(value):
    """The GGUF type llama.cpp would write `value` as (integers as UINT32 when they fit)."""
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        if 0 <= value < 1 << 32:
            return gguf.GGUFValueType.UINT32
        return gguf.GGUFValueType.UINT64 if value > 0 else gguf.GGUFValueType.INT64
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY


def write_tiny_gguf(path, state, architecture="llama", skip=(), extra_tensors=None, float16=False, metadata=None):
    """A small GGUF as llama.cpp writes one: llama metadata, a byte-level BPE vocabulary, permuted q/k rows.
    `metadata` changes keys of tiny_gguf_metadata (a value of None drops the key); `skip` leaves tensors out."""
    c = TINY
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in {**tiny_gguf_metadata(architecture), **(metadata or {})}.items():
        if value is not None:
            sub_type = gguf_type(value[0]) if isinstance(value, list) else None
            writer.add_key_value(key, value, gguf_type(value), sub_type)
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


def test_gguf_metadata_without_arrays_is_the_metadata_less_its_arrays(tmp_path, tiny_state):
    """read_gguf_metadata steps over array values (the tokenizer's, an array of arrays, of numbers) unread and reads
    the keys after them as the full header read does."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_state, metadata={"test.nested": [[1, 2], [3]], "test.numbers": [1.5, 2.5],
                                                "test.after": "the last key"})
    full = gguf_file._read_header(path)[0]
    assert {k: v for k, v in full.items() if not isinstance(v, list)} == gguf_file.read_gguf_metadata(path)
    assert full["test.nested"] == [[1, 2], [3]] and full["tokenizer.ggml.tokens"]
    assert gguf_file.read_gguf_metadata(path)["test.after"] == "the last key"
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        gguf_file.read_gguf_metadata(tmp_path / "missing.gguf")


def test_load_checkpoint_reads_gguf_and_casts(tmp_path, tiny_state):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state)
    checkpoint = load_checkpoint(tmp_path / "tiny.gguf", torch.bfloat16)
    assert {t.dtype for t in checkpoint.tensors.values()} == {torch.bfloat16}
    torch.testing.assert_close(checkpoint.tensors["lm_head.weight"], tiny_state["lm_head.weight"].bfloat16())
    assert checkpoint.tokenizer.bos_token_id == 1 and checkpoint.tokenizer.eos_token_ids == [2]


def test_open_checkpoint_reads_no_tensor(tmp_path, tiny_state, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state)
    save_tiny_llama(tmp_path / "hf")
    expected = {path: load_checkpoint(path, None).config for path in (tmp_path / "tiny.gguf", tmp_path / "hf")}
    monkeypatch.setattr(loader, "safe_open", forbidden("open the weights of"))
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    for path, config in expected.items():
        assert loader.open_checkpoint(path).config == config
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        loader.open_checkpoint(tmp_path / "nope")


def test_gguf_draft_header_is_parsed_once(tmp_path, tiny_state, monkeypatch, device):
    """A GGUF draft's header is parsed once: the engine's checks open it (config, tokenizer) and the draft proposer
    reads the tensors of that same parse."""
    from nanospec import LLM

    write_tiny_gguf(tmp_path / "target.gguf", tiny_state)
    shutil.copy(tmp_path / "target.gguf", tmp_path / "draft.gguf")
    parses = []
    read_header = gguf_file._read_header
    monkeypatch.setattr(gguf_file, "_read_header", lambda path, *args, **kwargs: parses.append(path.name) or
                        read_header(path, *args, **kwargs))
    llm = LLM(str(tmp_path / "target.gguf"), device=device, dtype="float32", num_blocks=32,
              speculative_config={"method": "draft", "model": str(tmp_path / "draft.gguf"), "adaptive": False})
    assert parses.count("draft.gguf") == 1
    assert llm.engine.speculator.proposer.model.config == llm.config


def test_gguf_errors_name_the_problem(tmp_path, tiny_state):
    write_tiny_gguf(tmp_path / "qwen.gguf", tiny_state, architecture="qwen2")
    with pytest.raises(ValueError, match="'qwen2'"):
        load_checkpoint(tmp_path / "qwen.gguf", torch.float32)
    write_tiny_gguf(tmp_path / "missing.gguf", tiny_state, skip={"model.layers.1.mlp.up_proj.weight"})
    refused(tmp_path / "missing.gguf", "missing tensors that the metadata implies: blk.1.ffn_up.weight")
    for extra in ("blk.2.attn_norm.weight", "token_types.weight"):  # a layer beyond llama.block_count, a stray name
        write_tiny_gguf(tmp_path / "extra.gguf", tiny_state, extra_tensors={extra: np.ones(32, dtype=np.float32)})
        refused(tmp_path / "extra.gguf", "unexpected tensors, which the metadata has no place for: " + extra)
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


def test_directory_without_config_hints_at_gguf_files_not_folders(tmp_path):
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(FileNotFoundError) as error:
        load_checkpoint(tmp_path, torch.float32)
    assert str(error.value) == f"{tmp_path} has no config.json"
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="pass the file itself, e.g. .*model.gguf"):
        load_checkpoint(tmp_path, torch.float32)


def test_empty_path_refused():
    with pytest.raises(ValueError, match="the model path is empty"):
        load_checkpoint("", torch.float32)


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


def test_truncated_tiny_gguf_data(tmp_path, tiny_state, monkeypatch):
    """Cut inside the tensor data, past all metadata: caught before dequantizing, naming the tensor cut short (the
    last one written, lm_head)."""
    write_tiny_gguf(tmp_path / "whole.gguf", tiny_state)
    data = (tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:-1000])
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantizing"))
    with pytest.raises(ValueError, match=f"not a valid GGUF file: {re.escape(str(path))} "
                                         r"\(tensor output\.weight is cut short"):
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
    data = path.read_bytes()
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_size])
    last = max((name for name in header if name != "__metadata__"), key=lambda name: header[name]["data_offsets"][1])
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=f"not a valid safetensors file: {re.escape(str(path))} "
                                         f"\\(tensor {re.escape(last)} is cut short"):
        load_checkpoint(path.parent, torch.float32)


def test_missing_tensor(tmp_path):
    save_tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    refused(tmp_path, path, "missing tensors that config.json implies: model.layers.1.self_attn.k_proj.weight")


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_proj.bias", "model.layers.2.mlp.up_proj.weight"])
def test_tensor_the_config_has_no_place_for_refused(tmp_path, monkeypatch, extra):
    """A bias (attention_bias left out of config.json) or a layer beyond num_hidden_layers: refused by name before
    any weight is read, as vLLM refuses it, rather than dropped to run another model."""
    save_tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors[extra] = torch.zeros(48 if "up_proj" in extra else 32, *((32,) if "up_proj" in extra else ()))
    save_file(tensors, path, metadata={"format": "pt"})
    monkeypatch.setattr(loader, "all_finite", forbidden("read the weights of"))
    refused(tmp_path, path, "unexpected tensors, which config.json has no place for:", extra)


def test_tensors_transformers_skips_are_skipped(tmp_path):
    """The RoPE frequencies older transformers saved, and lm_head.weight beside a tied embedding."""
    model = save_tiny_llama(tmp_path, tied=True)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    tensors["lm_head.weight"] = torch.zeros(TINY["vocab_size"], TINY["hidden_size"])
    save_file(tensors, path, metadata={"format": "pt"})
    checkpoint = load_checkpoint(tmp_path, torch.float32)
    assert checkpoint.tensors.keys() == expected_tensors(model, tied=True).keys()


def test_wrong_tensor_shape(tmp_path):
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 50
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused(tmp_path, f"{tmp_path / 'model.safetensors'}: tensor model.layers.0.mlp.gate_proj.weight has shape "
                      "(48, 32), but config.json implies (50, 32)")


def test_shard_index_with_missing_file(tmp_path):
    save_tiny_llama(tmp_path, max_shard_size="20KB")
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    os.remove(tmp_path / shard)
    with pytest.raises(ValueError, match=shard):
        load_checkpoint(tmp_path, torch.float32)


def test_tensor_stored_in_two_shards_refused(tmp_path):
    save_tiny_llama(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    other = next(shard for shard in sorted(set(weight_map.values())) if shard != weight_map["model.norm.weight"])
    tensors = load_file(tmp_path / other)
    tensors["model.norm.weight"] = torch.zeros(TINY["hidden_size"])
    save_file(tensors, tmp_path / other, metadata={"format": "pt"})
    refused(tmp_path, "tensor model.norm.weight is stored twice", weight_map["model.norm.weight"], other)


def test_not_a_llama(tmp_path):
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gpt2"):
        load_checkpoint(tmp_path, torch.float32)


# ---------------------------------------------------------------- corrupt and absurd files: refused quickly and clearly


def forbidden(what):
    """A stand-in for a function the loader must not reach (it fails the test if called)."""
    def fail(*args, **kwargs):
        raise AssertionError(f"the loader went on to {what} a file it should have refused")
    return fail


@contextlib.contextmanager
def within(seconds):
    """Fail the test if its block takes longer than `seconds`: an alarm interrupts a hang instead of waiting it out."""
    def too_slow(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")
    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refused(path, *named):
    """Load `path` (within 10 s) and return the ValueError's message, checked to name every string in `named`."""
    with within(10), pytest.raises(ValueError) as error:
        load_checkpoint(path, torch.float32)
    message = str(error.value)
    for name in named:
        assert str(name) in message, f"{name!r} not named in: {message}"
    return message


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny HF directory (tests/tiny.py), copied by each test that corrupts it."""
    directory = tmp_path_factory.mktemp("tiny_hf")
    make_tiny_llama(directory, vocab=320, layers=2)
    return directory


def corrupt_copy(tiny_hf, tmp_path, **changes):
    """A copy of tiny_hf whose config.json has `changes` (a value of None drops the key). Returns the config's path."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_hf, directory)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    config_file.write_text(json.dumps(config))
    return config_file


@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", "32"),  # a string
    ("num_hidden_layers", True),  # a bool is not an int
    ("num_hidden_layers", -1),
    ("num_hidden_layers", 10**9),
    ("max_position_embeddings", 1 << 40),
    ("vocab_size", 0),
    ("hidden_size", 1 << 20),
    ("intermediate_size", 2.5),
    ("num_attention_heads", 0),
    ("num_key_value_heads", 3),  # does not divide the 4 query heads
    ("head_dim", 7),  # odd: rotary embeddings rotate pairs
    ("head_dim", 1 << 16),
    ("rms_norm_eps", -1e-5),
    ("rope_theta", "10000"),
    ("eos_token_id", 320),  # the vocabulary is 0..319
    ("eos_token_id", [2, -1]),
    ("bos_token_id", 1 << 31),
    ("bos_token_id", [1, 2]),  # one id, not a list
    ("tie_word_embeddings", "false"),
    ("rope_scaling", {"rope_type": "linear", "factor": -2.0}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),  # lacks low_freq_factor, ...
])
def test_config_json_with_bad_value_refused(tiny_hf, tmp_path, monkeypatch, field, value):
    config_file = corrupt_copy(tiny_hf, tmp_path, **{field: value})
    monkeypatch.setattr(loader, "safe_open", forbidden("open the weights of"))
    message = refused(config_file.parent, config_file, field)
    bad = value if not isinstance(value, (list, dict)) else {"eos_token_id": -1, "bos_token_id": [1, 2]}.get(field)
    if bad is not None:
        assert f"got {bad!r}" in message


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_config_json_with_unsupported_rope_scaling_refused(tiny_hf, tmp_path, monkeypatch, kind):
    config_file = corrupt_copy(tiny_hf, tmp_path, rope_scaling={"rope_type": kind, "factor": 2.0})
    monkeypatch.setattr(loader, "safe_open", forbidden("open the weights of"))
    refused(config_file.parent, f"{config_file}: rope_scaling.rope_type must be a RoPE scaling nanospec supports "
                                f"(default, linear, llama3), got {kind!r}")


def test_config_json_of_a_quantized_checkpoint_refused(tiny_hf, tmp_path, monkeypatch):
    config_file = corrupt_copy(tiny_hf, tmp_path, quantization_config={"quant_method": "gptq", "bits": 4})
    monkeypatch.setattr(loader, "safe_open", forbidden("open the weights of"))
    refused(config_file.parent, f"{config_file}: unsupported quantization_config (quant_method 'gptq')")


def test_check_config_runs_before_any_weight_is_read(tiny_hf, tiny_state, tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state)
    monkeypatch.setattr(loader, "safe_open", forbidden("open the weights of"))
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))

    def refuse(config):
        raise ValueError(f"too short a context: {config.max_position_embeddings}")

    for path in (tiny_hf, tmp_path / "tiny.gguf"):
        with pytest.raises(ValueError, match="too short a context"):
            load_checkpoint(path, torch.float32, check_config=refuse)


@pytest.mark.parametrize("kind", ROPE_SCALING_KEYS)
def test_every_rope_scaling_the_config_accepts_the_rope_table_computes(kind):
    numbers = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(rope_scaling={"rope_type": kind} | {key: numbers[key] for key in ROPE_SCALING_KEYS[kind]})
    assert build_rope_cache(config.head_dim, 16, config.rope_theta, config.rope_scaling).isfinite().all()


def test_config_json_lacking_a_required_field_refused(tiny_hf, tmp_path, monkeypatch):
    config_file = corrupt_copy(tiny_hf, tmp_path, num_hidden_layers=None)
    monkeypatch.setattr(loader, "safe_open", forbidden("open the weights of"))
    refused(config_file.parent, config_file, "'num_hidden_layers' is missing")


def test_config_json_with_heads_not_dividing_hidden_refused(tiny_hf, tmp_path):
    config_file = corrupt_copy(tiny_hf, tmp_path, head_dim=None, num_attention_heads=3, num_key_value_heads=3)
    refused(config_file.parent, config_file, "hidden_size must be a multiple of num_attention_heads (3)", "got 64")


@pytest.mark.parametrize("text", ["{not json", "[64, 2]"], ids=["not-json", "not-an-object"])
def test_config_json_that_is_not_a_json_object_refused(tiny_hf, tmp_path, text):
    config_file = corrupt_copy(tiny_hf, tmp_path)
    config_file.write_text(text)
    refused(config_file.parent, f"not a valid JSON file: {config_file}")


def test_limits_are_sane():
    """The bounds admit every real Llama (these are Llama 3.1 405B's numbers, and a 10M-token context) and refuse
    what only a corrupt file holds."""
    real = dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                vocab_size=128256, head_dim=128, max_position_embeddings=10_000_000, num_key_value_heads=8)
    for field, value in real.items():
        low, high = LIMITS[field]
        assert low <= value <= high, field
    LlamaConfig(**real)
    with pytest.raises(ValueError, match="num_hidden_layers must be an integer from 1 to 1024, got 1025"):
        LlamaConfig(num_hidden_layers=1025)


def test_generation_config_with_eos_outside_vocabulary_refused(tiny_hf, tmp_path):
    config_file = corrupt_copy(tiny_hf, tmp_path)
    generation_file = config_file.parent / "generation_config.json"
    generation_file.write_text(json.dumps({"eos_token_id": [2, 5000]}))
    refused(config_file.parent, generation_file, "eos_token_id", "got 5000")


@pytest.mark.parametrize("file_name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_file_that_is_not_json_refused(tiny_hf, tmp_path, file_name):
    config_file = corrupt_copy(tiny_hf, tmp_path)
    (config_file.parent / file_name).write_text("{not json")
    refused(config_file.parent, config_file.parent / file_name)


@pytest.mark.parametrize("field, value, named", [
    ("chat_template", [{"template": "x"}], "chat_template: a list of templates"),
    ("chat_template", 5, "chat_template must be a string"),
    ("chat_template", "{{ messages | nosuchfilter }}", "the chat template does not compile: No filter named"),
    ("chat_template", "{% for m in messages %}{{ m }", "the chat template does not compile"),
    ("bos_token", 5, "bos_token must be a token"),
])
def test_tokenizer_config_with_bad_value_refused_before_the_weights(tiny_hf, tmp_path, monkeypatch, field, value,
                                                                      named):
    tokenizer_config = corrupt_copy(tiny_hf, tmp_path).parent / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), field: value}))
    monkeypatch.setattr(loader, "safe_open", forbidden("open the weights of"))
    assert "tokenizer.json" not in refused(tokenizer_config.parent, tokenizer_config, named).replace(
        "tokenizer_config.json", "")


def test_shard_index_with_bad_weight_map_refused(tiny_hf, tmp_path):
    config_file = corrupt_copy(tiny_hf, tmp_path)
    index = config_file.parent / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    refused(config_file.parent, index, "weight_map")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_weight_with_nan_or_inf_refused(tiny_hf, tmp_path, bad, dtype):
    config_file = corrupt_copy(tiny_hf, tmp_path)
    path = config_file.parent / "model.safetensors"
    tensors = {name: tensor.to(dtype) for name, tensor in load_file(path).items()}
    tensors["model.layers.1.mlp.down_proj.weight"][5, 7] = bad
    save_file(tensors, path, metadata={"format": "pt"})
    refused(config_file.parent, "tensor model.layers.1.mlp.down_proj.weight", path, "NaN or infinite")


def test_safetensors_weight_with_integer_dtype_refused(tiny_hf, tmp_path, monkeypatch):
    config_file = corrupt_copy(tiny_hf, tmp_path)
    path = config_file.parent / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    refused(config_file.parent, "tensor model.norm.weight", path, "dtype I32")


# GGUF


def patch_gguf(path, key, value, fmt="<I", array_count=False):
    """Overwrite, in place, the scalar value of metadata `key` (struct format `fmt`), or the count of the array it
    holds: the bytes after the key's name are its type (u32), then the value, or for an array its item type (u32) and
    count (u64)."""
    data = bytearray(path.read_bytes())
    name = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(name) + len(name) + 4
    if array_count:
        at, fmt = at + 4, "<Q"
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(data)


@pytest.mark.parametrize("key, value, named", [
    ("llama.block_count", 1 << 31, "llama.block_count must be an integer from 1 to 1024, got 2147483648"),
    ("llama.block_count", "2", "llama.block_count must be an integer from 1 to 1024, got '2'"),
    ("llama.block_count", True, "llama.block_count must be an integer from 1 to 1024, got True"),
    ("llama.block_count", None, "lacks the metadata key 'llama.block_count'"),
    ("llama.context_length", 1 << 40, "llama.context_length must be an integer from 1 to 16777216, got 1099511627776"),
    ("llama.context_length", None, "lacks the metadata key 'llama.context_length'"),
    ("llama.vocab_size", 1 << 30, "llama.vocab_size must be an integer from 1 to 4194304, got 1073741824"),
    ("llama.embedding_length", 0, "llama.embedding_length must be an integer from 1 to 65536, got 0"),
    ("llama.feed_forward_length", -48, "llama.feed_forward_length must be an integer from 1 to 262144, got -48"),
    ("llama.attention.head_count", 6, "llama.embedding_length must be a multiple of num_attention_heads (6)"),
    ("llama.attention.head_count_kv", 3, "llama.attention.head_count_kv must be a divisor of num_attention_heads (4)"),
    ("llama.attention.key_length", 7, "llama.attention.key_length must be even"),
    ("llama.rope.freq_base", float("nan"), "llama.rope.freq_base must be a number above 1 and at most 1e+12, got nan"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, "llama.attention.layer_norm_rms_epsilon must be a number above 0"),
    ("tokenizer.ggml.eos_token_id", 64, "tokenizer.ggml.eos_token_id must be a token id from 0 to 63"),
    ("tokenizer.ggml.eot_token_id", 1000, "tokenizer.ggml.eot_token_id must be a token id from 0 to 63"),
    ("tokenizer.ggml.bos_token_id", [1, 2], "tokenizer.ggml.bos_token_id must be a token id"),
])
def test_gguf_with_bad_metadata_refused(tmp_path, tiny_state, monkeypatch, key, value, named):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, tiny_state, metadata={key: value})
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    refused(path, path, named)


def test_gguf_rope_scaling(tmp_path, tiny_state, monkeypatch):
    scaling = {"llama.rope.scaling.factor": 4.0, "llama.rope.scaling.original_context_length": 32}
    write_tiny_gguf(tmp_path / "linear.gguf", tiny_state, metadata={"llama.rope.scaling.type": "linear", **scaling})
    assert read_gguf(tmp_path / "linear.gguf").config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    write_tiny_gguf(tmp_path / "yarn.gguf", tiny_state, metadata={"llama.rope.scaling.type": "yarn", **scaling})
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    path = tmp_path / "yarn.gguf"
    refused(path, f"GGUF file {path}: llama.rope.scaling.type must be a RoPE scaling nanospec supports (default, "
                  "linear, llama3), got 'yarn'")


@pytest.mark.parametrize("metadata, scaling", [
    ({"llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # llama.cpp's kind by default
    ({"llama.rope.scale_linear": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # llama.cpp's older key
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, None),  # 0: no scaling, as llama.cpp
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
])
def test_gguf_rope_scaling_read_as_llama_cpp_reads_it(tmp_path, tiny_state, metadata, scaling):
    write_tiny_gguf(tmp_path / "scaled.gguf", tiny_state, metadata=metadata)
    assert read_gguf(tmp_path / "scaled.gguf").config.rope_scaling == scaling


def test_gguf_bad_old_rope_scale_key_named(tmp_path, tiny_state, monkeypatch):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, tiny_state, metadata={"llama.rope.scale_linear": -2.0})
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    refused(path, path, "llama.rope.scale_linear must be a finite number above 0")


@pytest.mark.parametrize("metadata, named", [
    ({"llama.rope.dimension_count": 4}, "llama.rope.dimension_count must be the head dimension (8)"),
    ({"llama.attention.value_length": 16}, "llama.attention.value_length must be the head dimension (8)"),
    ({"llama.expert_count": 8, "llama.expert_used_count": 2}, "llama.expert_count is 8"),
])
def test_gguf_llama_nanospec_cannot_run_refused(tmp_path, tiny_state, monkeypatch, metadata, named):
    """Partial rotary embeddings (llama.cpp refuses a llama whose rope.dimension_count is not its head dimension),
    value heads of another size than key heads, and mixtures of experts: refused before any tensor is read, rather than run as a plain Llama."""
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, tiny_state, metadata=metadata)
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    refused(path, path, named)
    monkeypatch.undo()
    # as llama.cpp writes them
    write_tiny_gguf(path, tiny_state, metadata={"llama.rope.dimension_count": 8, "llama.attention.value_length": 8})
    assert read_gguf(path).config.head_dim == 8


@pytest.mark.parametrize("key", ["llama.block_count", "llama.context_length"])
def test_real_gguf_with_huge_header_value_refused_at_once(tmp_path, monkeypatch, key):
    """The embedded SmolLM2 with one header field flipped to 2**32 - 1: this used to allocate gigabytes (a dict of
    ~40 billion weight shapes) for minutes before a MemoryError."""
    path = tmp_path / "flipped.gguf"
    shutil.copyfile(embedded_model_path(), path)
    patch_gguf(path, key, (1 << 32) - 1)
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    refused(path, path, f"{key} must be an integer from 1 to", "got 4294967295")


@pytest.mark.parametrize("key, named", [
    ("tokenizer.ggml.token_type", "tokenizer.ggml.token_type (1099511627776 values)"),
    ("tokenizer.ggml.tokens", "tokenizer.ggml.tokens (1099511627776 values)"),
])
def test_gguf_with_huge_array_count_refused_at_once(tmp_path, tiny_state, key, named):
    """gguf's own reader loops once per claimed item (minutes for 2**26 of them, and it allocates as it goes)."""
    path = tmp_path / "flipped.gguf"
    write_tiny_gguf(path, tiny_state)
    patch_gguf(path, key, 1 << 40, array_count=True)
    refused(path, f"not a valid GGUF file: {path}", named, "the file ends at byte")


@pytest.mark.parametrize("offset, fmt, value, named", [
    (4, "<I", 7, "version 7"),
    (8, "<Q", 1 << 40, "the tensor list (1099511627776 tensors)"),
    (16, "<Q", 1 << 40, "the metadata (1099511627776 keys)"),
])
def test_gguf_with_bad_numbers_in_its_first_bytes_refused(tmp_path, tiny_state, offset, fmt, value, named):
    """The first 24 bytes: "GGUF", the version (u32), the tensor count and the key count (u64 each)."""
    path = tmp_path / "flipped.gguf"
    write_tiny_gguf(path, tiny_state)
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(data)
    refused(path, f"not a valid GGUF file: {path}", named)


def test_gguf_tensor_shape_disagreeing_with_header_refused(tmp_path, tiny_state, monkeypatch):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, {**tiny_state, "model.layers.1.mlp.up_proj.weight": torch.zeros(47, 32)})
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    refused(path, f"{path}: tensor blk.1.ffn_up.weight has shape (47, 32), but the metadata implies (48, 32)")


def test_gguf_tensor_of_integer_type_refused(tmp_path, tiny_state, monkeypatch):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, tiny_state, skip={"model.norm.weight"},
                    extra_tensors={"output_norm.weight": np.ones(32, dtype=np.int32)})
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    refused(path, f"tensor output_norm.weight in {path} has type I32")


@pytest.mark.parametrize("float16", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gguf_tensor_with_nan_or_inf_refused(tmp_path, tiny_state, float16, bad):
    weight = tiny_state["model.layers.0.self_attn.v_proj.weight"].clone()
    weight[3, 4] = bad
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, {**tiny_state, "model.layers.0.self_attn.v_proj.weight": weight}, float16=float16)
    refused(path, f"tensor blk.0.attn_v.weight in {path} holds NaN or infinite values")


@pytest.mark.parametrize("metadata, named", [
    ({"tokenizer.ggml.model": None}, "lacks the metadata key 'tokenizer.ggml.model'"),
    ({"tokenizer.ggml.tokens": None}, "lacks the metadata key 'tokenizer.ggml.tokens'"),
    ({"tokenizer.ggml.merges": None}, "lacks the metadata key 'tokenizer.ggml.merges'"),
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, "tokenizer.ggml.tokens must be an array of strings, got [1, 2, 3]"),
    ({"tokenizer.ggml.merges": ["h e", "abc"]}, "tokenizer.ggml.merges holds 'abc'"),
    ({"tokenizer.ggml.merges": ["h e", "x zz"]}, "tokenizer.ggml.tokens and tokenizer.ggml.merges do not make"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type has 2 entries for 64 tokens"),
    ({"tokenizer.ggml.unknown_token_id": 64}, "tokenizer.ggml.unknown_token_id must be a token id from 0 to 63"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token must be a boolean, got 'yes'"),
    ({"llama.vocab_size": None, "tokenizer.ggml.tokens": None}, "lacks the metadata key 'tokenizer.ggml.tokens'"),
])
def test_gguf_with_missing_or_bad_tokenizer_metadata_refused(tmp_path, tiny_state, monkeypatch, metadata, named):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, tiny_state, metadata=metadata)
    monkeypatch.setattr(gguf_file, "gguf_weight", forbidden("dequantize"))
    refused(path, path, named)


def test_gguf_with_more_tokens_than_its_vocabulary_refused(tmp_path, tiny_state):
    path = tmp_path / "bad.gguf"
    tokens = tiny_gguf_metadata()["tokenizer.ggml.tokens"] + ["<one_too_many>"]
    write_tiny_gguf(path, tiny_state, metadata={"tokenizer.ggml.tokens": tokens,
                                                "tokenizer.ggml.token_type": [1] * len(tokens)})
    refused(path, path, "tokenizer.ggml.tokens has 65 tokens, more than the model's vocabulary (64)")


# progress bars


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_loading_shows_progress_bars_on_a_terminal_only(tmp_path, tiny_state, capsys, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state)
    save_tiny_llama(tmp_path / "tiny_hf")
    capsys.readouterr()
    for path in (tmp_path / "tiny.gguf", tmp_path / "tiny_hf"):
        load_checkpoint(path, None)  # stderr is captured, not a terminal: no bar
        assert capsys.readouterr().err == ""
        terminal = FakeTerminal()
        with monkeypatch.context() as patch:
            patch.setattr(sys, "stderr", terminal)
            load_checkpoint(path, None)
        assert f"Loading {path.name}" in terminal.getvalue() and f"/{len(tiny_state)} " in terminal.getvalue()
