"""Conversion to a Hugging Face directory, checked with transformers as the oracle; and the tensors read_gguf gets
from the embedded SmolLM2 (as convert writes them, unchanged, in fp32) checked against transformers' own GGUF loader,
which proves the dequantization and the q/k un-permute."""

import json

import pytest
import tokenizers
import torch
from safetensors.torch import load_file

from nanospec.convert import convert, main
from nanospec.model.embedded import embedded_model_path
from nanospec.model.loader import load_checkpoint
from nanospec.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# transformers' greedy answer on the GGUF: "The capital of France is Paris." and <|im_end|>
GREEDY_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory):
    return convert(embedded_model_path(), tmp_path_factory.mktemp("smollm2"), dtype=torch.float32)


def short_input(converted_dir):
    tokenizer = load_checkpoint(converted_dir, torch.float32).tokenizer
    return torch.tensor([tokenizer.encode(tokenizer.apply_chat_template(CHAT))])


# ---------------------------------------------------------------- the embedded GGUF


def test_transformers_loads_converted_gguf(converted_dir):
    files = {path.name for path in converted_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    model = transformers.LlamaForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(converted_dir)
    ours = load_checkpoint(converted_dir, torch.float32)
    for text in ["Hello world", "café 😀 日本語\n\tcode()", "<|im_start|>user<|im_end|>"]:
        assert hf_tokenizer(text)["input_ids"] == ours.tokenizer.encode(text, add_special_tokens=True)
    prompt = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == ours.tokenizer.apply_chat_template(CHAT)
    input_ids = torch.tensor([ours.tokenizer.encode(prompt)])
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=len(GREEDY_ANSWER),
                            do_sample=False)
    assert output[0, input_ids.shape[1]:].tolist() == GREEDY_ANSWER


@pytest.mark.slow
def test_read_gguf_matches_transformers_gguf_loader(converted_dir, transformers_smollm2):
    ours = load_file(converted_dir / "model.safetensors")  # read_gguf's fp32 tensors, saved as they are
    theirs = transformers_smollm2.state_dict()
    assert set(theirs) - {"lm_head.weight"} == set(ours)  # tied: transformers lists the shared head too
    for name, tensor in ours.items():  # both dequantize the same blocks the same way: bit-identical
        assert torch.equal(tensor, theirs[name]), f"{name}: max difference {(tensor - theirs[name]).abs().max()}"


@pytest.mark.slow
def test_converted_logits_match_transformers_gguf_loader(converted_dir, transformers_smollm2):
    input_ids = short_input(converted_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = transformers_smollm2(input_ids).logits
        actual = model(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- draft models: --num-layers


def test_num_layers_makes_a_truncated_model(converted_dir, tmp_path):
    draft_dir = convert(converted_dir, tmp_path / "draft", num_layers=4)
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    draft = transformers.LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    assert len(draft.model.layers) == 4
    full = load_checkpoint(converted_dir, torch.float32).tensors
    ours = load_checkpoint(draft_dir, torch.float32)
    assert ours.config.num_hidden_layers == 4
    assert set(ours.tensors) == {name for name in full if not name.startswith("model.layers.")
                                 or int(name.split(".")[2]) < 4}
    for name, tensor in ours.tensors.items():
        assert torch.equal(tensor, full[name]), name
        assert torch.equal(draft.state_dict()[name], full[name]), name


@pytest.mark.parametrize("num_layers", [0, -1, 31])
def test_bad_num_layers(converted_dir, tmp_path, num_layers):
    with pytest.raises(ValueError, match="num_layers must be"):
        convert(converted_dir, tmp_path / "draft", num_layers=num_layers)


def test_cli(converted_dir, tmp_path, capsys):
    main([str(converted_dir), str(tmp_path / "draft"), "--dtype", "bfloat16", "--num-layers", "2"])
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["torch_dtype"] == "bfloat16"
    checkpoint = load_checkpoint(tmp_path / "draft", None)
    assert {t.dtype for t in checkpoint.tensors.values()} == {torch.bfloat16}
    with pytest.raises(SystemExit) as exit_info:
        main([str(converted_dir), str(tmp_path / "bad"), "--num-layers", "31"])
    assert exit_info.value.code == 2 and "between 1 and 30" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere.gguf"), str(tmp_path / "bad")])
    assert "nowhere.gguf" in capsys.readouterr().err


@pytest.mark.parametrize("source, output", [("embedded", "afile"), ("embedded", "afile/sub"), ("embedded", ""),
                                            ("", "out")])
def test_cli_refuses_bad_paths_before_loading(tmp_path, capsys, monkeypatch, source, output):
    (tmp_path / "afile").write_text("a file, not a directory")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("nanospec.convert.open_checkpoint", lambda *args: pytest.fail("loaded before checking paths"))
    with pytest.raises(SystemExit) as exit_info:
        main([source, output])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1


# ---------------------------------------------------------------- a Hugging Face directory, untied head


def test_convert_hf_directory_untied(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    original = transformers.LlamaForCausalLM(config).eval()
    original.save_pretrained(tmp_path / "in", max_shard_size="20KB")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"}).save(tmp_path / "in")

    out = convert(tmp_path / "in", tmp_path / "out", dtype=torch.float32)
    converted = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    input_ids = torch.tensor([[1, 5, 9, 33, 63, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids).logits, original(input_ids).logits, rtol=0, atol=0)
    draft = load_checkpoint(convert(out, tmp_path / "draft", num_layers=1), torch.float32)
    assert "lm_head.weight" in draft.tensors and draft.config.num_hidden_layers == 1


def test_too_many_layers_refused_before_the_weights_are_read(tmp_path, monkeypatch):
    from tiny import make_tiny_llama

    make_tiny_llama(tmp_path / "in", layers=2)
    monkeypatch.setattr("nanospec.model.loader.safe_open", lambda *a, **k: pytest.fail("read the weights"))
    with pytest.raises(ValueError, match="num_layers must be between 1 and 2"):
        convert(tmp_path / "in", tmp_path / "out", num_layers=3)


@pytest.mark.parametrize("generation", [{"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 0},
                                        {"do_sample": False, "max_new_tokens": 7}])
def test_the_inputs_default_sampling_is_kept(tmp_path, generation):
    from tiny import make_tiny_llama

    from nanospec.model.generation_config import default_sampling

    make_tiny_llama(tmp_path / "in", layers=1)
    (tmp_path / "in" / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **generation}))
    out = convert(tmp_path / "in", tmp_path / "out")
    fields = default_sampling(str(tmp_path / "in"))[0]
    assert fields and default_sampling(str(out)) == (fields, str(out / "generation_config.json"))
    assert transformers.GenerationConfig.from_pretrained(out).do_sample == generation["do_sample"]
