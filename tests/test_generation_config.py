"""The default sampling a model asks for (vLLM's --generation-config): read from generation_config.json, the
embedded model's chat defaults, or none; bad values are refused naming the file."""

import json

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
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    write(tmp_path, {"temperature": 0.3})
    assert default_sampling(str(gguf))[0] == {"temperature": 0.3}  # the file beside a .gguf


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
