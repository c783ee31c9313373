"""The tokenizer built from the embedded SmolLM2 GGUF: ids, decoding and chat template equal to transformers' (the
oracle, which builds its own tokenizer from the same file), and streaming decode."""

import json
import pickle

import pytest
import tokenizers

from nanospec.model.embedded import embedded_model_path
from nanospec.model.gguf_file import read_gguf
from nanospec.detokenizer import IncrementalDetokenizer
from nanospec.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Ünïcödé façade Ångström",
    "日本語のテキスト 中文文本 한국어 텍스트",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷 ✓",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "  leading spaces\tand\ttabs\n\n\nnewlines   trailing   ",
    "\t\t\n \n",
    "1234567890 3.14159 1,000,000 2024-11-22 0x1F",
    "I'm sure you're right, we'll see what they'd do.",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<repo_name>x<file_sep>",
    "not special: <|im_start and im_end|>",
    "\u00a0no-break\u200bzero-width\u2028line-sep",
    "a" * 200,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Code?\n```py\nprint('x')\n```"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer():
    model = read_gguf(embedded_model_path())
    return Tokenizer.from_json_str(model.tokenizer_json, model.tokenizer_config, model.config.eos_token_id)


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ---------------------------------------------------------------- transformers as the oracle (~20 s to build it)


@pytest.mark.slow
def test_ids_match_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer(text)["input_ids"], text


@pytest.mark.slow
def test_decode_matches_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = hf_tokenizer(text)["input_ids"]
        for skip in (True, False):
            expected = hf_tokenizer.decode(ids, skip_special_tokens=skip)
            assert tokenizer.decode(ids, skip_special_tokens=skip) == expected


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("answer", ["The capital of France is", "Sure! ", "  Well,\n", "end", "im", " "],
                         ids=["plain", "trailing", "leading", "end", "im", "blank"])
def test_continue_final_message_matches_transformers(tokenizer, hf_tokenizer, answer):
    """vLLM's and transformers' ``continue_final_message``: the text ends with the last message, left open (its
    end-of-turn cut), as transformers renders it, whether or not the template keeps the message's white space."""
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": answer}]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                continue_final_message=True)
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == expected and ours.rstrip().endswith(answer.strip() or "assistant")
    with pytest.raises(ValueError, match="set add_generation_prompt=False"):
        tokenizer.apply_chat_template(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message must be True or False"):
        tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=1)


# ---------------------------------------------------------------- on its own


def test_special_tokens(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.add_bos_token) == (1, [2], False)
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # add_bos_token is false
    assert tokenizer.decode([1, 4093, 2]) == "user"
    assert tokenizer.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_default_system_prompt(tokenizer):
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=False)
    assert without == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"


@pytest.mark.parametrize("messages", [
    [{"role": "user"}],
    [{"content": "hi"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 3}],
    ["hello"],
])
def test_malformed_messages(tokenizer, messages):
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tokenizer.apply_chat_template(messages)


def test_no_chat_template(tokenizer):
    bare = Tokenizer(tokenizer.backend, {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match="has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_helpers():
    """transformers' template environment: raise_exception, a tojson that keeps non-ASCII, the special tokens."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1}, unk_token="<s>"))
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ eos_token }}"
    )
    tokenizer = Tokenizer(backend, {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template})
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '<s>{"role": "user", "content": "é"}</s>'
    with pytest.raises(ValueError, match="^the chat template refused the conversation: users first$"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m['content'] }{% endfor %}", r"does not compile: unexpected '}' \(line 1\)"),
    ("{{ messages | nosuchfilter }}", "does not compile: No filter named 'nosuchfilter'"),
    (5, "chat_template must be a string .*, got 5"),
    ([{"template": "x"}], "chat_template: a list of templates holds .*, got {'template': 'x'}"),
])
def test_a_chat_template_that_does_not_compile_is_refused_at_once(tokenizer, template, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer(tokenizer.backend, {**tokenizer.config, "chat_template": template})


@pytest.mark.parametrize("template, message", [
    ("{{ nosuchfunction() }}", "refused the conversation: 'nosuchfunction' is undefined"),
    ("{{ messages[0]['content'] + 1 }}", "failed on the conversation: TypeError"),
])
def test_a_chat_template_that_fails_while_rendering_is_a_value_error(tokenizer, template, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer(tokenizer.backend, {"chat_template": template}).apply_chat_template([{"role": "user", "content": "x"}])


def test_a_special_token_that_is_not_a_token_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r'bos_token must be a token, a string or {"content": "..."}, got 5'):
        Tokenizer(tokenizer.backend, {**tokenizer.config, "bos_token": 5})


def test_pickles_with_its_chat_template(tokenizer):
    """A tensor-parallel worker gets the tokenizer pickled: the compiled template stays behind, compiled on use."""
    messages = [{"role": "user", "content": "Hi"}]
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_save_and_reload(tokenizer, tmp_path):
    tokenizer.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    reloaded = Tokenizer.from_file(tmp_path / "tokenizer.json", config)
    for text in TEXTS:
        assert reloaded.encode(text) == tokenizer.encode(text)
    assert reloaded.apply_chat_template(CONVERSATIONS[2]) == tokenizer.apply_chat_template(CONVERSATIONS[2])
    assert (reloaded.bos_token_id, reloaded.eos_token_ids, reloaded.add_bos_token) == (1, [2], False)


@pytest.mark.parametrize("add_bos_token", [True, False, None])
def test_bos_comes_from_the_post_processor(tokenizer, add_bos_token):
    """As transformers' AutoTokenizer with a tokenizer.json: its post-processor adds BOS (Llama style) or not
    (SmolLM2), whatever tokenizer_config.json's add_bos_token says."""
    config = {key: value for key, value in tokenizer.config.items() if key != "add_bos_token"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    hi = tokenizer.encode("hi")
    plain = Tokenizer(tokenizer.backend, config)
    assert not plain.add_bos_token and plain.encode("hi", add_special_tokens=True) == hi
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    with_bos = Tokenizer(backend, config)
    assert with_bos.add_bos_token and with_bos.encode("hi", add_special_tokens=True) == [1, *hi]
    assert with_bos.encode("hi") == hi


def test_extra_eos_token_ids(tokenizer):
    assert Tokenizer(tokenizer.backend, tokenizer.config, [2, 0, 2]).eos_token_ids == [2, 0]


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("text", [
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷 done",
    "日本語のテキスト、中文文本、한국어 텍스트。",
    "mixed: café 😀 中 a\tb\nc",
])
def test_incremental_detokenizer_streams_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters are split over several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token]) for token in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids) == text
    assert "" in deltas  # some tokens were held back until their character was complete


def test_incremental_detokenizer_after_prompt_and_special_tokens(tokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    answer = tokenizer.encode("Paris, naturellement 🇫🇷.<|im_end|>")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    deltas = [detokenizer.add(answer[i:i + 2]) for i in range(0, len(answer), 2)]  # two at a time, like speculation
    assert "".join(deltas) == detokenizer.text == "Paris, naturellement 🇫🇷."


def test_incremental_detokenizer_decodes_a_small_window(tokenizer):
    calls = []
    decode = tokenizer.decode

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return decode(ids, skip_special_tokens)

    ids = tokenizer.encode("The story goes on and on, " * 40)
    detokenizer = IncrementalDetokenizer(Spy())
    for token in ids:
        detokenizer.add([token])
    assert detokenizer.text == tokenizer.decode(ids)
    assert len(ids) > 200 and max(calls) <= 2


def test_incremental_detokenizer_flush(tokenizer):
    first_bytes_of_emoji = tokenizer.encode(" 😀")[:1]  # " " and the first bytes of the emoji
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(first_bytes_of_emoji) == ""
    assert detokenizer.flush() == tokenizer.decode(first_bytes_of_emoji)
    assert detokenizer.flush() == ""



def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2's kind of tokenizer: "▁" for spaces, characters outside the vocabulary as <0xNN> byte tokens."""
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for ch in "▁Thefox":
        vocab.setdefault(ch, len(vocab))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_incremental_detokenizer_after_any_prompt_cut(tokenizer, byte_fallback):
    """Whatever token a prompt ends at, inside a character or not, the output's text is vLLM's (tokenizers'
    DecodeStream fed the prompt first): a character the prompt began comes whole with the token that completes it,
    and a byte-fallback decoder (which turns a whole run of byte tokens that begins inside a character into U+FFFDs)
    does not garble the characters after the prompt."""
    from tokenizers.decoders import DecodeStream

    tokenizer = byte_fallback_tokenizer() if byte_fallback else tokenizer
    ids = tokenizer.encode("The 😀😀😀 fox")
    assert len(ids) >= 10  # each emoji is 2 to 4 tokens
    for cut in range(1, len(ids)):
        stream = DecodeStream(skip_special_tokens=True)
        for token in ids[:cut]:
            stream.step(tokenizer.backend, token)
        expected = "".join(stream.step(tokenizer.backend, token) or "" for token in ids[cut:])
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:cut])
        assert "".join(detokenizer.add([token]) for token in ids[cut:]) == expected, f"prompt {ids[:cut]}"
