"""Small BPE tokenizers of both kinds real teachers use, for vocabulary trimming tests, trained on a few standard
library files in a fraction of a second:

    gemma        Gemma's byte-fallback BPE, built the way transformers builds it from a GGUF vocabulary
                 (`surgery.storage.gguf_vocab_reader`: every split of a piece into two pieces is a merge), with control
                 tokens (<start_of_turn>, reserved <unusedN>), newline runs as added tokens and <0x00>..<0xFF>
    byte_level   a Llama 3 / Qwen2 style byte-level BPE (the 256 byte symbols are its alphabet), with the
                 pipeline transformers' Qwen2Tokenizer rebuilds (NFC, the split regex, ByteLevel)

Both put <pad>=0 <eos>=1 <bos>=2 <unk>=3 first, as `hf_reference.tiny_config` does.
"""
from __future__ import annotations

import os
import sysconfig

TRAIN_FILES = ("textwrap.py", "string.py", "bisect.py", "colorsys.py", "keyword.py", "shlex.py")
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
CONTROL, USER_DEFINED, BYTE, NORMAL = 3, 4, 6, 1  # llama.cpp token types


def stdlib_text(name: str) -> str:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
        return f.read()


def _trained_pieces(size: int) -> list[str]:
    """Pieces of a Metaspace BPE trained on TRAIN_FILES, in merge order (single characters first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False)
    tokenizer.train_from_iterator([stdlib_text(name) for name in TRAIN_FILES], trainer)
    vocab = tokenizer.get_vocab()
    return sorted(vocab, key=vocab.get)


def save_gemma_tokenizer(folder: str, size: int = 500) -> int:
    """A Gemma-style tokenizer (tokenizer.json and configs) in `folder`; returns its vocabulary size."""
    from nnx_surgery.surgery.storage.gguf_vocab_reader import build_tokenizer, tokenizer_configs
    from nnx_surgery.surgery.storage.atomic import write_json

    control = [*SPECIALS, "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused1>", "<unused2>"]
    user = ["\n", "\n\n", "\n\n\n"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    pieces = [p for p in _trained_pieces(size) if p not in set(control + user)]
    tokens = control + user + byte_pieces + pieces
    types = [CONTROL] * len(control) + [USER_DEFINED] * len(user) + [BYTE] * 256 + [NORMAL] * len(pieces)
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
                "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.unknown_token_id": 3,
                "tokenizer.chat_template": "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>"
                                           "{% endfor %}"}
    os.makedirs(folder, exist_ok=True)
    build_tokenizer(metadata, "tiny gemma").save(os.path.join(folder, "tokenizer.json"))
    config, special = tokenizer_configs(metadata, tokens, "tiny gemma")
    write_json(os.path.join(folder, "tokenizer_config.json"), config)
    write_json(os.path.join(folder, "special_tokens_map.json"), special)
    return len(tokens)


def save_byte_level_tokenizer(folder: str, size: int = 600) -> int:
    """A byte-level BPE (Llama 3 / Qwen2 style) saved the transformers way; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(3)]
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False, special_tokens=[*SPECIALS, *reserved],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([stdlib_text(name) for name in TRAIN_FILES], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                             special_tokens=[("<bos>", 2)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                      bos_token="<bos>", unk_token="<unk>",
                                      additional_special_tokens=reserved)
    wrapped.save_pretrained(folder)
    return tokenizer.get_vocab_size()


SAVERS = {"gemma": save_gemma_tokenizer, "byte_level": save_byte_level_tokenizer}
