"""The tokenizer of a GGUF file: a byte-level BPE ``tokenizers`` JSON from its ``tokenizer.ggml.*`` metadata."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from nanospec.model.config import short_repr

# How llama.cpp splits text into words before BPE, by `tokenizer.ggml.pre`. The Llama 3 family differs from GPT-2's
# split (digits in runs of up to 3, case-insensitive contractions); anything else uses GPT-2's, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")}

_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # tokenizer.ggml.token_type values

# Expected types of metadata: (test, description).
_STRING = (lambda v: isinstance(v, str), "a string")
_BOOL = (lambda v: isinstance(v, bool), "a boolean")
STRINGS = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "an array of strings")
_INTEGERS = (lambda v: isinstance(v, list) and all(type(x) is int for x in v), "an array of integers")


def tokenizer_from_metadata(metadata, vocab_size: int) -> tuple[str, dict]:
    """A byte-level BPE tokenizer (GPT-2 style, `tokenizer.ggml.model` == "gpt2") as tokenizer.json text, and its
    tokenizer_config: the same ids as transformers builds from this file. Missing or ill-typed tokenizer metadata, more
    tokens than `vocab_size`, and special token ids outside the token list are ValueErrors naming the file and key."""
    kind = metadata.require("tokenizer.ggml.model", _STRING)
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {kind!r} in {metadata.path}: nanospec reads byte-level BPE "
                         "('gpt2') tokenizers from GGUF; load the model's Hugging Face directory instead")
    tokens = metadata.require("tokenizer.ggml.tokens", STRINGS)
    if len(tokens) > vocab_size:
        raise ValueError(f"GGUF file {metadata.path}: tokenizer.ggml.tokens has {len(tokens)} tokens, more than the "
                         f"model's vocabulary ({vocab_size})")
    token_types = metadata.get("tokenizer.ggml.token_type", None, _INTEGERS) or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF file {metadata.path}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                         f"{len(tokens)} tokens")
    merges = [tuple(merge.split(" ")) for merge in metadata.require("tokenizer.ggml.merges", STRINGS)]
    bad_merge = next((" ".join(merge) for merge in merges if len(merge) != 2), None)
    if bad_merge is not None:
        raise ValueError(f"GGUF file {metadata.path}: tokenizer.ggml.merges holds {short_repr(bad_merge)}, which is "
                         "not two tokens separated by a space")

    # Every byte-level BPE token is spelled in GPT-2's 256-character byte alphabet; a few files write a token in
    # plain text instead, which we respell (ByteLevel without its regex maps every UTF-8 byte, splitting nothing).
    spelled = set(pre_tokenizers.ByteLevel.alphabet())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def respell(token: str) -> str:
        return token if set(token) <= spelled else "".join(piece for piece, _ in byte_level.pre_tokenize_str(token))

    vocab = {respell(token): index for index, token in enumerate(tokens)}
    try:
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                                              end_of_word_suffix="", fuse_unk=False))
    except Exception as error:  # tokenizers' own error type: a merge of tokens that are not in the vocabulary, ...
        raise ValueError(f"GGUF file {metadata.path}: tokenizer.ggml.tokens and tokenizer.ggml.merges do not make a "
                         f"BPE tokenizer ({error})") from None
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre", None, _STRING))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()

    # Control tokens ("<|im_start|>") are special: matched whole in text and skipped when decoding. A "control" token
    # outside the byte alphabet is a mislabel in the file and stays out, as in transformers. User-defined tokens
    # ("<think>") are matched whole but are ordinary text.
    backend.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _CONTROL_TOKEN and set(token) <= spelled
    ])
    backend.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED_TOKEN and token in vocab
    ])

    def token_of(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if type(index) is not int or not 0 <= index < len(tokens):
            raise ValueError(f"GGUF file {metadata.path}: tokenizer.ggml.{key} must be a token id from 0 to "
                             f"{len(tokens) - 1} (inside tokenizer.ggml.tokens), got {short_repr(index)}")
        return tokens[index]

    config = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
        "add_bos_token": metadata.get("tokenizer.ggml.add_bos_token", False, _BOOL),
        "chat_template": metadata.get("tokenizer.chat_template", None, _STRING),
    }
    if config["add_bos_token"] and config["bos_token"] is not None:
        # Let the tokenizer.json itself add BOS, so any reader of it (transformers included) agrees.
        bos = config["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[respell(bos)])]
        )
    return backend.to_str(), {key: value for key, value in config.items() if value is not None}

