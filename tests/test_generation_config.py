"""The default sampling a model asks for (vLLM's --generation-config): read from generation_config.json, the
embedded model's chat defaults, or none; bad values are refused naming the file."""

import json

import gguf
import pytest

from nanospec.model.embedded import EMBEDDED_SAMPLING
from nanospec.model.generation_config import default_sampling


def write(directory, config):
    directory.mkdir(exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_reads_the_model_directory(tmp_path):
    model = write(tmp_path / "m", {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
                                   "max_new_tokens": 64, "eos_token_id": 2, "min_p": 0.05})
    fields, source = default_sampling(str(model))
    assert fields == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                      "max_tokens": 64}
    assert source.endswith("generation_config.json")


def test_do_sample_false_is_greedy_and_top_k_0_keeps_every_token(tmp_path):
    model = write(tmp_path / "m", {"do_sample": False, "temperature": 0.7, "top_k": 0})
    assert default_sampling(str(model))[0] == {"temperature": 0.0, "top_k": -1}


def test_the_embedded_model_gets_the_chats_defaults_and_vllm_gets_none(tmp_path):
    assert default_sampling(None)[0] == EMBEDDED_SAMPLING == {"temperature": 0.2, "top_p": 0.9}
    assert default_sampling(None, "vllm")[0] == {}
    assert default_sampling(str(tmp_path))[0] == {}  # a directory without the file: the API's defaults


def write_gguf(path, metadata):
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        value_type = gguf.GGUFValueType.INT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32
        writer.add_key_value(key, value, value_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_a_gguf_file_gives_its_own_sampling_keys_not_a_file_beside_it(tmp_path):
    """As llama.cpp reads a GGUF (general.sampling.*); a generation_config.json beside it may be another model's."""
    write(tmp_path, {"temperature": 0.3})
    plain = write_gguf(tmp_path / "plain.gguf", {})
    assert default_sampling(str(plain)) == ({}, f"the API's defaults ({plain} has no general.sampling keys)")
    tuned = write_gguf(tmp_path / "tuned.gguf", {"general.sampling.temp": 0.5, "general.sampling.top_k": 0,
                                                "general.sampling.top_p": 0.75, "general.sampling.min_p": 0.125,
                                                "general.sampling.penalty_repeat": 1.5})
    assert default_sampling(str(tuned))[0] == {"temperature": 0.5, "top_p": 0.75, "top_k": -1, "min_p": 0.125,
                                               "repetition_penalty": 1.5}
    bad = write_gguf(tmp_path / "bad.gguf", {"general.sampling.top_p": 2.0})
    with pytest.raises(ValueError, match=r"bad\.gguf \(general\.sampling\): top_p"):
        default_sampling(str(bad))


def test_a_directory_given_explicitly(tmp_path):
    config = write(tmp_path / "c", {"top_p": 0.5})
    assert default_sampling(None, str(config))[0] == {"top_p": 0.5}
    with pytest.raises(ValueError, match="no generation_config.json"):
        default_sampling(None, str(tmp_path / "nowhere"))


@pytest.mark.parametrize("config, message", [({"temperature": -1}, "temperature"), ({"top_p": "high"}, "top_p"),
                                             ({"max_new_tokens": 0}, "max_tokens")])
def test_bad_values_name_the_file(tmp_path, config, message):
    model = write(tmp_path / "m", config)
    with pytest.raises(ValueError, match=message) as error:
        default_sampling(str(model))
    assert "generation_config.json" in str(error.value)
    (model / "generation_config.json").write_text("{nope")
    with pytest.raises(ValueError, match="generation_config.json"):
        default_sampling(str(model))


@pytest.mark.parametrize("content, message", [
    ({"max_new_tokens": "many"}, r"\.json: max_new_tokens: max_tokens must be an integer >= 1 .*'many'"),
    ({"temperature": "hot"}, r"generation_config\.json: temperature must be a number .*'hot'"),
    ({"do_sample": "no"}, r"generation_config\.json: do_sample must be true or false, got 'no'"),
    ({"top_k": False}, r"generation_config\.json: top_k must be .* got False"),
    ("a directory", r"cannot read .*generation_config\.json \(Is a directory\)"),
])
def test_a_bad_generation_config_is_refused_naming_the_file_and_key_before_any_weight(tmp_path, monkeypatch, device,
                                                                                       content, message):
    """Through LLM too: a ValueError naming the file and its key (a file that cannot be read: the file), before the
    model's weights are read; never a library's error or a file silently skipped."""
    from nanospec import LLM
    from nanospec.model import loader
    from tiny import make_tiny_llama

    make_tiny_llama(tmp_path, layers=1)
    file = tmp_path / "generation_config.json"
    file.unlink()
    if content == "a directory":
        file.mkdir()
    else:
        file.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        default_sampling(str(tmp_path))

    def forbidden(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loader, "safe_open", forbidden)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device=device, dtype="float32", num_blocks=16)
